"""The payload of metrics.snapshot: a RunState and everything it holds as plain JSON, written and read by code that
knows each type it may contain. Reading builds data and nothing else: no name in the file is ever looked up as
code (a pickle names the callables that rebuild it, and a run directory is copied between machines).

JSON's own values stand for themselves: strings, ints, bools, null, finite floats, lists, and objects whose keys
are strings that do not start with "$". Every other value is an object with one "$" key:
  {"$float": "nan" | "inf" | "-inf"}     a non-finite float (JSON has none)
  {"$tuple": [...]}  {"$set": [...]}  {"$frozenset": [...]}  {"$deque": [maxlen or null, [...]]}
  {"$dict": [[key, value], ...]}         a dict with a key that is not a string, or that starts with "$"
  {"$obj": [name, {field: value}]}       an instance of one of CLASSES, by its fields
Reading admits these tags alone, and an object only when it names each field its class saves, no other, each
holding a value of the field's declared type. Anything else is a SnapshotDataError, and the reader reads
metrics.jsonl whole instead.

Not saved, since a reader derives them: RunState's `_nodes` (parsed from `_gpu_raw` on demand) and `changed` (the
panels still to redraw: everything, for whoever loads the snapshot). The class's own defaults fill them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from collections import deque
from collections.abc import Callable
from itertools import repeat
from operator import contains
from typing import Any, Union, get_args, get_origin, get_type_hints

from appliance.monitor.eval_report import EvalReport, LanguageScore, TaskScore
from appliance.monitor.state import RunState
from appliance.monitor.state_fields import CheckpointInfo, ExpertsInfo, Series, StageInfo, TimelineEntry

# Every class a saved RunState holds, by the name the file gives it.
CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        RunState, Series, StageInfo, CheckpointInfo, TimelineEntry, ExpertsInfo, EvalReport, LanguageScore, TaskScore,
    )
}  # fmt: skip
NOT_SAVED: dict[type, tuple[str, ...]] = {RunState: ("_nodes", "changed")}
# Series keeps its figures in __slots__, without annotations: their types, as Series.__init__ and add() set them.
SERIES_TYPES: dict[str, Any] = {
    "capacity": int, "count": int, "nonfinite": int, "span": int, "_open": int, "last": float | None,
    "x0": list[float], "x1": list[float], "lo": list[float], "hi": list[float],
}  # fmt: skip
NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
DOLLARS = repeat("$")  # the tag prefix beside every key of an object: map(str.startswith, keys, DOLLARS)
# The Python types a value of each plain hint may have: a float field may hold an int, since the reducers keep a
# whole number as it came (a curve's x is the step).
PLAIN_TYPES: dict[Any, frozenset[type]] = {
    float: frozenset((float, int)), int: frozenset((int,)), str: frozenset((str,)), bool: frozenset((bool,)),
}  # fmt: skip


class SnapshotDataError(ValueError):
    """A value the snapshot cannot hold (saving), or a payload that is not one this module wrote (loading)."""


# ---- the classes' fields and their checks -----------------------------------------------------------------------
Check = Callable[[Any], bool]


def _types_of(hint: Any) -> frozenset[type] | None:
    """The Python types a value of `hint` may have, when the hint is plain (str, int, float, bool, None or a union
    of them), so that a check is one set lookup; None for any other hint."""
    if hint in PLAIN_TYPES:
        return PLAIN_TYPES[hint]
    if hint is type(None):
        return frozenset((type(None),))
    if get_origin(hint) in (Union, types.UnionType):
        arms = [_types_of(arg) for arg in get_args(hint)]
        known = [arm for arm in arms if arm is not None]
        return frozenset().union(*known) if len(known) == len(arms) else None
    return None


def _check(hint: Any) -> Check:
    """A test of a value against a type hint of the reducer's fields. Raises TypeError for a hint it does not know:
    a new field type must be taught here (the module fails on import, not on the first snapshot). Plain items are
    tested by their types' set at C speed (map(type, ...)): a curve holds thousands, the energy marks 1,536."""
    plain, origin, args = _types_of(hint), get_origin(hint), get_args(hint)
    if hint is Any:
        return lambda value: True
    if plain is not None:
        return lambda value: type(value) in plain
    if hint in CLASSES.values():
        return lambda value: type(value) is hint
    if origin in (Union, types.UnionType):
        arms = [_check(arg) for arg in args]
        return lambda value: any(arm(value) for arm in arms)
    if origin in (list, deque, set, frozenset) and len(args) == 1:
        if (allowed := _types_of(args[0])) is not None:
            return lambda value: type(value) is origin and set(map(type, value)) <= allowed
        item = _check(args[0])
        return lambda value: type(value) is origin and all(map(item, value))
    if origin is dict and len(args) == 2:
        key, val = _check(args[0]), _check(args[1])
        return lambda value: type(value) is dict and all(key(k) and val(v) for k, v in value.items())
    if origin is tuple and args and args[-1] is not Ellipsis:
        places = [place for place in map(_types_of, args) if place is not None]
        if len(places) == len(args):
            return lambda value: (
                type(value) is tuple and len(value) == len(places) and all(map(contains, places, map(type, value)))
            )
        items = [_check(arg) for arg in args]
        return lambda value: (
            type(value) is tuple and len(value) == len(items) and all(c(v) for c, v in zip(items, value, strict=True))
        )
    raise TypeError(f"the snapshot does not know the field type {hint!r}")


