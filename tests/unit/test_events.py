import json
import os

import pytest

from appliance.monitor.events import EventTail, EventWriter, make_event


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
