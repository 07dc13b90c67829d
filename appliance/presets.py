"""Finding and reading the TOML preset files under presets/ (hardware profiles, model shapes, reference layouts).

A preset is named by its file stem (`presets/models/bloom-1b7.toml` is "bloom-1b7"). Anything that names an existing
file, or ends in ".toml", is read as a path instead, so `--model ./my-shape.toml` and `--model bloom-1b7` both work.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from appliance.errors import BadInput

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
KINDS = ("hardware", "models", "reference")


def preset_dir(kind: str) -> Path:
    if kind not in KINDS:
        raise ValueError(f"unknown preset kind {kind!r}; expected one of {KINDS}")
    return PRESETS_DIR / kind


def list_presets(kind: str) -> list[str]:
    """Names of the presets of one kind, sorted."""
    return sorted(p.stem for p in preset_dir(kind).glob("*.toml"))


def preset_files(kind: str | None = None) -> list[Path]:
    """Every preset file (of one kind, or of all kinds), sorted by path."""
    kinds = KINDS if kind is None else (kind,)
    return sorted(p for k in kinds for p in preset_dir(k).glob("*.toml"))


def find_preset(kind: str, name_or_path: str) -> Path:
    """The file a preset name or a path refers to; BadInput naming the known presets when there is none."""
    candidate = Path(name_or_path).expanduser()
    if name_or_path.endswith(".toml") or candidate.is_file():
        if not candidate.is_file():
            raise BadInput(f"{kind} file {name_or_path}: no such file")
        return candidate
    named = preset_dir(kind) / f"{name_or_path}.toml"
    if named.is_file():
        return named
    known = ", ".join(list_presets(kind)) or "none"
    raise BadInput(f"unknown {kind} preset {name_or_path!r} (not a file either); known presets: {known}")


def read_toml(path: Path) -> dict[str, Any]:
    """Parse one TOML file; BadInput naming the file on unreadable or malformed input."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise BadInput(f"{path}: cannot read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 text: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"{path}: not valid TOML: {e}") from e


def load_preset(kind: str, name_or_path: str) -> tuple[Path, dict[str, Any]]:
    """Find and parse a preset: (its path, its table)."""
    path = find_preset(kind, name_or_path)
    return path, read_toml(path)
