"""The wire schema: declared once, checked with the standard library, read by pydantic.

A trainer reads a manifest on its way to the first compiled step, and importing pydantic
there would be the largest single cost megacache adds to a warm start (~150 ms: pydantic
builds some fifty dataclasses of its own at import). So the schema types (`manifest.py`,
`events.py`) are frozen stdlib dataclasses whose fields carry these rules as `Annotated`
metadata. `checked()` validates an instance (every schema class calls it from
`__post_init__`, so an instance that exists is valid) and `parse()` builds one from decoded
JSON: the client and the server both validate this way, so they cannot disagree. pydantic
reads the same declaration (`__get_pydantic_core_schema__` below) for the OpenAPI document;
tests/test_schema_rules.py holds pydantic's reading to the same answers.

Strict, as the JSON schema says: no coercion (`"1"` is not an int, `true` is not a number),
unknown fields refused, non-finite floats refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal, TypeVar, Union

from megacache_client.wire.text import escape_foreign, is_text, text_error

T = TypeVar("T")
Check = Callable[[Any, tuple[str | int, ...]], Any]
"""Takes a value and where it is; returns the value (converted: a dict becomes its
dataclass, an ISO string a datetime) or raises SchemaError."""


class SchemaError(ValueError):
    """A value that does not match the schema; `errors` in pydantic's shape (loc, msg, type)."""

    def __init__(self, loc: tuple[str | int, ...], msg: str, kind: str) -> None:
        self.errors: list[dict[str, Any]] = [{"loc": [shown_step(s) for s in loc],
                                              "msg": msg, "type": kind}]
        super().__init__(msg)

    def at(self, depth: int, step: str | int) -> SchemaError:
        """This error, `step` deeper than where it was raised: containers do not build a
        location for every item they check, only for the one that failed."""
        self.errors[0]["loc"].insert(depth, shown_step(step))
        return self

    def __str__(self) -> str:
        error = self.errors[0]
        return f"{'.'.join(str(p) for p in error['loc']) or 'value'}: {error['msg']}"


def shown_step(step: Any) -> Any:
    """A step of an error's location as an answer may carry it: a key that is not text
    (a lone surrogate, a control character) escaped (`\\ud800`), so the 422 naming it can
    be encoded (#58: it was a 500 with a traceback); indexes and text keys as they are."""
    if isinstance(step, str) and not is_text(step, cap=256):
        return escape_foreign(step, 256)
    return step


class Rule:
    """A constraint on one field's value, readable by both validators."""

    def check(self, value: Any) -> str | None:
        """Why `value` breaks the rule, or None."""
        raise NotImplementedError

    def core(self) -> dict[str, Any]:
        """The same constraint as pydantic-core schema keys."""
        return {}

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        schema = handler(source)
        schema.update(self.core())
        return schema


@dataclasses.dataclass(frozen=True)
class Match(Rule):
    """A string matching `pattern` as a whole (anchor it: the JSON schema shows it as is)."""

    pattern: str

    def check(self, value: Any) -> str | None:
        return None if _regex(self.pattern).fullmatch(value) else \
            f"String should match pattern '{self.pattern}'"

    def core(self) -> dict[str, Any]:
        return {"pattern": self.pattern}


@dataclasses.dataclass(frozen=True)
class Range(Rule):
    """A number within [ge, le]; never NaN or infinite."""

    ge: float | None = None
    le: float | None = None

    def check(self, value: Any) -> str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return "Input should be a finite number"
        if self.ge is not None and value < self.ge:
            return f"Input should be greater than or equal to {self.ge}"
        if self.le is not None and value > self.le:
            return f"Input should be less than or equal to {self.le}"
        return None

    def core(self) -> dict[str, Any]:
        return {k: v for k, v in (("ge", self.ge), ("le", self.le)) if v is not None}


@dataclasses.dataclass(frozen=True)
class Finite(Rule):
    """A float that JSON can carry: NaN and the infinities would be stored as null."""

    def check(self, value: Any) -> str | None:
        return None if math.isfinite(value) else "Input should be a finite number"

    def core(self) -> dict[str, Any]:
        return {"allow_inf_nan": False}


@dataclasses.dataclass(frozen=True)
class Size(Rule):
    """A string, list or object with between `min` and `max` characters or items."""

    min: int = 0
    max: int | None = None

    def check(self, value: Any) -> str | None:
        if len(value) < self.min:
            return f"should have at least {self.min} item(s) or character(s)"
        if self.max is not None and len(value) > self.max:
            return f"should have at most {self.max} item(s) or character(s)"
        return None

    def core(self) -> dict[str, Any]:
        return {**({"min_length": self.min} if self.min else {}),
                **({"max_length": self.max} if self.max is not None else {})}


