"""The snapshot's payload codec (monitor/snapshot_codec.py): every value a RunState can hold comes back as the same
value of the same type, and a payload it did not write is refused with SnapshotDataError, never half-built."""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest

from appliance.monitor import snapshot_codec
from appliance.monitor.eval_report import EvalReport, LanguageScore, TaskScore
from appliance.monitor.events import EventTail
from appliance.monitor.snapshot_codec import CLASSES, SnapshotDataError, decode, encode
from appliance.monitor.state import RunState, reduce
from appliance.monitor.state_fields import CheckpointInfo, ExpertsInfo, Series, StageInfo, TimelineEntry

FIXTURES = Path(__file__).resolve().parents[1] / "tui" / "fixtures"


def typed(value: Any) -> Any:
    """`value` with the exact type of everything in it spelled out, so that 1 == 1.0 == True, (1,) == [1] and NaN
    compare as the different (or equal) things they are."""
    kind = type(value).__name__
    if isinstance(value, Series):
        return ("Series", {name: typed(getattr(value, name)) for name in Series.__slots__})
    if type(value) in CLASSES.values():
        return (kind, {name: typed(v) for name, v in vars(value).items() if name not in ("_nodes", "changed")})
    if isinstance(value, dict):
        return (kind, [(typed(k), typed(v)) for k, v in value.items()])
    if isinstance(value, set | frozenset):
        return (kind, sorted(repr(typed(v)) for v in value))
    if isinstance(value, deque):
        return (kind, value.maxlen, [typed(v) for v in value])
    if isinstance(value, list | tuple):
        return (kind, [typed(v) for v in value])
    return (kind, "nan" if isinstance(value, float) and math.isnan(value) else value)


def odd_state() -> RunState:
    """A state holding every kind of value the encoding distinguishes."""
    state = RunState(run_name="odd", events=3, lost_seconds=2)  # an int in a float field, as reducers may leave it
    state.plan = {
        "floats": [math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324],
        "$tuple": "a key that looks like a tag",
        "nested": {"t": (1, "x", None), "s": {1, 2}, "f": frozenset({"a"}), "d": deque([1], maxlen=3)},
        "mixed": [1, 2.5, True, None, "s", [1.0, math.nan]],
        "big": [2**80, 10**400],  # the second beyond any float
        "text": "é \u2028 \udcff",  # a lone surrogate: json.loads lets one through from a file
        "keys": {1: "an int key", (2, "b"): "a tuple key", None: "a None key", 2.5: "a float key"},
    }
    state.stages["train"] = StageInfo("train", "running", 0.5, 1.0, 2.0)
    state.checkpoints.append(CheckpointInfo(step=10, t=3.0, seconds=4.0, bytes=5, path="p", stall_s=None))
    state.timeline.append(TimelineEntry(6.0, "failure", where="rank 3", rank=[3, "odd"], reason="r"))
    state.experts = ExpertsInfo(step=7, aux_loss=0.1, load=[[0.5, 0.5]], tier={"hits": 3})
    state.experts.aux_series.add(7, 0.1)
    state.eval_report = EvalReport(
        step=8, final=True, loss=2.0, languages=[LanguageScore("en", 2.0, 7.4)],
        tasks=[TaskScore("piqa", {"acc": (0.6, 0.01), "acc_norm": (0.7, None)}, n=10)],
    )  # fmt: skip
    for step in range(3000):  # past the buckets' first merges
        state.loss_series.add(step, 10 - step / 1000)
    state.loss_series.add(3000, math.nan)  # counted, not kept
    state._gpu_raw["n0"] = (9.0, [{"index": 0, "util": math.nan}])
    state._energy_marks["n0"] = deque([(1.0, 2.0)], maxlen=32)
    state.warnings.append((1.0, "w"))
    state._steps.append((1.0, 2, None))
    return state


def test_typed_tells_apart_what_equality_does_not() -> None:
    """Positive control for the comparisons below."""
    for a, b in [(1, 1.0), (1, True), ((1,), [1]), ({1}, frozenset({1})), (deque([1]), deque([1], maxlen=2))]:
        assert typed(a) != typed(b)
    assert typed(math.nan) == typed(math.nan)


def test_every_kind_of_value_comes_back_as_it_was() -> None:
    state = odd_state()
    assert typed(decode(encode(state))) == typed(state)


@pytest.mark.parametrize("name", ["cpu-2core", "gpu-8xa100", "moe-cpu"])
def test_the_states_of_recorded_runs_come_back_as_they_were(name: str) -> None:
    state = RunState()
    for event in EventTail(FIXTURES / name / "metrics.jsonl").read_new():
        reduce(state, event)
    assert state.gpu_count >= 0  # fills the parsed cache, which the snapshot leaves out
    loaded = decode(encode(state))
    assert typed(loaded) == typed(state)
    assert loaded.gpu_count == state.gpu_count  # the cache is parsed again on demand


