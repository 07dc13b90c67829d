"""`tokenize`: a prepared corpus -> Megatron .bin/.idx datasets outside `run`, as Megatron's preprocess_data.py.

The datasets are built by tokenize_corpus.build_indexed_datasets, the code of the `run` pipeline's data stage, so
the output directory holds exactly what a run's data/ holds: <lang>_text_document.bin/.idx and datasets.json.

The output directory follows the rule of every output folder (appliance/output_dirs.py): new, empty, or an earlier
`tokenize` output (its marker, or for one made before markers, its tokenize.json), and not one of the inputs.
tokenize.json, written beside the datasets, records the inputs they were built from:
- same inputs and every dataset complete: nothing to do ("up to date"), the files are left untouched;
- same inputs but an interrupted or damaged output: built again;
- another corpus or tokenizer: refused with exit 2 unless --force, which builds the datasets again;
- other files: refused with exit 2 unless --force, which builds beside them (they are kept, and a taken name of
  ours is refused still).
Only the files an earlier tokenize wrote are ever replaced or removed.
"Same inputs" means the same tokenizer bytes (SHA-256: a tokenizer file is a few MB) and the same shard files by
name, size and modification time (hashing a terabyte corpus to decide whether to skip would cost as much as
tokenizing it; make and rsync decide the same way).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.data.indexed import IndexedDataset
from appliance.data.tokenize_corpus import (
    DATASETS_JSON,
    SHARD_GLOB,
    build_indexed_datasets,
    list_shards,
    load_tokenizer_with_eod,
)
from appliance.errors import BadInput
from appliance.output_dirs import MARKER, OutputDir, claim_dir, read_json_object

SayFn = Callable[[str], None]
TOKENIZER_JSON = "tokenizer.json"
# Written at the start (state "started") and rewritten at the end (state "done"): an interrupted tokenize is then
# recognised as ours and may be redone without --force.
MANIFEST = "tokenize.json"
OUTPUT_NAMES = (MANIFEST, DATASETS_JSON, "*_text_document.bin", "*_text_document.idx")  # what tokenize writes
# One progress line at most this often: a 1 TB corpus prints a few thousand lines, a small one only the last.
PROGRESS_EVERY_S = 10.0


def resolve_tokenizer(path: Path) -> Path:
    """--tokenizer: a tokenizer.json file, or a directory holding one (what `tokenizer --out` writes)."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_JSON
        if not path.is_file():
            raise BadInput(f"--tokenizer {path.parent}: no {TOKENIZER_JSON} in this directory")
        return path
    if not path.is_file():
        raise BadInput(f"--tokenizer {path}: no such file or directory")
    return path


def check_corpus(corpus: Path) -> list[Path]:
    """The corpus's shards; a raw file or a directory without shards is refused with the `prep` to run first."""
    corpus = Path(corpus)
    if corpus.is_file():
        raise BadInput(
            f"--corpus {corpus}: a file; tokenize reads a prepared corpus directory ({SHARD_GLOB}):"
            f" run `prep --input {corpus} --out D` first"
        )
    return list_shards(corpus)


def inputs_key(shards: list[Path], tokenizer_json: Path, *, append_eod: bool) -> str:
    digest = hashlib.sha256(f"append_eod={append_eod}\n".encode())
    digest.update(hashlib.sha256(tokenizer_json.read_bytes()).digest())
    for shard in shards:
        st = shard.stat()
        digest.update(f"{shard.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _earlier_tokenize(out_dir: Path) -> list[str] | None:
    """An output tokenize wrote before the marker existed: its tokenize.json, and the files it names."""
    manifest = read_json_object(out_dir / MANIFEST)
    if manifest is None or "inputs" not in manifest:
        return None
    prefixes = [p for p in manifest.get("prefixes", []) if isinstance(p, str)]
    return [MANIFEST, DATASETS_JSON, *(f"{prefix}{suffix}" for prefix in prefixes for suffix in (".bin", ".idx"))]


def _complete(out_dir: Path) -> dict | None:
    """datasets.json, when every dataset it lists opens (its .idx agrees with its .bin) with the counts it states."""
    try:
        summary = json.loads((out_dir / DATASETS_JSON).read_text(encoding="utf-8"))
        for entry in summary.values():
            ds = IndexedDataset(out_dir / entry["prefix"])
            if (len(ds), ds.num_tokens) != (entry["documents"], entry["tokens"]):
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, BadInput):
        return None
    return dict(summary)


def _refusal(out_dir: Path, manifest: dict[str, Any]) -> str:
    return (
        f"--out {out_dir}: an earlier tokenize output of other inputs (corpus {manifest.get('corpus')}, tokenizer"
        f" {manifest.get('tokenizer')}; the shards or the tokenizer differ); choose an empty directory, or add --force"
        " to build it again"
    )


