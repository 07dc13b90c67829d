"""Attaching to a long run: a saved reducer state plus the newer tail of metrics.jsonl reads the same as the whole
file, a doubtful snapshot falls back to the whole file, and the cost of an attach does not grow with the run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import pickle
import threading
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from appliance.monitor import snapshot
from appliance.monitor.events import EventTail
from appliance.monitor.headless import HeadlessPrinter, follow_run
from appliance.monitor.snapshot import SnapshotSaver, attach, load_snapshot, save_snapshot, snapshot_path
from appliance.monitor.state import RunState, reduce
from appliance.monitor.state_fields import Series

FIXTURES = Path(__file__).resolve().parents[1] / "tui" / "fixtures"
RECORDED = ("cpu-2core", "gpu-8xa100")


def plain(value: Any) -> Any:
    """A RunState (or any part of it) as plain comparable data; NaN as a string so that NaN equals NaN."""
    if isinstance(value, Series):
        return {name: plain(getattr(value, name)) for name in Series.__slots__}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        skip = ("changed", "_nodes")  # the sections still to redraw, and a parse cache of _gpu_raw
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name not in skip}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | deque):
        return [plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(map(repr, value))
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def full_read(metrics: Path) -> RunState:
    state = RunState()
    for event in EventTail(metrics).read_new():
        reduce(state, event)
    return state


def line_ends(data: bytes) -> list[int]:
    return [i + 1 for i, byte in enumerate(data) if byte == ord("\n")]


def recorded_run(tmp_path: Path, name: str) -> Path:
    metrics = tmp_path / name / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_bytes((FIXTURES / name / "metrics.jsonl").read_bytes())
    return metrics


def state_before(metrics: Path, offset: int) -> RunState:
    state = RunState()
    for raw in metrics.read_bytes()[:offset].splitlines():
        if raw.strip():
            reduce(state, json.loads(raw))
    return state


@pytest.mark.parametrize("name", RECORDED)
def test_snapshot_plus_tail_equals_a_full_read_of_a_recorded_run(tmp_path: Path, name: str) -> None:
    metrics = recorded_run(tmp_path, name)
    expected = plain(full_read(metrics))
    ends = line_ends(metrics.read_bytes())
    for offset in (ends[0], ends[len(ends) // 3], ends[2 * len(ends) // 3], ends[-1]):  # early, middle, all
        save_snapshot(metrics, state_before(metrics, offset), offset)
        state, tail, loaded = attach(metrics)
        assert loaded.reason == "" and loaded.offset == offset
        for event in tail.read_new():
            reduce(state, event)
        assert plain(state) == expected, f"{name}: snapshot at byte {offset} + tail differs from the full read"
        assert tail.bytes_read == metrics.stat().st_size - offset


def test_the_follower_keeps_a_snapshot_that_equals_its_own_state(tmp_path: Path) -> None:
    metrics = recorded_run(tmp_path, "gpu-8xa100")
    printer = HeadlessPrinter(stream=open(tmp_path / "log.txt", "w"))  # noqa: SIM115 (closed with tmp_path)
    done = threading.Event()
    done.set()  # one read of everything, then the final save
    follow_run(
        metrics.parent, printer, stop=done.is_set, poll_interval=0.01, snapshot_every_s=0.0, snapshot_min_bytes=1
    )
    printer.stream.close()
    assert snapshot_path(metrics).exists(), "follow_run did not save a snapshot when it stopped"
    loaded = load_snapshot(metrics)
    assert loaded.state is not None and loaded.offset == metrics.stat().st_size
    assert plain(loaded.state) == plain(printer.state) == plain(full_read(metrics))


def test_a_resumed_follower_starts_from_the_snapshot_and_prints_only_new_events(tmp_path: Path) -> None:
    metrics = recorded_run(tmp_path, "gpu-8xa100")
    data = metrics.read_bytes()
    offset = line_ends(data)[-3]
    saved = state_before(metrics, offset)
    saved.bad_events = 1000  # a mark that only the snapshot carries: it proves the follower started from it
    save_snapshot(metrics, saved, offset)
    log = tmp_path / "log.txt"
    with open(log, "w") as stream:
        printer = HeadlessPrinter(stream=stream, log_format="json")
        follow_run(metrics.parent, printer, stop=lambda: True, skip_existing=True, snapshot_every_s=None)
    assert log.read_text() == ""  # history is absorbed, not printed
    expected = full_read(metrics)
    expected.bad_events = 1000
    assert plain(printer.state) == plain(expected)
    assert printer.state.events == len(line_ends(data))


def spoil(path: Path, header_change: dict[str, Any] | None = None, flip_payload_byte: bool = False) -> None:
    header_line, payload = path.read_bytes().split(b"\n", 1)
    header = {**json.loads(header_line), **(header_change or {})}
    if flip_payload_byte:
        payload = payload[:100] + bytes([payload[100] ^ 0xFF]) + payload[101:]
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload)


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("flip a payload byte", "damaged"),
        ("cut the file short", "damaged"),
        ("garbage", "cannot be read"),
        ("other version", "another version"),
        ("other reducer shape", "another version"),
        ("metrics.jsonl rewritten before the offset", "another metrics.jsonl"),
        ("metrics.jsonl truncated", "more than"),
        ("metrics.jsonl replaced by another run", "another metrics.jsonl"),
    ],
)
def test_a_doubtful_snapshot_falls_back_to_the_full_read(tmp_path: Path, how: str, reason: str) -> None:
    metrics = recorded_run(tmp_path, "gpu-8xa100")
    data = metrics.read_bytes()
    offset = line_ends(data)[len(line_ends(data)) // 2]
    save_snapshot(metrics, state_before(metrics, offset), offset)
    snap = snapshot_path(metrics)
    if how == "flip a payload byte":
        spoil(snap, flip_payload_byte=True)
    elif how == "cut the file short":
        snap.write_bytes(snap.read_bytes()[:-50])
    elif how == "garbage":
        snap.write_bytes(b"\x00\xff not a snapshot")
    elif how == "other version":
        spoil(snap, {"version": snapshot.VERSION + 1})
    elif how == "other reducer shape":
        spoil(snap, {"shape": "0" * 16})
    elif how == "metrics.jsonl rewritten before the offset":
        metrics.write_bytes(data.replace(b'"loss":', b'"loss" :', 1))
    elif how == "metrics.jsonl truncated":
        metrics.write_bytes(data[: offset - 10])
    else:
        metrics.write_bytes((FIXTURES / "cpu-2core" / "metrics.jsonl").read_bytes() + data)
    state, tail, loaded = attach(metrics)
    assert loaded.state is None and loaded.refused and reason in loaded.reason, loaded.reason
    for event in tail.read_new():
        reduce(state, event)
    assert tail.bytes_read == metrics.stat().st_size  # the whole file, from byte 0
    assert plain(state) == plain(full_read(metrics))


def test_a_version_1_snapshot_is_refused_and_the_whole_file_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Version 1 held a pickle: a run directory from before the JSON payload gets the full read, and says why."""
    metrics = recorded_run(tmp_path, "gpu-8xa100")
    offset = line_ends(metrics.read_bytes())[-5]
    save_snapshot(metrics, state_before(metrics, offset), offset)
    snap = snapshot_path(metrics)
    payload = pickle.dumps(state_before(metrics, offset), protocol=pickle.HIGHEST_PROTOCOL)  # what version 1 wrote
    header = json.loads(snap.read_bytes().split(b"\n", 1)[0])
    header.update(version=1, payload_bytes=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest())
    snap.write_bytes(json.dumps(header).encode() + b"\n" + payload)
    with caplog.at_level(logging.WARNING, logger="appliance.monitor.snapshot"):
        state, tail, loaded = attach(metrics)
    assert loaded.state is None and loaded.refused and "another version" in loaded.reason
    assert loaded.reason in caplog.text
    for event in tail.read_new():
        reduce(state, event)
    assert tail.bytes_read == metrics.stat().st_size
    assert plain(state) == plain(full_read(metrics))


