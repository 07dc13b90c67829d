"""Following metrics.jsonl while a run writes it: not there yet, a half-written last line, a replaced file."""

from __future__ import annotations

import io
import json
import os
import threading
from pathlib import Path

from appliance.monitor.events import EventTail, EventWriter, make_event
from appliance.monitor.headless import HeadlessPrinter, follow_run
from appliance.rundir import RunDir


def line(kind: str, **fields: object) -> bytes:
    return (json.dumps(make_event(kind, t=1.0, **fields)) + "\n").encode()


def test_tail_waits_for_the_file_and_for_the_end_of_a_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = EventTail(path)
    assert tail.read_new() == []  # the run has not started
    whole = line("warning", message="one") + line("warning", message="two")
    cut = len(line("warning", message="one")) + 7
    path.write_bytes(whole[:cut])
    assert [e["message"] for e in tail.read_new()] == ["one"]
    with open(path, "ab") as f:
        f.write(whole[cut:])
    assert [e["message"] for e in tail.read_new()] == ["two"]
    assert tail.read_new() == [] and tail.bad_lines == 0


def test_tail_restarts_on_a_replaced_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(line("warning", message="old 1") + line("warning", message="old 2"))
    tail = EventTail(path)
    assert len(tail.read_new()) == 2
    fresh = tmp_path / "metrics.jsonl.new"
    fresh.write_bytes(line("warning", message="new"))
    os.replace(fresh, path)  # a new inode, shorter than what was read
    assert [e["message"] for e in tail.read_new()] == ["new"]


def test_follow_run_prints_until_stopped_then_drains(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").make()
    out = io.StringIO()
    printer = HeadlessPrinter(out, log_format="json")
    finished = threading.Event()

    def write() -> None:
        with EventWriter(run.metrics) as writer:
            for i in range(5):
                writer.emit("warning", message=f"w{i}")
            with open(run.metrics, "ab") as f:  # a half-written line while the reader polls
                f.write(b'{"t": 2.0, "kind": "run", ')
                f.flush()
                finished.wait(0.05)
                f.write(b'"state": "done"}\n')
        finished.set()

    writer_thread = threading.Thread(target=write)
    writer_thread.start()
    handled = follow_run(run.root, printer, stop=finished.is_set, poll_interval=0.01)
    writer_thread.join()
    events = [json.loads(x) for x in out.getvalue().splitlines()]
    assert handled == 6 and [e.get("message") for e in events[:5]] == [f"w{i}" for i in range(5)]
    assert events[-1] == {"t": 2.0, "kind": "run", "state": "done"}
    assert printer.state.finished


def test_follow_run_can_skip_the_history_of_a_resumed_run(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").make()
    run.metrics.write_bytes(line("warning", message="before the resume"))
    out = io.StringIO()
    printer = HeadlessPrinter(out)
    assert follow_run(run.root, printer, stop=lambda: True, skip_existing=True) == 0
    assert out.getvalue() == "" and len(printer.state.warnings) == 1
