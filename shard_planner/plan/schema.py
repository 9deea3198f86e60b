"""Reading a JSON object into frozen dataclasses, checking every field's type and range on the way.

One walk does it: a dataclass is a :class:`Section` whose fields' kinds come from their type hints
(``bool``, ``int``, ``float``, ``str``, ``X | None``, ``tuple[X, ...]``, ``dict[str, X]``, another
dataclass), narrowed by a table of rules keyed ``"Class.field"`` (a range, a set of choices). A bad value
raises :class:`~shard_planner.errors.PlanError` with the JSON path of the field::

    units[3].activation_checkpoint must be true or false, got "yes"

Checks that span several fields (a module in two units, a reshard size that must divide the mesh) stay in
the dataclasses' ``__post_init__``; the walk runs them when it builds each object.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any

from shard_planner.errors import PlanError

_SHOWN_CHARS = 40  # a bad value is quoted up to this long


def _shown(value: Any) -> str:
    text = json.dumps(value) if _is_json(value) else repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "..."


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


class Kind:
    """What a JSON value must be; :meth:`load` checks it and returns the Python value."""

    wanted = "a value"

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError

    def load(self, value: Any, where: str) -> Any:
        if not self.accepts(value):
            raise PlanError(f"{where} must be {self.wanted}, got {_shown(value)}")
        return value


class Bool(Kind):
    wanted = "true or false"

    def accepts(self, value):
        return isinstance(value, bool)


class Int(Kind):
    def __init__(self, least: int | None = None, most: int | None = None):
        self.least, self.most = least, most
        if least is not None and most is not None:
            self.wanted = f"an integer from {least} to {most}"
        elif least is not None:
            self.wanted = {0: "a non-negative integer", 1: "a positive integer"}.get(least, f"an integer >= {least}")
        else:
            self.wanted = "an integer"

    def accepts(self, value):
        return (isinstance(value, int) and not isinstance(value, bool)
                and (self.least is None or value >= self.least) and (self.most is None or value <= self.most))


class Number(Kind):
    """A finite JSON number (an integer is fine); ``positive``/``non_negative`` narrow it."""

    def __init__(self, positive: bool = False, non_negative: bool = False):
        self.positive, self.non_negative = positive, non_negative
        self.wanted = ("a positive number" if positive else "a non-negative number" if non_negative
                       else "a number")

    def accepts(self, value):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return False
        return not (self.positive and value <= 0) and not (self.non_negative and value < 0)


class Text(Kind):
    def __init__(self, choices: tuple[str, ...] | None = None):
        self.choices = choices
        self.wanted = f"one of {', '.join(map(json.dumps, choices))}" if choices else "a string"

    def accepts(self, value):
        return isinstance(value, str) and (self.choices is None or value in self.choices)


class AnyOf(Kind):
    def __init__(self, *kinds: Kind, wanted: str):
        self.kinds, self.wanted = kinds, wanted

    def accepts(self, value):
        return any(k.accepts(value) for k in self.kinds)


class Nullable(Kind):
    def __init__(self, kind: Kind):
        self.kind = kind
        self.wanted = f"{kind.wanted} or null"

    def load(self, value, where):
        if value is None:
            return None
        if not isinstance(self.kind, (Section, ListOf, MapOf)) and not self.kind.accepts(value):
            raise PlanError(f"{where} must be {self.wanted}, got {_shown(value)}")
        return self.kind.load(value, where)


class ListOf(Kind):
    """A JSON array, read as a tuple."""

    def __init__(self, item: Kind, min_len: int = 0):
        self.item, self.min_len = item, min_len
        self.wanted = "a list" if min_len == 0 else f"a list of at least {min_len}"

    def load(self, value, where):
        if not isinstance(value, (list, tuple)):  # a tuple: a dict from dataclasses.asdict
            raise PlanError(f"{where} must be a list, got {_shown(value)}")
        if len(value) < self.min_len:
            raise PlanError(f"{where} must have at least {self.min_len} item{'s' if self.min_len > 1 else ''}, got []")
        return tuple(self.item.load(v, f"{where}[{i}]") for i, v in enumerate(value))


class MapOf(Kind):
    """A JSON object with free keys (``keys``: the allowed ones, None for any)."""

    def __init__(self, value: Kind, keys: tuple[str, ...] | None = None):
        self.value, self.keys = value, keys

    def load(self, value, where):
        if not isinstance(value, dict):
            raise PlanError(f"{where} must be an object, got {_shown(value)}")
        unknown = sorted(set(value) - set(self.keys)) if self.keys is not None else []
        if unknown:
            raise PlanError(f"{where} has an unknown key {json.dumps(unknown[0])}; known: {', '.join(self.keys)}")
        return {k: self.value.load(v, f"{where}.{k}") for k, v in value.items()}


class Section(Kind):
    """A JSON object read into the dataclass ``cls``: no unknown field, every required one present, each
    checked by its rule (``rules["Class.field"]``) or its type hint."""

    def __init__(self, cls: type, rules: dict[str, Kind], label: str = "plan"):
        self.cls, self.rules, self.label = cls, rules, label

    def load(self, value, where):
        name = where or self.label
        if not isinstance(value, dict):
            raise PlanError(f"{name} must be a JSON object, got {_shown(value)}")
        fields = {f.name: f for f in dataclasses.fields(self.cls) if f.init}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise PlanError(f"{name} is a malformed section: unknown field {json.dumps(unknown[0])} "
                            f"(known: {', '.join(fields)})")
        hints = typing.get_type_hints(self.cls)
        kwargs = {}
        for fname, f in fields.items():
            if fname not in value:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise PlanError(f"{name} is missing the field {fname!r}")
                continue
            kind = self.rules.get(f"{self.cls.__name__}.{fname}") or kind_of(hints[fname], self.rules)
            kwargs[fname] = kind.load(value[fname], _join(where, fname))
        try:
            return self.cls(**kwargs)
        except PlanError as exc:  # a check across fields, in __post_init__
            raise PlanError(f"{where}: {exc}" if where else str(exc)) from None


def kind_of(hint: Any, rules: dict[str, Kind]) -> Kind:
    """The :class:`Kind` of a dataclass field's type hint."""
    if dataclasses.is_dataclass(hint):
        return Section(hint, rules)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = tuple(a for a in args if a is not type(None))
        inner = kind_of(rest[0], rules) if len(rest) == 1 else AnyOf(
            *(kind_of(a, rules) for a in rest), wanted=" or ".join(kind_of(a, rules).wanted for a in rest))
        return Nullable(inner) if len(rest) < len(args) else inner
    if origin is tuple:
        return ListOf(kind_of(args[0], rules))
    if origin is dict:
        return MapOf(kind_of(args[1], rules))
    simple = {bool: Bool, int: Int, float: Number, str: Text}
    if hint in simple:
        return simple[hint]()
    raise TypeError(f"no JSON kind for {hint!r}")  # a field type this reader does not know: a bug