def test_a_state_the_codec_cannot_write_turns_the_saver_off(tmp_path: Path) -> None:
    metrics = recorded_run(tmp_path, "cpu-2core")
    state, tail, _ = attach(metrics)
    for event in tail.read_new():
        reduce(state, event)
    assert SnapshotSaver(metrics, every_s=0.0, min_new_bytes=1).maybe_save(state, tail)  # control: it can save
    snapshot_path(metrics).unlink()
    state.plan["odd"] = object()  # no event holds one; a value of a type the codec does not know
    saver = SnapshotSaver(metrics, every_s=0.0, min_new_bytes=1)
    assert not saver.maybe_save(state, tail) and not saver.enabled  # not retried at every poll
    assert not snapshot_path(metrics).exists()


def synthetic_history(metrics: Path, minutes: int, nodes: int = 48) -> None:
    """`minutes` of a 48-node run's samples (a gpu and an energy event per node every 5 s) and a step a minute."""
    lines = []
    for k in range(minutes * 12):
        t = 1.7e9 + 5.0 * k
        for node in range(nodes):
            devices = [{"index": i, "util": 97.0, "power_w": 400.0 + i, "memory_total_gb": 80.0} for i in range(8)]
            lines.append({"t": t, "kind": "gpu", "node": f"n{node:02d}", "devices": devices})
            lines.append({"t": t, "kind": "energy", "node": f"n{node:02d}", "kwh": k * 0.01, "co2_kg": k * 1e-3})
        if k % 12 == 0:
            step = k // 12
            lines.append(
                {"t": t, "kind": "step", "step": step, "loss": 9 - step * 1e-3, "lr": 1e-4, "grad_norm": 1.0}
                | {"tokens_per_s": 4e4, "tflops_per_gpu": 150.0, "mfu": 0.48, "consumed_samples": step * 2048}
            )
    metrics.write_text("".join(json.dumps(e) + "\n" for e in lines))


