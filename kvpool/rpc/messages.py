"""Typed control-plane messages: dataclasses with explicit to/from dict.

Every frame body is a map with a ``"t"`` (type) field; ``decode_envelope``
turns it into one of the envelope dataclasses below or raises ProtocolError.
Payload messages (what the master and nodes exchange inside ``Request.params``
and ``Response.result``) subclass ``WireMessage``: their fields must be wire
types (None, bool, int, float, str, bytes, lists, str-keyed dicts, nested
WireMessages). ``from_dict`` checks field types, requires fields without
defaults and ignores unknown fields, so a newer peer may add optional fields.

Cost: every master call decodes and encodes a few of these, so the type
hints are not interpreted per message. The first use of a class builds its
``_Codec`` once: field names, which are required, and per field a checker
function compiled from the hint (None where the hint is ``Any``), with the
error location baked in. A message then costs a few dict operations and one
small function call per typed field. The checks, conversions and error texts
are exactly those of interpreting the hint (tests/test_messages.py holds the
interpreting reference and compares both on generated values):

- ``int`` refuses bool; ``float`` accepts an int (not a bool) and converts it;
- ``X | None`` accepts None; another union tries its members in order and
  joins their errors with ``"; "``;
- ``list[X]`` / ``tuple[X, ...]`` accept a list or tuple and return a new
  list (tuple) of checked items; ``dict[K, V]`` a new dict of checked values
  (keys are not checked: msgpack maps here have str keys);
- a nested WireMessage is decoded with its own ``from_dict``;
- any other class is an ``isinstance`` check; anything else is passed as is.

No pickle anywhere: only msgpack-native values cross the wire.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union

from kvpool.errors import ProtocolError

PROTOCOL_VERSION = 1

M = TypeVar("M", bound="WireMessage")
Check = Callable[[Any], Any]  # returns the checked (maybe converted) value or raises

# Types that to_wire returns unchanged (exact types: subclasses take the slow path).
_PLAIN: frozenset[type] = frozenset({int, float, str, bytes, bool, type(None)})
_MISSING = object()


class WireMessage:
    """Base of dataclass messages; generic, type-checked to/from dict."""

    def to_dict(self) -> dict[str, Any]:
        cls = type(self)
        codec = _CODECS.get(cls) or _Codec.build(cls)
        out: dict[str, Any] = {}
        for name in codec.names:
            value = getattr(self, name)
            out[name] = value if type(value) in _PLAIN else to_wire(value)
        return out

    @classmethod
    def from_dict(cls: type[M], data: Any) -> M:
        if not isinstance(data, dict):
            raise ProtocolError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
        codec = _CODECS.get(cls) or _Codec.build(cls)
        kwargs: dict[str, Any] = {}
        for name, check, required in codec.fields:
            value = data.get(name, _MISSING)
            if value is _MISSING:
                if required:
                    raise ProtocolError(f"{cls.__name__}: missing field {name!r}")
                continue
            kwargs[name] = value if check is None else check(value)
        return cls(**kwargs)


class _Codec:
    """What encoding and decoding one message class needs, computed once."""

    __slots__ = ("fields", "names")

    def __init__(self, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        self.names: tuple[str, ...] = tuple(f.name for f in fields)
        # (name, checker or None for Any, required)
        self.fields: tuple[tuple[str, Check | None, bool], ...] = tuple(
            (
                f.name,
                _checker(hints[f.name], f"{cls.__name__}.{f.name}"),
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in fields
        )

    @staticmethod
    def build(cls: type) -> _Codec:
        codec = _CODECS[cls] = _Codec(cls)  # two threads may both build it: same result
        return codec


_CODECS: dict[type, _Codec] = {}


def to_wire(value: Any) -> Any:
    """``value`` with every WireMessage turned into its dict and tuples into lists."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is list or kind is tuple:
        return [v if type(v) in _PLAIN else to_wire(v) for v in value]
    if kind is dict:
        return {k: v if type(v) in _PLAIN else to_wire(v) for k, v in value.items()}
    if isinstance(value, WireMessage):
        return value.to_dict()
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


# --- checkers compiled from type hints ------------------------------------------


