"""Typed control-plane messages: dataclasses with explicit to/from dict.

Every frame body is a map with a ``"t"`` (type) field; ``decode_envelope``
turns it into one of the envelope dataclasses below or raises ProtocolError.
Payload messages (what the master and nodes exchange inside ``Request.params``
and ``Response.result``) subclass ``WireMessage``: their fields must be wire
types (None, bool, int, float, str, bytes, lists, str-keyed dicts, nested
WireMessages). ``from_dict`` checks field types, requires fields without
defaults and ignores unknown fields, so a newer peer may add optional fields.

No pickle anywhere: only msgpack-native values cross the wire.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union

from kvpool.errors import ProtocolError

PROTOCOL_VERSION = 1

M = TypeVar("M", bound="WireMessage")


class WireMessage:
    """Base of dataclass messages; generic, type-checked to/from dict."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: to_wire(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[M], data: Any) -> M:
        if not isinstance(data, dict):
            raise ProtocolError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
        hints = _hints(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ProtocolError(f"{cls.__name__}: missing field {f.name!r}")
                continue
            kwargs[f.name] = _from_wire(data[f.name], hints[f.name], f"{cls.__name__}.{f.name}")
        return cls(**kwargs)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def to_wire(value: Any) -> Any:
    if isinstance(value, WireMessage):
        return value.to_dict()
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


def _from_wire(value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against a (simple) type hint, converting nested messages."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        errors = []
        for arg in typing.get_args(hint):
            if arg is type(None):
                continue
            try:
                return _from_wire(value, arg, where)
            except ProtocolError as exc:
                errors.append(str(exc))
        raise ProtocolError("; ".join(errors) or f"{where}: unexpected None")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        args = typing.get_args(hint)
        item = args[0] if args else Any
        out = [_from_wire(v, item, f"{where}[]") for v in value]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        args = typing.get_args(hint)
        vt = args[1] if len(args) == 2 else Any
        return {k: _from_wire(v, vt, f"{where}{{}}") for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, WireMessage):
        return hint.from_dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(hint, type):
        ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
        if not ok:
            raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    return value


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
    cls = _ENVELOPES.get(body.get("t"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"unknown message type {body.get('t')!r}")
    return cls.from_dict(body)  # type: ignore[return-value]
