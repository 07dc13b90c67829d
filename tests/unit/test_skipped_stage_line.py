"""A skipped stage says when it was done: stages.json records the time, the `skipped` event repeats it, and the
headless line reads "plan: done 2026-11-28 14:02, skipped", on every rerun."""

from __future__ import annotations

import io
import time

from appliance.monitor.events import EventWriter, read_events
from appliance.monitor.headless import HeadlessPrinter
from appliance.stages import Stages, settings_key


def test_the_skipped_event_carries_when_the_stage_was_done(tmp_path):
    out = tmp_path / "out.txt"
    events = EventWriter(tmp_path / "metrics.jsonl")
    before = time.time()
    Stages(tmp_path / "stages.json", events).run(
        "s", key=settings_key(a=1), outputs=[out], work=lambda p: out.write_text("x")
    )
    done_t = Stages(tmp_path / "stages.json", events).records["s"]["done_t"]
    assert before <= done_t <= time.time()
    Stages(tmp_path / "stages.json", events).run("s", key=settings_key(a=1), outputs=[out], work=lambda p: None)
    skipped = [e for e in read_events(tmp_path / "metrics.jsonl") if e.get("state") == "skipped"]
    assert [e["done_t"] for e in skipped] == [done_t]


def lines(*events: dict, history: tuple[dict, ...] = ()) -> list[str]:
    stream = io.StringIO()
    printer = HeadlessPrinter(stream=stream)
    for event in history:
        printer.absorb(event)
    for event in events:
        printer.handle(event)
    return [line.split("] ", 1)[1] for line in stream.getvalue().splitlines()]


def stage(state: str, t: float, **extra: object) -> dict:
    return {"t": t, "kind": "stage", "name": "plan", "state": state, "progress": 1.0, **extra}


def test_a_skipped_stage_prints_the_time_it_was_done_not_the_time_since_it_began():
    done = time.mktime((2026, 11, 28, 14, 2, 0, 0, 0, -1))
    history = (stage("started", done - 462), stage("done", done))
    later = done + 86400
    assert lines(stage("skipped", later, done_t=done), history=history) == ["plan: done 2026-11-28 14:02, skipped"]
    # A rerun of a rerun: the history ends in "skipped" already, and the line is printed again.
    again = (*history, stage("started", later), stage("skipped", later, done_t=done))
    assert lines(stage("skipped", later + 60, done_t=done), history=again) == ["plan: done 2026-11-28 14:02, skipped"]
    # A record from before the time was kept.
    assert lines(stage("skipped", later), history=history) == ["plan: done earlier, skipped"]


def test_other_stage_states_keep_their_duration_lines():
    """Control: started and done print as before."""
    assert lines(stage("started", 100.0), stage("done", 162.0)) == ["stage plan started", "stage plan done after 1m02s"]
