"""Each event kind is declared once (appliance/monitor/event_kinds.py), with the handlers every reader finds there:
every kind the code emits is declared, and every handler a declaration names exists where its reader looks."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from appliance.monitor import reducers, summary, tensorboard
from appliance.monitor.event_kinds import EVENT_KINDS
from appliance.monitor.events import REQUIRED_KEYS
from appliance.monitor.headless import HeadlessPrinter
from appliance.monitor.state import REDUCERS
from appliance.monitor.state_fields import RunFields

ROOT = Path(__file__).resolve().parents[2]
# emit("kind", ...), self._emit(\n "kind", ...), make_event("kind", ...): the kind is always a literal at the call
EMIT = re.compile(r"\b(?:_?emit|make_event)\(\s*\"(\w+)\"")


def emitted_kinds() -> dict[str, list[str]]:
    """kind -> the files that emit it, over the appliance's code."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "appliance").rglob("*.py")):
        for kind in EMIT.findall(path.read_text()):
            found.setdefault(kind, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_emitted_kind_is_declared():
    undeclared = {kind: files for kind, files in emitted_kinds().items() if kind not in EVENT_KINDS}
    assert not undeclared, f"emitted but not declared in monitor/event_kinds.py: {undeclared}"


def test_every_declared_kind_is_emitted():
    """No declaration outlives its writer (kinds are public: one that goes must go from the docs too)."""
    assert sorted(EVENT_KINDS) == sorted(emitted_kinds())


def test_the_emit_scan_sees_multiline_emits():
    """Control for the scan: the trainer's emits put the kind on the line after `self._emit(`."""
    assert EMIT.findall('self._emit(\n    "step",\n    step=1,\n)') == ["step"]
    assert {"step", "checkpoint", "eval"} <= set(emitted_kinds())


def test_the_required_keys_are_the_declarations():
    assert {kind: declared.required for kind, declared in EVENT_KINDS.items()} == REQUIRED_KEYS


@pytest.mark.parametrize("kind", sorted(EVENT_KINDS))
def test_each_handler_named_exists(kind):
    declared = EVENT_KINDS[kind]
    if declared.reducer is not None:
        reducer = getattr(reducers, declared.reducer)
        assert list(inspect.signature(reducer).parameters) == ["run", "e", "t"]
        assert REDUCERS[kind] is reducer
    if declared.line is not None:
        assert list(inspect.signature(getattr(HeadlessPrinter, declared.line)).parameters) == ["self", "e"]
    if declared.scalars is not None:
        producer = getattr(tensorboard, declared.scalars)
        arity = 2 if declared.scalars_at_step else 1
        assert len(inspect.signature(producer).parameters) == arity
        assert tensorboard.SCALARS_OF_KIND[kind] is producer
    if declared.summary is not None:
        assert f'collected["{declared.summary}"]' in inspect.getsource(summary.summarize)


def test_reducers_write_only_run_fields():
    """A reducer assigns only fields RunFields declares (a typo would add an attribute no panel reads)."""
    fields = set(RunFields.__dataclass_fields__)
    assigned = set(re.findall(r"\brun\.(\w+)\s*(?:=|\+=|\[)", inspect.getsource(reducers)))
    assert assigned and assigned <= fields, assigned - fields