def test_the_payload_is_plain_json() -> None:
    payload = encode(odd_state())
    json.loads(payload, parse_constant=lambda name: pytest.fail(f"{name} in the payload"))
    assert b"NaN" not in payload and b"Infinity" not in payload


def test_a_value_of_an_unknown_type_is_not_saved() -> None:
    state = RunState()
    state.plan = {"when": Path("/")}
    with pytest.raises(SnapshotDataError, match="a PosixPath has no snapshot encoding"):
        encode(state)


def test_every_class_a_field_can_hold_is_known() -> None:
    """Walks the declared types from RunState down: each class met is one the codec can write and read."""
    seen, todo = set(), [RunState]
    while todo:
        cls = todo.pop()
        seen.add(cls)
        hints = get_type_hints(cls) if cls is not Series else snapshot_codec.SERIES_TYPES
        stack = [h for name, h in hints.items() if name not in snapshot_codec.NOT_SAVED.get(cls, ())]
        while stack:
            hint = stack.pop()
            stack.extend(get_args(hint))
            if isinstance(hint, type) and hint.__module__.startswith("appliance.") and hint not in seen:
                todo.append(hint)
    assert seen == set(CLASSES.values())


def payload_of(value: Any) -> bytes:
    return json.dumps(value).encode()


def good_state_json() -> dict[str, Any]:
    return json.loads(encode(RunState()))


def series_with(**change: Any) -> dict[str, Any]:
    """An empty Series as encode() writes it, with `change` to its fields."""
    tag, (name, fields) = next(iter(good_state_json()["$obj"][1]["loss_series"].items()))
    return {tag: [name, {**fields, **change}]}


def with_field(name: str, value: Any) -> bytes:
    state = good_state_json()
    state["$obj"][1][name] = value
    return payload_of(state)


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\x80\x04K\x01.", "not a snapshot payload"),  # a pickle
        (payload_of({"$obj": ["os.system", {}]}), "not a snapshot class"),
        (payload_of({"$obj": ["RunState", {}]}), "does not have the fields"),
        (payload_of({"$call": ["print", "x"]}), "unknown tag"),
        (payload_of({"$tuple": [], "x": 1}), "a tag beside other keys"),
        (payload_of([1, 2]), "does not hold a RunState"),
        (payload_of(json.loads(encode(RunState()))["$obj"][1]["loss_series"]), "does not hold a RunState"),
        (b'{"x": NaN}', "NaN is not JSON"),
        (payload_of({"$float": "1e999"}), "is not nan, inf or -inf"),
        (payload_of({"$set": [[1]]}), "not a snapshot payload"),  # an unhashable item
        (payload_of({"$dict": [[[1], 2]]}), "not a snapshot payload"),  # an unhashable key
        (payload_of({"$dict": [[1, 2, 3]]}), "not a list of [key, value]"),
        (payload_of({"$deque": [-1, []]}), "is not [maxlen, items]"),
        (payload_of({"$tuple": "ab"}), "does not hold a list"),
        (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
        (with_field("events", "3"), "RunState.events holds a str of the wrong type"),
        (with_field("events", True), "RunState.events holds a bool of the wrong type"),
        (with_field("loss", "nan"), "RunState.loss holds a str"),
        (with_field("stages", {"train": {"name": "x"}}), "RunState.stages holds a dict"),
        (with_field("warnings", {"$deque": [None, []]}), "RunState.warnings holds a deque"),  # unbounded
        (with_field("_steps", {"$deque": [100, [[1.0, 2, None]]]}), "RunState._steps holds a deque"),  # list, no tuple
        (with_field("_nodes", {}), "does not have the fields"),  # a cache the file does not hold
        (with_field("loss_series", series_with(x0=[1.0])), "buckets do not fit"),  # x1, lo and hi are empty
        (with_field("loss_series", series_with(capacity=0)), "buckets do not fit"),
    ],
)
def test_a_payload_the_codec_did_not_write_is_refused(payload: bytes, why: str) -> None:
    with pytest.raises(SnapshotDataError, match=why.replace("[", r"\[").replace("]", r"\]")):
        decode(payload)


def test_the_refusals_above_start_from_a_payload_that_loads() -> None:
    """Positive control for the field cases: the payload they each change by one field loads as it is."""
    assert isinstance(decode(payload_of(good_state_json())), RunState)
    assert decode(with_field("events", 3)).events == 3
    assert decode(with_field("loss_series", series_with(x0=[1.0], x1=[1.0], lo=[2.0], hi=[2.0]))).loss_series.x0 == [
        1.0
    ]