def _saved_fields(cls: type) -> dict[str, Check]:
    """The fields of `cls` a snapshot holds, each with the check of its declared type."""
    if cls is Series:
        return {name: _check(SERIES_TYPES[name]) for name in Series.__slots__}
    hints = get_type_hints(cls)
    skip = NOT_SAVED.get(cls, ())
    return {f.name: _bounded(f, _check(hints[f.name])) for f in dataclasses.fields(cls) if f.name not in skip}


def _bounded(field: dataclasses.Field[Any], check: Check) -> Check:
    """A deque field keeps the bound its class gives it: a file cannot turn the 20 newest warnings into all."""
    made = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
    if not isinstance(made, deque):
        return check
    return lambda value: check(value) and value.maxlen == made.maxlen


FIELDS: dict[type, dict[str, Check]] = {cls: _saved_fields(cls) for cls in CLASSES.values()}
NAMES = {cls: name for name, cls in CLASSES.items()}


# ---- writing ------------------------------------------------------------------------------------------------------
def encode(state: RunState) -> bytes:
    """The payload for `state`. Raises SnapshotDataError for a value of a type this module does not know."""
    try:
        return json.dumps(_plain(state), allow_nan=False, separators=(",", ":")).encode()
    except RecursionError:
        raise SnapshotDataError("a value nests deeper than the snapshot can hold") from None


def _plain(value: Any) -> Any:
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if kind is list:
        return _items_plain(value)
    if kind is dict:
        if all(type(k) is str and k[:1] != "$" for k in value):
            return {k: _plain(v) for k, v in value.items()}
        return {"$dict": [[_plain(k), _plain(v)] for k, v in value.items()]}
    if kind is tuple or kind is set or kind is frozenset:
        return {f"${kind.__name__}": _items_plain(value)}
    if kind is deque:
        return {"$deque": [value.maxlen, _items_plain(value)]}
    if kind in FIELDS:
        return {"$obj": [NAMES[kind], {name: _plain(getattr(value, name)) for name in FIELDS[kind]}]}
    raise SnapshotDataError(f"a {kind.__name__} has no snapshot encoding")


def _items_plain(items: Any) -> list[Any]:
    try:  # finite numbers alone (a curve's buckets, a time and a count: most of a state) are JSON as they are
        if math.isfinite(sum(items)):
            return list(items)
    except (TypeError, OverflowError):  # an item that is not a number (+ refuses it), an int beyond any float
        pass
    return [_plain(v) for v in items]