def test_attach_reads_only_the_tail_whatever_the_history(tmp_path: Path) -> None:
    """4 and 32 minutes of a 48-node run's history (kept short for the test's time; bench/tui_tail.py --attach-days
    measures days), each followed by the same two minutes after its snapshot: the attach reads exactly the bytes
    after the snapshot, the same count for both."""
    tail_bytes = []
    for minutes in (4, 32):
        metrics = tmp_path / f"{minutes}min" / "metrics.jsonl"
        metrics.parent.mkdir()
        synthetic_history(metrics, minutes=minutes)
        history = metrics.stat().st_size
        saver_state = full_read(metrics)  # the follower's state when it saved
        save_snapshot(metrics, saver_state, history)
        tail_part = tmp_path / "tail.jsonl"  # the same two minutes after the snapshot, for both runs
        synthetic_history(tail_part, minutes=2)
        with open(metrics, "ab") as f:
            f.write(tail_part.read_bytes())
        state, tail, loaded = attach(metrics)
        assert loaded.reason == ""
        events = tail.read_new()
        for event in events:
            reduce(state, event)
        assert tail.bytes_read == metrics.stat().st_size - history == tail_part.stat().st_size
        assert state.gpu_count == 48 * 8 and state.step == 1  # the tail's newest step (its steps restart at 0)
        tail_bytes.append(tail.bytes_read)
    assert tail_bytes[0] == tail_bytes[1], "attach cost grew with the run's history"


def test_the_dashboard_starts_from_the_snapshot(tmp_path: Path) -> None:
    import asyncio

    from appliance.tui.app import make_app

    metrics = recorded_run(tmp_path, "gpu-8xa100")
    offset = line_ends(metrics.read_bytes())[-5]
    saved = state_before(metrics, offset)
    saved.bad_events = 1000  # only the snapshot carries it
    save_snapshot(metrics, saved, offset)

    async def first_read() -> tuple[str, int, int | None]:
        app = make_app(metrics.parent, follow=False)
        async with app.run_test(size=(160, 50)) as pilot:
            while app.reads_done < 1:
                await pilot.pause(0.02)
            return app.attach_note, app.state.bad_events, app.state.step

    note, bad_events, step = asyncio.run(first_read())
    assert (note, bad_events, step) == ("", 1000, full_read(metrics).step)