@dataclasses.dataclass(frozen=True)
class Text(Rule):
    """A name or free text: printable, no surrogates or control characters (wire/text.py).
    A lone surrogate from a JSON `\\ud800` escape survives json.loads as a str and breaks
    the index's encoder later; refused here, where both sides parse."""

    def check(self, value: Any) -> str | None:
        return text_error(value, cap=len(value)) if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True)
class Doc(Rule):
    """A field's description in the OpenAPI document; checks nothing."""

    text: str

    def check(self, value: Any) -> str | None:
        return None

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> Any:
        out = handler(schema)
        out["description"] = self.text
        return out


class Schema:
    """Base of the schema dataclasses: validated on construction, unknown fields refused
    by pydantic too (`__pydantic_config__` is a plain dict: no pydantic import here)."""

    __pydantic_config__ = {"extra": "forbid", "strict": True}
    LATER_FIELDS: typing.ClassVar[tuple[str, ...]] = ()
    """Fields added after the first release, sent only when they differ from their default:
    a server of an older version refuses fields it does not know, so it still takes what a
    newer client sends, unless the client uses what the server lacks."""

    def __post_init__(self) -> None:
        checked(self)
        self.validate()

    def validate(self) -> None:
        """Checks across fields (a key that matches its components, ...); raise ValueError."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: datetimes as ISO strings, nested schemas as objects."""
        return typing.cast(dict[str, Any], _plain(self))

    def to_json(self) -> bytes:
        return json.dumps(_plain(self), separators=(",", ":"), ensure_ascii=False).encode()


def parse(cls: type[T], data: Any) -> T:
    """An instance of schema class `cls` from decoded JSON, validated strictly."""
    return typing.cast(T, _checker(cls)(data, ()))


def parse_json(cls: type[T], data: bytes | str) -> T:
    """`parse` of a JSON document; a document that is not JSON is a SchemaError too
    (type `json_invalid`), and so is one nested too deep or with a number too long."""
    try:
        decoded = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise SchemaError((), f"Invalid JSON: {exc}"[:300], "json_invalid") from None
    return parse(cls, decoded)


def checked(obj: Any) -> None:
    """Validate the fields of schema instance `obj` in place (values converted as `parse`
    would: a nested dict becomes its dataclass, an ISO string a datetime)."""
    for name, check in _field_checks(type(obj)):
        value = getattr(obj, name)
        new = check(value, (name,))
        if new is not value:
            object.__setattr__(obj, name, new)


# -- building checkers from type hints (once per type) -------------------------------------

_regexes: dict[str, re.Pattern[str]] = {}
_field_cache: dict[type, list[tuple[str, Check]]] = {}
_checker_cache: dict[Any, Check] = {}


def _regex(pattern: str) -> re.Pattern[str]:
    found = _regexes.get(pattern)
    if found is None:
        found = _regexes[pattern] = re.compile(pattern)
    return found


def _field_checks(cls: type) -> list[tuple[str, Check]]:
    found = _field_cache.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        found = [(f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls)]
        _field_cache[cls] = found
    return found


def _checker(tp: Any) -> Check:
    """The checker of a type hint (hashable: the rules are frozen dataclasses)."""
    check = _checker_cache.get(tp)
    if check is None:
        check = _checker_cache[tp] = _build(tp)
    return check


def _fail(loc: tuple[str | int, ...], msg: str, kind: str) -> typing.NoReturn:
    raise SchemaError(loc, msg, kind)


