import json
import os

import pytest

from appliance.monitor.events import EventTail, EventWriter, make_event, read_events, read_events_backwards


def test_unknown_kind_or_missing_key_fails_where_made():
    with pytest.raises(ValueError, match="unknown event kind"):
        make_event("stpe", step=1)
    with pytest.raises(ValueError, match="lacks"):
        make_event("checkpoint", step=1)


def test_tail_reads_only_new_lines_and_waits_for_half_written_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = EventTail(path)
    assert tail.read_new() == []  # run not started yet
    w = EventWriter(path)
    w.emit("warning", message="a")
    assert [e["message"] for e in tail.read_new()] == ["a"]
    with open(path, "a") as f:
        f.write(json.dumps({"t": 1, "kind": "warning", "message": "b"})[:10])
    assert tail.read_new() == []
    with open(path, "a") as f:
        f.write(json.dumps({"t": 1, "kind": "warning", "message": "b"})[10:] + "\n")
    assert [e["message"] for e in tail.read_new()] == ["b"]


def test_tail_restarts_on_replaced_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    EventWriter(path).emit("warning", message="old")
    tail = EventTail(path)
    assert len(tail.read_new()) == 1
    os.remove(path)
    EventWriter(path).emit("warning", message="new")
    assert [e["message"] for e in tail.read_new()] == ["new"]


def test_backwards_reading_yields_complete_events_newest_first_across_blocks(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert list(read_events_backwards(path)) == []  # no run yet
    with EventWriter(path) as w:
        for i in range(50):
            w.emit("warning", message=f"event {i} " + "x" * (i % 7))
    with open(path, "a") as f:
        f.write('{"t": 1, "kind": "warn')  # a line still being written
    for block in (7, 64, 1 << 16):  # blocks that cut lines anywhere, and one that holds the whole file
        assert [e["message"] for e in read_events_backwards(path, block_bytes=block)] == [
            e["message"] for e in reversed(list(read_events(path)))
        ]
    assert next(read_events_backwards(path))["message"].startswith("event 49 ")
