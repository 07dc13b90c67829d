"""Strict conversion between JSON objects and frozen dataclasses, for plan.json.

Every key must be a field (or one the caller names as accepted: derived figures that are rewritten on output);
every field without a default must be present; every value must have its field's type. Errors are BadInput naming
the file, the dotted key and what is wrong, so a hand-edited plan fails before any rank starts.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

from appliance.errors import BadInput

T = TypeVar("T")


def dotted(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def check_keys(
    data: Any, *, where: str, source: str, known: Collection[str], required: Collection[str]
) -> Mapping[str, Any]:
    """`data` as an object holding only `known` keys and every `required` one; BadInput naming the first wrong key."""
    if not isinstance(data, dict):
        raise BadInput(f"{source}: {where or 'the plan'} must be a JSON object, got {type(data).__name__}")
    unknown = [k for k in data if k not in known]
    if unknown:
        names = ", ".join(repr(dotted(where, k)) for k in unknown)
        raise BadInput(f"{source}: unknown key {names} (known keys there: {', '.join(sorted(known))})")
    missing = [k for k in required if k not in data]
    if missing:
        raise BadInput(f"{source}: missing key {', '.join(repr(dotted(where, k)) for k in missing)}")
    return data


def required_fields(cls: type) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


def from_json(
    cls: type[T],
    data: Any,
    *,
    where: str,
    source: str,
    accepted: Collection[str] = (),
    required: Collection[str] | None = None,
) -> T:
    """An instance of dataclass `cls` from a JSON object; `accepted` keys are allowed and not read. `required`
    defaults to the fields without a default."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    required = required_fields(cls) if required is None else required
    data = check_keys(data, where=where, source=source, known={*names, *accepted}, required=required)
    hints = typing.get_type_hints(cls)
    values = {n: convert(hints[n], data[n], where=dotted(where, n), source=source) for n in names if n in data}
    try:
        return cls(**values)
    except (BadInput, ValueError, TypeError) as e:
        raise BadInput(f"{source}: {where}: {e}") from None


def convert(hint: Any, value: Any, *, where: str, source: str) -> Any:
    """`value` checked against the type `hint` (int, float, str, bool, Any, unions with None, list, tuple, dict,
    dataclasses); ints are accepted where a float is expected and become floats."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"{where}: unions of several types are not supported ({hint})")
        return convert(options[0], value, where=where, source=source)
    if dataclasses.is_dataclass(hint):
        return from_json(hint, value, where=where, source=source)  # type: ignore[arg-type]
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise BadInput(f"{source}: key {where!r} must be a list, got {value!r}")
        item = args[0] if args else Any
        items = [convert(item, v, where=f"{where}[{i}]", source=source) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise BadInput(f"{source}: key {where!r} must be an object, got {value!r}")
        item = args[1] if args else Any
        return {k: convert(item, v, where=dotted(where, k), source=source) for k, v in value.items()}
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }.get(hint)
    if ok is None:
        raise TypeError(f"{where}: no JSON form for {hint}")
    if not ok(value):
        words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]
        raise BadInput(f"{source}: key {where!r} must be {words}, got {value!r}")
    return float(value) if hint is float else value


def to_json(value: Any) -> Any:
    """Dataclasses as objects (fields in order), tuples as lists: the plain JSON form of a value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value
