"""kernels.json: every kernel measurement a run directory has made, one entry per GPU, software, op and shape.

A measurement holds where everything it depended on is equal: the GPU (name and compute capability), torch, triton
and the project's versions, which op (or the block-level check, "block"), and the sizes that op is fed
(`OP_SHAPE_FIELDS`: LayerNorm never sees the vocabulary, so a run at another vocabulary reuses its entry). Entries
accumulate: a run at a new micro-batch adds its own and leaves the others, so going back to an earlier micro-batch
reads its measurement instead of measuring again (about 90 s on an H200 for the four ops). An entry is used only
when its whole key is equal.

Format 2 (written since the key became per op):

    {"format": 2, "entries": [{"key": {"device", "capability", "torch", "triton", "project", "op", "shape"},
                               "record": {...}}, ...]}

with `record` an op's {"choice", "times_ms", "rejected", "flash_tiles"} or the block check's {"choices", "chosen",
"times_ms", "rejected"} (kernels/selection.py and kernels/selection_block.py write them). Format 1, before it, held
one selection (kernels/selection.py's Selection.to_json at that time: a key with the rank's whole shape, the choice
of every op); it is read as one entry per op it measured. A file that does not parse, or of another format, is
measured again and replaced, as a stale cache always was.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = 2
BLOCK = "block"  # the op name of the block-level check's entries
# The RankShapes fields (kernels/selection.py) each op's inputs are built from (selection.op_case), and the block's.
OP_SHAPE_FIELDS: dict[str, tuple[str, ...]] = {
    "layer_norm": ("micro_batch_size", "seq_len", "hidden", "dtype"),
    "bias_gelu": ("micro_batch_size", "seq_len", "ffn", "dtype"),
    "flash_alibi_attention": ("micro_batch_size", "seq_len", "heads", "head_dim", "dtype", "documents"),
    "vocab_cross_entropy": ("micro_batch_size", "seq_len", "hidden", "vocab", "dtype"),
    BLOCK: ("micro_batch_size", "seq_len", "hidden", "heads", "head_dim", "ffn", "dtype", "documents"),
}
_KEY_FIELDS = ("device", "capability", "torch", "triton", "project")


@dataclass(frozen=True)
class EntryKey:
    """Where one measurement holds (the module docstring)."""

    device: str
    capability: str
    torch: str
    triton: str
    project: str
    op: str
    shape: tuple[tuple[str, Any], ...]  # (field, value) in OP_SHAPE_FIELDS[op]'s order

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in (*_KEY_FIELDS, "op")} | {"shape": dict(self.shape)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EntryKey:
        shape = data["shape"]
        fields = OP_SHAPE_FIELDS[data["op"]]
        if set(shape) != set(fields):
            raise ValueError(f"kernels.json: {data['op']} entry's shape has {sorted(shape)}, not {sorted(fields)}")
        return cls(**{name: str(data[name]) for name in _KEY_FIELDS}, op=data["op"],
                   shape=tuple((name, shape[name]) for name in fields))  # fmt: skip


def entry_key(where: Mapping[str, Any], op: str, shapes: Mapping[str, Any]) -> EntryKey:
    """The key of `op`'s measurement at the rank's `shapes` (RankShapes' fields) on the GPU and software `where`
    names (SelectionKey's fields)."""
    return EntryKey(**{name: where[name] for name in _KEY_FIELDS}, op=op,
                    shape=tuple((name, shapes[name]) for name in OP_SHAPE_FIELDS[op]))  # fmt: skip


class SelectionCache:
    """The entries of one kernels.json, read once, added to, written back whole."""

    def __init__(self, entries: Mapping[EntryKey, dict[str, Any]] | None = None) -> None:
        self._entries: dict[EntryKey, dict[str, Any]] = dict(entries or {})
        self.added: list[EntryKey] = []  # since load: what save() has to write

    def get(self, key: EntryKey) -> dict[str, Any] | None:
        return self._entries.get(key)

    def put(self, key: EntryKey, record: dict[str, Any]) -> None:
        self._entries[key] = record
        self.added.append(key)

    def items(self) -> list[tuple[EntryKey, dict[str, Any]]]:
        return list(self._entries.items())

    @classmethod
    def load(cls, path: Path | None) -> SelectionCache:
        """The file's entries; none when there is no file, or it does not parse, or is of another format (those
        are measured again and replaced)."""
        if path is None or not path.exists():
            return cls()
        try:
            return cls(parse(json.loads(path.read_text())))
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls()

    def save(self, path: Path) -> None:
        """Every entry, written to a temporary name and renamed: a reader sees the old file or the new one."""
        data = {"format": FORMAT, "entries": [{"key": k.to_json(), "record": r} for k, r in self._entries.items()]}
        path.parent.mkdir(parents=True, exist_ok=True)  # bench's runs/bench/ on a fresh checkout
        temporary = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        temporary.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(temporary, path)


def parse(data: Mapping[str, Any]) -> dict[EntryKey, dict[str, Any]]:
    """kernels.json's entries, format 2 or 1; ValueError for another format."""
    if "format" not in data and "choices" in data:
        return _format_1(data)
    if data.get("format") != FORMAT:
        raise ValueError(f"kernels.json: format {data.get('format')!r}, this version reads {FORMAT} and 1")
    return {EntryKey.from_json(entry["key"]): dict(entry["record"]) for entry in data["entries"]}


def _format_1(data: Mapping[str, Any]) -> dict[EntryKey, dict[str, Any]]:
    """A format-1 selection as one entry per op it timed: that op's choice, times, rejections (and tiles)."""
    key, shapes = data["key"], data["key"]["shapes"]
    entries = {}
    for op, times in data["times_ms"].items():
        if op not in OP_SHAPE_FIELDS or op not in data["choices"]:
            continue  # an op no candidate ran for: measured again
        entries[entry_key(key, op, shapes)] = {
            "choice": data["choices"][op],
            "times_ms": dict(times),
            "rejected": dict(data.get("rejected", {}).get(op, {})),
            "flash_tiles": data.get("flash_tiles") if op == "flash_alibi_attention" else None,
        }
    return entries
