"""The training core never imports Textual: only appliance/tui/ may (docs/ARCHITECTURE.md)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def core_modules() -> list[str]:
    modules = []
    for path in sorted((ROOT / "appliance").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if "tui" in rel.parts:
            continue
        modules.append(".".join(p for p in rel.parts if p != "__init__"))
    return modules


def test_importing_every_core_module_leaves_textual_unimported():
    code = (
        "import importlib, sys\n"
        f"for m in {core_modules()!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'textual')\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