def _build(tp: Any) -> Check:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        inner, rules = _checker(args[0]), [r for r in tp.__metadata__
                                           if isinstance(r, Rule) and not isinstance(r, Doc)]

        def annotated(value: Any, loc: tuple[str | int, ...]) -> Any:
            value = inner(value, loc)
            for rule in rules:
                problem = rule.check(value)
                if problem:
                    _fail(loc, problem, type(rule).__name__.lower())
            return value
        return annotated
    if origin in (Union, types.UnionType):
        members = [_checker(a) for a in args]
        # A scalar value goes straight to the member of its own type (as pydantic's smart
        # union does): trying `str` first for every number of a fingerprint would raise and
        # catch an error per value (a 64 KiB manifest: ~30 ms instead of ~3).
        by_type: dict[type, Check] = {}
        for arg, member in zip(args, members, strict=True):
            base = _scalar_type(arg)
            if base is not None:
                by_type.setdefault(base, member)
        if float in by_type:
            by_type.setdefault(int, by_type[float])

        def union(value: Any, loc: tuple[str | int, ...]) -> Any:
            direct = by_type.get(type(value))
            if direct is not None:
                return direct(value, loc)
            first: SchemaError | None = None
            for member in members:
                try:
                    return member(value, loc)
                except SchemaError as exc:
                    first = first or exc
            assert first is not None
            raise first
        return union
    if origin is Literal:
        allowed = args

        def literal(value: Any, loc: tuple[str | int, ...]) -> Any:
            if not any(value == a and type(value) is type(a) for a in allowed):
                _fail(loc, f"Input should be {' or '.join(repr(a) for a in allowed)}",
                      "literal_error")
            return value
        return literal
    if origin is list:
        item = _checker(args[0])

        def listing(value: Any, loc: tuple[str | int, ...]) -> Any:
            if not isinstance(value, list):
                _fail(loc, "Input should be a valid list", "list_type")
            out, changed = [], False
            for i, v in enumerate(value):
                try:
                    out.append(new := item(v, loc))
                except SchemaError as exc:
                    raise exc.at(len(loc), i) from None
                changed = changed or new is not v
            return out if changed else value
        return listing
    if origin is dict:
        key, val = _checker(args[0]), _checker(args[1])

        def mapping(value: Any, loc: tuple[str | int, ...]) -> Any:
            if not isinstance(value, dict):
                _fail(loc, "Input should be a valid dictionary", "dict_type")
            out, changed = {}, False
            for k, v in value.items():
                try:
                    key(k, loc)
                    out[k] = new = val(v, loc)
                except SchemaError as exc:
                    raise exc.at(len(loc), k) from None
                changed = changed or new is not v
            return out if changed else value
        return mapping
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_checker(tp)
    return _SCALARS[tp]


def _scalar_type(tp: Any) -> type | None:
    """The JSON scalar type a hint stands for (under its rules), or None for the others."""
    if typing.get_origin(tp) is typing.Annotated:
        return _scalar_type(typing.get_args(tp)[0])
    if tp is None or tp is type(None):
        return type(None)
    return tp if tp in (str, int, float, bool) else None


def _dataclass_checker(cls: type) -> Check:
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}

    def build(value: Any, loc: tuple[str | int, ...]) -> Any:
        if isinstance(value, cls):
            return value  # validated when it was made
        if not isinstance(value, dict):
            _fail(loc, "Input should be an object", "dataclass_type")
        for k in value:
            if k not in names:
                _fail((*loc, k), "Unexpected keyword argument", "unexpected_keyword_argument")
        for k in sorted(required - value.keys()):
            _fail((*loc, k), "Field required", "missing")
        try:
            return cls(**value)
        except SchemaError as exc:  # where inside: prefix our location
            for e in exc.errors:
                e["loc"] = [*loc, *e["loc"]]
            raise
        except ValueError as exc:
            _fail(loc, f"Value error, {exc}", "value_error")
    return build


def _scalar(kind: type, name: str, *, also: tuple[type, ...] = ()) -> Check:
    """Values of `kind` (or of `also`), subclasses included but bool for numbers, returned as
    plain `kind`: `torch.__version__` is a str subclass, numpy's float64 a float one."""
    accepts = (kind, *also)
    refuses = (bool,) if kind is not bool else ()

    def check(value: Any, loc: tuple[str | int, ...]) -> Any:
        if type(value) is kind:
            return value
        if isinstance(value, accepts) and not isinstance(value, refuses):
            return kind(value)
        _fail(loc, f"Input should be a valid {name}", f"{name}_type")
    return check


def _none(value: Any, loc: tuple[str | int, ...]) -> Any:
    if value is not None:
        _fail(loc, "Input should be None", "none_required")
    return None


def _datetime(value: Any, loc: tuple[str | int, ...]) -> Any:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):
        try:  # Python 3.10's parser does not know the "Z" pydantic writes
            return datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z")
                                          else value)
        except ValueError:
            pass
    _fail(loc, "Input should be a valid datetime", "datetime_type")


_SCALARS: dict[Any, Check] = {
    str: _scalar(str, "string"),
    int: _scalar(int, "integer"),
    float: _scalar(float, "number", also=(int,)),
    bool: _scalar(bool, "boolean"),
    type(None): _none,
    None: _none,
    datetime: _datetime,
}


def _plain(value: Any) -> Any:
    if isinstance(value, Schema):
        later = type(value).LATER_FIELDS
        return {f.name: _plain(getattr(value, f.name))
                for f in dataclasses.fields(value)  # type: ignore[arg-type]
                if f.name not in later or getattr(value, f.name) != f.default}
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