def _checker(hint: Any, where: str) -> Check | None:
    """The function checking a wire value against ``hint`` (None: accept as is)."""
    if hint is Any:
        return None
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return _union(hint, where)
    if origin in (list, tuple):
        args = typing.get_args(hint)
        return _sequence(args[0] if args else Any, where, origin is tuple)
    if origin is dict:
        args = typing.get_args(hint)
        return _mapping(args[1] if len(args) == 2 else Any, where)
    if isinstance(hint, type) and issubclass(hint, WireMessage):
        return hint.from_dict
    if isinstance(hint, type):
        return _instance(hint, where)
    return None


def _instance(hint: type, where: str) -> Check:
    def wrong(value: Any) -> ProtocolError:
        return ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")

    if hint is int:

        def check_int(value: Any) -> Any:
            if type(value) is int or (isinstance(value, int) and not isinstance(value, bool)):
                return value
            raise wrong(value)

        return check_int
    if hint is float:

        def check_float(value: Any) -> Any:
            if type(value) is float:
                return value
            if isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, float):
                return value
            raise wrong(value)

        return check_float

    def check_type(value: Any) -> Any:
        if isinstance(value, hint):
            return value
        raise wrong(value)

    return check_type


def _union(hint: Any, where: str) -> Check:
    args = typing.get_args(hint)
    nullable = type(None) in args
    members = [_checker(arg, where) or _same for arg in args if arg is not type(None)]
    if len(members) == 1:  # X | None: X's own error is the whole error
        only = members[0]

        def check_optional(value: Any) -> Any:
            if value is None and nullable:
                return None
            return only(value)

        return check_optional

    def check_union(value: Any) -> Any:
        if value is None and nullable:
            return None
        errors = []
        for member in members:
            try:
                return member(value)
            except ProtocolError as exc:
                errors.append(str(exc))
        raise ProtocolError("; ".join(errors) or f"{where}: unexpected None")

    return check_union


def _same(value: Any) -> Any:
    return value


def _sequence(item_hint: Any, where: str, as_tuple: bool) -> Check:
    item = _checker(item_hint, f"{where}[]")

    def check_sequence(value: Any) -> Any:
        if not isinstance(value, list | tuple):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        out = list(value) if item is None else [item(v) for v in value]
        return tuple(out) if as_tuple else out

    return check_sequence


def _mapping(value_hint: Any, where: str) -> Check:
    item = _checker(value_hint, f"{where}{{}}")

    def check_mapping(value: Any) -> Any:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        return dict(value) if item is None else {k: item(v) for k, v in value.items()}

    return check_mapping


# --- envelopes ---------------------------------------------------------------


@dataclass
class Hello(WireMessage):
    """First frame a client sends: protocol version and the shared token (if any)."""

    T: ClassVar[str] = "hello"
    version: int
    token: str | None = None
    name: str = ""


@dataclass
class HelloReply(WireMessage):
    """The server's answer to Hello; ``ok`` False carries the refusal reason."""

    T: ClassVar[str] = "hello_reply"
    ok: bool
    version: int
    reason: str = ""
    server: str = ""


@dataclass
class Request(WireMessage):
    """A call: ``id`` is unique among the connection's in-flight requests (>= 1)."""

    T: ClassVar[str] = "req"
    id: int
    method: str
    params: Any = None


@dataclass
class Response(WireMessage):
    """A successful result for request ``id``."""

    T: ClassVar[str] = "res"
    id: int
    result: Any = None


@dataclass
class ErrorReply(WireMessage):
    """A failure for request ``id`` (0: not tied to a request, e.g. a malformed frame)."""

    T: ClassVar[str] = "err"
    id: int
    code: str
    message: str
    type: str = ""


Envelope = Hello | HelloReply | Request | Response | ErrorReply
_ENVELOPES: dict[str, type[WireMessage]] = {
    c.T: c for c in (Hello, HelloReply, Request, Response, ErrorReply)
}


def encode_envelope(msg: Envelope) -> dict[str, Any]:
    body = msg.to_dict()
    body["t"] = msg.T
    return body


def decode_envelope(body: dict[str, Any]) -> Envelope:
    kind = body.get("t")
    cls = _ENVELOPES.get(kind) if isinstance(kind, str) else None  # a list "t" is unhashable
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    return cls.from_dict(body)  # type: ignore[return-value]