def _remove_stale(out: OutputDir) -> None:
    """Before a rebuild: the temporary files of an interrupted build, and the datasets of languages an earlier
    tokenize wrote here (the new build writes the ones it finds again; a language gone from the corpus must not
    linger beside the new datasets.json). Only in an earlier output of ours, and only its own files."""
    if not out.owned:
        return
    for tmp in out.root.glob("*_text_document.*.tmp-*"):
        tmp.unlink()
    for name in out.owned:
        if name.endswith(("_text_document.bin", "_text_document.idx")):
            (out.root / name).unlink(missing_ok=True)


def _write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    tmp = out_dir / f"{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / MANIFEST)


def _progress_printer(say: SayFn, every_s: float) -> Callable[[float, str], None]:
    started = time.monotonic()
    last = [started]

    def progress(fraction: float, message: str) -> None:
        now = time.monotonic()
        if fraction < 1.0 and now - last[0] < every_s:
            return
        last[0] = now
        elapsed = now - started
        # Time left by the rate so far: bytes done / elapsed is the throughput; no estimate before 1 %.
        left = f", about {elapsed * (1 - fraction) / fraction:.0f} s left" if 0.01 <= fraction < 1.0 else ""
        say(f"tokenize: {fraction:6.1%}  {message}  ({elapsed:.0f} s{left})")

    return progress


def tokenize_corpus_dir(
    corpus: Path,
    tokenizer: Path,
    out_dir: Path,
    *,
    workers: int = 1,
    force: bool = False,
    say: SayFn = print,
    progress_every_s: float = PROGRESS_EVERY_S,
    on_progress: Callable[[float, str], None] | None = None,
) -> dict[str, Any]:
    """Build out_dir's datasets from corpus's shards; return {"state": "built" | "up to date", "datasets": ...}.

    Every input is checked (exit 2 naming the file) before out_dir is touched. Progress goes to `on_progress`
    (fraction, message) when given, else to `say`, a line every `progress_every_s` at most.
    """
    corpus, out_dir = Path(corpus), Path(out_dir)
    if workers < 1:
        raise BadInput(f"--workers must be at least 1, got {workers}")
    shards = check_corpus(corpus)
    tokenizer_json = resolve_tokenizer(tokenizer)
    load_tokenizer_with_eod(tokenizer_json)  # a bad tokenizer fails here, before out_dir is touched
    out = claim_dir(
        out_dir,
        "tokenize",
        inputs={"--corpus": [corpus], "--tokenizer": [tokenizer_json]},
        force=force,
        legacy=_earlier_tokenize,
        writes=OUTPUT_NAMES,
    )
    key = inputs_key(shards, tokenizer_json, append_eod=True)

    previous = read_json_object(out_dir / MANIFEST) if out.owned else None
    if previous is not None and previous.get("inputs") == key and previous.get("state") == "done":
        summary = _complete(out_dir)
        if summary is not None:
            say(f"tokenize: {out_dir} is up to date with {corpus} and {tokenizer_json}; nothing to do")
            return {"state": "up to date", "datasets": summary}
    if previous is not None and previous.get("inputs") != key and not force:
        raise BadInput(_refusal(out_dir, previous))

    was_empty = not out_dir.is_dir() or not any(out_dir.iterdir())
    _remove_stale(out)
    out.begin([MANIFEST, DATASETS_JSON])
    manifest = {"corpus": str(corpus.resolve()), "tokenizer": str(tokenizer_json.resolve()), "inputs": key}
    _write_manifest(out_dir, {**manifest, "state": "started"})
    total_mb = sum(s.stat().st_size for s in shards) / 1e6
    say(f"tokenize: {len(shards)} shards ({total_mb:.1f} MB) with {tokenizer_json} -> {out_dir}, {workers} workers")
    try:
        summary = build_indexed_datasets(
            corpus,
            tokenizer_json,
            out_dir,
            workers=workers,
            on_progress=on_progress or _progress_printer(say, progress_every_s),
        )
    except BaseException:
        # A bad shard line or a Ctrl-C: an --out that was empty is left empty (the writers removed their
        # temporary files), so the rerun after the fix is not refused as "another tokenize's output".
        if was_empty and sorted(p.name for p in out_dir.iterdir()) == sorted([MANIFEST, MARKER]):
            (out_dir / MANIFEST).unlink()
            (out_dir / MARKER).unlink()
        raise
    prefixes = sorted(entry["prefix"] for entry in summary.values())
    _write_manifest(out_dir, {**manifest, "state": "done", "prefixes": prefixes})
    out.mark([MANIFEST, DATASETS_JSON, *(f"{prefix}{suffix}" for prefix in prefixes for suffix in (".bin", ".idx"))])
    return {"state": "built", "datasets": summary}
