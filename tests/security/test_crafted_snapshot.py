"""A crafted metrics.snapshot runs no code. A run directory is what people copy between machines ("look at my
run"), and the snapshot's checksums are written by whoever writes the file, so they prove nothing: the payload
itself must be data. Each reader that attaches (monitor/snapshot.py `attach`, the call of the dashboard and of
a resumed headless follower) is handed a snapshot whose header matches its metrics.jsonl and whose payload is a
pickle that creates a file when loaded the way version 1 loaded it; none may create the file, each must say why
it refused the snapshot, and each must show what a full read of metrics.jsonl shows."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import pickle
import shlex
import shutil
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from appliance.monitor.events import EventTail
from appliance.monitor.headless import HeadlessPrinter, follow_run
from appliance.monitor.snapshot import attach, save_snapshot, snapshot_path
from appliance.monitor.state import RunState, reduce
from appliance.monitor.state_fields import Series

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests" / "tui" / "fixtures" / "gpu-8xa100" / "metrics.jsonl"
REDUCER_MODULE = "appliance.monitor.state"  # the version 1 unpickler admitted any type found by a dotted name here


def _text(value: str) -> bytes:
    data = value.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _global(name: str) -> bytes:
    """Push the object at `name` inside the reducer module (STACK_GLOBAL: protocol 4 resolves a dotted name)."""
    return _text(REDUCER_MODULE) + _text(name) + pickle.STACK_GLOBAL


def touching_pickle(target: Path) -> bytes:
    """A pickle that creates `target` when a version 1 snapshot reader loads it. That reader admitted every *type*
    in the reducer modules, and state.finite.__class__ (the function type) and state.finite.__code__.__class__
    (the code type) are types: the pickle builds a code object, a function of it, and calls the function."""
    code = compile(f"import pathlib\npathlib.Path({str(target)!r}).touch()", "<snapshot>", "exec")
    code_args = (
        code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_nlocals, code.co_stacksize,
        code.co_flags, code.co_code, code.co_consts, code.co_names, code.co_varnames, code.co_filename,
        code.co_name, code.co_qualname, code.co_firstlineno, code.co_linetable, code.co_exceptiontable,
        code.co_freevars, code.co_cellvars,
    )  # fmt: skip
    args = pickle.dumps(code_args, protocol=3)[2:-1]  # the tuple's opcodes, without PROTO and STOP
    return (
        pickle.PROTO + b"\x04"
        + _global("finite.__class__")  # FunctionType, called below with (code, {})
        + _global("finite.__code__.__class__") + args + pickle.REDUCE  # CodeType(*code_args)
        + pickle.EMPTY_DICT + pickle.TUPLE2 + pickle.REDUCE  # FunctionType(code, {})
        + pickle.EMPTY_TUPLE + pickle.REDUCE  # the function, called
        + pickle.STOP
    )  # fmt: skip


def crafted_run(tmp_path: Path) -> tuple[Path, Path]:
    """(metrics.jsonl of a recorded run, the file its crafted snapshot would create). The header is a real one for
    this metrics.jsonl (format, version, shape, fingerprints) with the payload's own checksums."""
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    data = RECORDED.read_bytes()
    metrics.write_bytes(data)
    offset = data.index(b"\n", len(data) // 2) + 1
    save_snapshot(metrics, RunState(), offset)
    target = tmp_path / "code-ran"
    payload = touching_pickle(target)
    snap = snapshot_path(metrics)
    header = json.loads(snap.read_bytes().split(b"\n", 1)[0])
    header.update(payload_bytes=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest())
    snap.write_bytes(json.dumps(header).encode() + b"\n" + payload)
    return metrics, target


def plain(value: Any) -> Any:
    """A RunState (or any part of it) as comparable data; NaN as a string so that NaN equals NaN."""
    if isinstance(value, Series):
        return {name: plain(getattr(value, name)) for name in Series.__slots__}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        skip = ("changed", "_nodes")  # the sections still to redraw, and a parse cache of _gpu_raw
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name not in skip}
    if isinstance(value, dict):
        return {repr(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | deque | set):
        return [plain(v) for v in value]
    return "nan" if isinstance(value, float) and math.isnan(value) else value


def full_read(metrics: Path) -> Any:
    state = RunState()
    for event in EventTail(metrics).read_new():
        reduce(state, event)
    return plain(state)


def test_the_payload_runs_code_when_unpickled(tmp_path: Path) -> None:
    """Positive control: the payload the readers below get does create the file, when anything unpickles it."""
    target = tmp_path / "code-ran"
    pickle.loads(touching_pickle(target))
    assert target.exists()


def test_attach_refuses_a_crafted_snapshot_and_reads_the_whole_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metrics, target = crafted_run(tmp_path)
    with caplog.at_level(logging.WARNING, logger="appliance.monitor.snapshot"):
        state, tail, loaded = attach(metrics)
    assert not target.exists(), "loading the snapshot ran the code in its payload"
    assert loaded.state is None and loaded.refused and str(snapshot_path(metrics)) in loaded.reason
    assert [r.getMessage() for r in caplog.records] == [f"{loaded.reason}; reading all of metrics.jsonl instead"]
    for event in tail.read_new():
        reduce(state, event)
    assert tail.bytes_read == metrics.stat().st_size
    assert plain(state) == full_read(metrics)


def test_a_resumed_headless_follower_refuses_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics, target = crafted_run(tmp_path)
    log = tmp_path / "log.txt"
    with open(log, "w") as stream, caplog.at_level(logging.WARNING, logger="appliance.monitor.snapshot"):
        printer = HeadlessPrinter(stream=stream)
        follow_run(metrics.parent, printer, stop=lambda: True, skip_existing=True, snapshot_every_s=None)
    assert not target.exists(), "the follower's attach ran the code in the snapshot"
    assert any("metrics.snapshot cannot be read" in r.getMessage() for r in caplog.records), caplog.text
    assert plain(printer.state) == full_read(metrics)


def test_the_dashboard_refuses_it_and_says_so(tmp_path: Path) -> None:
    from appliance.tui.app import make_app

    metrics, target = crafted_run(tmp_path)

    async def first_read() -> tuple[str, list[tuple[str, str]], Any]:
        app = make_app(metrics.parent, follow=False)  # what `tui --run-dir` runs (run_tui), headless
        async with app.run_test(size=(160, 50), notifications=True) as pilot:
            while app.reads_done < 1:
                await pilot.pause(0.02)
            notes = [(n.severity, n.message) for n in app._notifications]
            return app.attach_note, notes, plain(app.state)

    note, notes, state = asyncio.run(first_read())
    assert not target.exists(), "the dashboard ran the code in the snapshot"
    assert "metrics.snapshot cannot be read" in note
    assert notes == [("warning", f"{note}; reading all of metrics.jsonl instead")]
    assert state == full_read(metrics)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed, for the real-terminal test")
def test_the_tui_command_refuses_it_in_a_terminal(tmp_path: Path) -> None:
    """`bloom_appliance.py tui --run-dir D` itself, in a tmux pane on a private socket."""
    metrics, target = crafted_run(tmp_path)
    tmux = ["tmux", "-S", str(tmp_path / "tmux.sock")]
    command = shlex.join([sys.executable, str(REPO / "bloom_appliance.py"), "tui", "--run-dir", str(metrics.parent)])
    shell = f"unset COLUMNS LINES && {command}; sleep 60"  # the pane's size, not the test process's
    subprocess.run([*tmux, "new-session", "-d", "-s", "tui", "-x", "160", "-y", "50", shell], check=True)
    warning = "SnapshotDataError"  # one word of the toast, which wraps its long message at any space
    try:
        deadline, text = time.monotonic() + 30, ""
        while warning not in text and time.monotonic() < deadline:
            time.sleep(0.2)
            text = subprocess.run([*tmux, "capture-pane", "-p", "-t", "tui"], capture_output=True, text=True).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, check=False)
    assert not target.exists(), "the tui command ran the code in the snapshot"
    assert warning in text, f"no warning about the refused snapshot on screen:\n{text}"