# ---- reading ------------------------------------------------------------------------------------------------------
def decode(payload: bytes) -> RunState:
    """The RunState `payload` holds. Raises SnapshotDataError (a ValueError, as json's own errors are) unless it is
    a payload encode() could have written."""
    try:
        value = json.loads(payload, object_hook=_value, parse_constant=_no_constant)
    except RecursionError:
        raise SnapshotDataError("the payload nests deeper than any state") from None
    except (TypeError, UnicodeDecodeError) as exc:  # an unhashable set item or dict key; bytes that are not UTF-8
        raise SnapshotDataError(f"not a snapshot payload: {exc}") from None
    if type(value) is not RunState:
        raise SnapshotDataError("the payload does not hold a RunState")
    return value


def _no_constant(name: str) -> Any:
    raise SnapshotDataError(f"{name} is not JSON (non-finite floats are written as $float)")


def _value(obj: dict[str, Any]) -> Any:
    """Each JSON object, innermost first: a tagged one becomes its value, a plain one stays a dict."""
    if len(obj) == 1:
        ((key, content),) = obj.items()
        if key.startswith("$"):
            read = TAGS.get(key)
            if read is None:
                raise SnapshotDataError(f"unknown tag {key}")
            return read(content)
    elif any(map(str.startswith, obj, DOLLARS)):
        raise SnapshotDataError("a tag beside other keys")
    return obj


def _items(content: Any, tag: str) -> list[Any]:
    if type(content) is not list:
        raise SnapshotDataError(f"{tag} does not hold a list")
    return content


def _float(content: Any) -> float:
    if content not in NONFINITE:
        raise SnapshotDataError(f"$float {content!r} is not nan, inf or -inf")
    return NONFINITE[content]


def _pair(content: Any, tag: str) -> tuple[Any, Any]:
    if type(content) is not list or len(content) != 2:
        raise SnapshotDataError(f"{tag} does not hold a pair")
    return content[0], content[1]


def _deque(content: Any) -> deque[Any]:
    maxlen, items = _pair(content, "$deque")
    if not (maxlen is None or (type(maxlen) is int and maxlen >= 0)) or type(items) is not list:
        raise SnapshotDataError("$deque is not [maxlen, items]")
    return deque(items, maxlen=maxlen)


def _dict(content: Any) -> dict[Any, Any]:
    pairs = _items(content, "$dict")
    if not all(type(pair) is list and len(pair) == 2 for pair in pairs):
        raise SnapshotDataError("$dict is not a list of [key, value]")
    return dict(pairs)  # TypeError for a key that is not hashable: decode() reports it


def _object(content: Any) -> Any:
    name, values = _pair(content, "$obj")
    cls = CLASSES.get(name) if type(name) is str else None
    if cls is None or type(values) is not dict:
        raise SnapshotDataError(f"$obj {name!r} is not a snapshot class")
    checks = FIELDS[cls]
    if values.keys() != checks.keys():
        raise SnapshotDataError(f"{name} does not have the fields {sorted(checks)}")
    wrong = [field for field, check in checks.items() if not check(values[field])]
    if wrong:
        raise SnapshotDataError(f"{name}.{wrong[0]} holds a {type(values[wrong[0]]).__name__} of the wrong type")
    if cls is Series:
        return _series(values)
    return cls(**values)


def _series(values: dict[str, Any]) -> Series:
    """A Series whose buckets add() and downsample() can use: four lists of one length, within its capacity."""
    series = Series.__new__(Series)
    for name, value in values.items():
        setattr(series, name, value)
    lengths = {len(series.x0), len(series.x1), len(series.lo), len(series.hi)}
    if len(lengths) != 1 or lengths.pop() > series.capacity or series.capacity < 2 or series.capacity % 2:
        raise SnapshotDataError("a Series whose buckets do not fit together")
    return series


TAGS: dict[str, Callable[[Any], Any]] = {
    "$float": _float,
    "$tuple": lambda content: tuple(_items(content, "$tuple")),
    "$set": lambda content: set(_items(content, "$set")),
    "$frozenset": lambda content: frozenset(_items(content, "$frozenset")),
    "$deque": _deque,
    "$dict": _dict,
    "$obj": _object,
}
