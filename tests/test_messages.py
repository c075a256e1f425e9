"""WireMessage encode/decode: the per-class compiled codec against an interpreter of the hints.

``WireMessage.from_dict`` / ``to_dict`` run checkers built once per class from
its type hints (kvpool.rpc.messages). The reference below interprets the hints
per value, the way the module did before: both must give the same value (same
types: an int is not a float, a list not a tuple) or the same ProtocolError
text, for every real message class and for generated near-valid and junk
values. The explicit cases pin the rules the compiled path could get subtly
wrong: bool vs int vs float, None in Optional, nested lists and maps of
messages, bytes vs str, unions tried in order.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.cluster import wire
from kvpool.errors import ProtocolError
from kvpool.rpc.messages import (
    ErrorReply,
    Hello,
    HelloReply,
    Request,
    Response,
    WireMessage,
    decode_envelope,
    encode_envelope,
    to_wire,
)
from kvpool.serve.runtime import worker_messages
from kvpool.transport.base import RegionInfo, UcxInfo

# --- the reference: interpret the hints per value ----------------------------------


def ref_to_wire(value: Any) -> Any:
    if isinstance(value, WireMessage):
        return {
            f.name: ref_to_wire(getattr(value, f.name))
            for f in dataclasses.fields(value)  # type: ignore[arg-type]
        }
    if isinstance(value, list | tuple):
        return [ref_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: ref_to_wire(v) for k, v in value.items()}
    return value


def ref_from_dict(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ProtocolError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{cls.__name__}: missing field {f.name!r}")
            continue
        kwargs[f.name] = ref_from_wire(data[f.name], hints[f.name], f"{cls.__name__}.{f.name}")
    return cls(**kwargs)


def ref_from_wire(value: Any, hint: Any, where: str) -> Any:
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
                return ref_from_wire(value, arg, where)
            except ProtocolError as exc:
                errors.append(str(exc))
        raise ProtocolError("; ".join(errors) or f"{where}: unexpected None")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        args = typing.get_args(hint)
        item = args[0] if args else Any
        out = [ref_from_wire(v, item, f"{where}[]") for v in value]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        args = typing.get_args(hint)
        vt = args[1] if len(args) == 2 else Any
        return {k: ref_from_wire(v, vt, f"{where}{{}}") for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, WireMessage):
        return ref_from_dict(hint, value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(hint, type):
        ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
        if not ok:
            raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    return value


def same(a: Any, b: Any) -> bool:
    """Equal with equal types all the way down (1 == 1.0 == True are not the same here)."""
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(
            same(getattr(a, f.name), getattr(b, f.name))
            for f in dataclasses.fields(a)  # type: ignore[arg-type]
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except ProtocolError as exc:
        return "error", str(exc)


def assert_decodes_alike(cls: type[WireMessage], data: Any) -> None:
    new, ref = outcome(cls.from_dict, data), outcome(ref_from_dict, cls, data)
    assert new[0] == ref[0], (new, ref)
    if new[0] == "error":
        assert new[1] == ref[1]
    else:
        assert same(new[1], ref[1]), (new, ref)
        assert same(new[1].to_dict(), ref_to_wire(new[1]))


# --- test-only messages covering every hint shape ----------------------------------


@dataclass
class Inner(WireMessage):
    name: str
    weight: float = 1.0


@dataclass
class Shapes(WireMessage):
    count: int
    flag: bool = False
    ratio: float = 0.0
    blob: bytes = b""
    text: str = ""
    maybe: bytes | None = None
    either: int | str = 0
    old_optional: typing.Optional[int] = None  # noqa: UP045 - typing.Union form on purpose
    anything: Any = None
    items: list[Inner] = field(default_factory=list)
    by_name: dict[str, Inner] = field(default_factory=dict)
    nested: list[list[Inner | None]] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)
    pair: tuple[int, ...] = ()
    loose: list[Any] = field(default_factory=list)
    plain_list: list = field(default_factory=list)  # type: ignore[type-arg]
    inner: Inner | None = None


REAL = [
    c
    for module in (wire, worker_messages)
    for c in vars(module).values()
    if isinstance(c, type) and issubclass(c, WireMessage) and c is not WireMessage
] + [RegionInfo, UcxInfo, Hello, HelloReply, Request, Response, ErrorReply]
CLASSES = [*REAL, Inner, Shapes]

junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.binary(max_size=8)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


def near(hint: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    """Mostly values that fit ``hint``, sometimes junk (so both paths' errors are compared)."""
    return st.one_of(fitting(hint, depth), junk) if depth < 3 else junk


def fitting(hint: Any, depth: int) -> st.SearchStrategy[Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return junk
    if origin in (Union, types.UnionType):
        return st.one_of(*[st.none() if a is type(None) else near(a, depth + 1) for a in args])
    if origin in (list, tuple):
        item = args[0] if args else Any
        return st.lists(near(item, depth + 1), max_size=3) | st.lists(
            near(item, depth + 1), max_size=3
        ).map(tuple)
    if origin is dict:
        vt = args[1] if len(args) == 2 else Any
        return st.dictionaries(st.text(max_size=4), near(vt, depth + 1), max_size=3)
    if isinstance(hint, type) and issubclass(hint, WireMessage):
        return message_dicts(hint, depth + 1)
    simple: dict[Any, st.SearchStrategy[Any]] = {
        int: st.integers(-(2**63), 2**64 - 1) | st.booleans(),
        float: st.floats(allow_nan=False) | st.integers(-5, 5) | st.booleans(),
        bool: st.booleans() | st.integers(0, 1),
        str: st.text(max_size=6) | st.binary(max_size=6),
        bytes: st.binary(max_size=6) | st.text(max_size=6),
    }
    return simple.get(hint, junk)


def message_dicts(cls: type, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: near(hints[f.name], depth) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return st.fixed_dictionaries(
        {}, optional={**fields, "unknown_field": junk}
    ) | st.fixed_dictionaries(fields)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_compiled_codec_matches_the_hint_interpreter(cls: type[WireMessage], data: Any) -> None:
    assert_decodes_alike(cls, data.draw(message_dicts(cls) | junk))


# --- the rules, explicitly ---------------------------------------------------------


def test_bool_is_not_an_int_and_ints_become_floats() -> None:
    with pytest.raises(ProtocolError, match=r"^Shapes\.count: expected int, got bool$"):
        Shapes.from_dict({"count": True})
    with pytest.raises(ProtocolError, match=r"^Shapes\.flag: expected bool, got int$"):
        Shapes.from_dict({"count": 1, "flag": 1})
    with pytest.raises(ProtocolError, match=r"^Shapes\.ratio: expected float, got bool$"):
        Shapes.from_dict({"count": 1, "ratio": False})
    msg = Shapes.from_dict({"count": 2**64 - 1, "ratio": 3, "flag": True})
    assert msg.count == 2**64 - 1 and msg.flag is True
    assert msg.ratio == 3.0 and type(msg.ratio) is float
    ttl = wire.AllocateReply.from_dict({"placements": [], "nodes": {}, "ttl": 5}).ttl
    assert ttl == 5.0 and type(ttl) is float


def test_none_only_where_the_hint_allows_it() -> None:
    msg = Shapes.from_dict({"count": 0, "maybe": None, "keys": [b"k", None], "old_optional": None})
    assert msg.maybe is None and msg.keys == [b"k", None] and msg.old_optional is None
    with pytest.raises(ProtocolError, match=r"^Shapes\.count: expected int, got NoneType$"):
        Shapes.from_dict({"count": None})
    with pytest.raises(ProtocolError, match=r"^Shapes\.keys\[\]: expected bytes, got str$"):
        Shapes.from_dict({"count": 0, "keys": [b"k", "k"]})
    reply = wire.AllocateReply.from_dict({"placements": [None, [[1, "n", 0]]], "nodes": {}})
    assert reply.placements == [None, [[1, "n", 0]]]


def test_bytes_and_str_are_distinct() -> None:
    with pytest.raises(ProtocolError, match=r"^Shapes\.blob: expected bytes, got str$"):
        Shapes.from_dict({"count": 0, "blob": "x"})
    with pytest.raises(ProtocolError, match=r"^Shapes\.text: expected str, got bytes$"):
        Shapes.from_dict({"count": 0, "text": b"x"})
    with pytest.raises(ProtocolError, match=r"^CommitRequest\.keys\[\]: expected bytes, got str$"):
        wire.CommitRequest.from_dict({"ids": [1], "keys": ["k" * 16]})


def test_unions_try_members_in_order_and_join_their_errors() -> None:
    assert Shapes.from_dict({"count": 0, "either": "a"}).either == "a"
    assert Shapes.from_dict({"count": 0, "either": 7}).either == 7
    with pytest.raises(ProtocolError) as exc:
        Shapes.from_dict({"count": 0, "either": b"x"})
    assert str(exc.value) == (
        "Shapes.either: expected int, got bytes; Shapes.either: expected str, got bytes"
    )


def test_nested_messages_in_lists_and_maps() -> None:
    data = {
        "count": 1,
        "items": [{"name": "a"}, {"name": "b", "weight": 2}],
        "by_name": {"x": {"name": "x", "weight": 0.5}},
        "nested": [[{"name": "c"}, None], []],
        "inner": {"name": "i", "ignored": 1},
    }
    msg = Shapes.from_dict(data)
    assert msg.items == [Inner("a"), Inner("b", 2.0)] and type(msg.items[1].weight) is float
    assert msg.by_name == {"x": Inner("x", 0.5)}
    assert msg.nested == [[Inner("c"), None], []]
    assert msg.inner == Inner("i")
    assert same(msg.to_dict(), ref_to_wire(msg))
    assert Shapes.from_dict(msg.to_dict()) == msg
    with pytest.raises(ProtocolError, match=r"^Inner: missing field 'name'$"):
        Shapes.from_dict({"count": 1, "nested": [[{"weight": 1.0}]]})
    with pytest.raises(ProtocolError, match=r"^Inner: expected a map, got list$"):
        Shapes.from_dict({"count": 1, "by_name": {"x": []}})
    with pytest.raises(ProtocolError, match=r"^Shapes\.by_name: expected a map, got list$"):
        Shapes.from_dict({"count": 1, "by_name": []})
    region = RegionInfo(node_id="n", size=1, ucx=UcxInfo(host="h", port=1, worker_address=b"w"))
    reply = wire.LeaseReply(lease_id=1, blocks=[None], nodes={"n": region}, ttl=1.0)
    assert wire.LeaseReply.from_dict(reply.to_dict()) == reply


def test_containers_are_fresh_copies_and_tuples_stay_tuples() -> None:
    loose = [1, [2]]
    msg = Shapes.from_dict({"count": 0, "loose": loose, "pair": [1, 2], "plain_list": [(3,)]})
    assert msg.loose == loose and msg.loose is not loose
    assert msg.pair == (1, 2) and type(msg.pair) is tuple
    assert msg.plain_list == [(3,)]  # a bare ``list`` hint is an isinstance check only
    with pytest.raises(ProtocolError, match=r"^Shapes\.plain_list: expected list, got tuple$"):
        Shapes.from_dict({"count": 0, "plain_list": (3,)})
    anything = {"deep": [b"x"]}
    assert Shapes.from_dict({"count": 0, "anything": anything}).anything is anything
    out = Shapes(count=1, pair=(1, 2), loose=[(3, Inner("z"))]).to_dict()
    assert out["pair"] == [1, 2] and out["loose"] == [[3, {"name": "z", "weight": 1.0}]]


def test_required_unknown_and_non_map() -> None:
    with pytest.raises(ProtocolError, match=r"^Shapes: missing field 'count'$"):
        Shapes.from_dict({"ratio": 1.0})
    assert Shapes.from_dict({"count": 3, "newer_peer_field": [1]}) == Shapes(count=3)
    with pytest.raises(ProtocolError, match=r"^Shapes: expected a map, got list$"):
        Shapes.from_dict([1])


def test_to_wire_converts_everything_nested() -> None:
    class Subclassed(list):  # type: ignore[type-arg]
        pass

    value = {"a": (Inner("x"), [Inner("y", 2.0)]), "b": Subclassed([Inner("z")]), "c": 1}
    assert same(to_wire(value), ref_to_wire(value))
    assert to_wire(value)["b"] == [{"name": "z", "weight": 1.0}]


def test_envelopes_round_trip_and_bad_types_refused() -> None:
    for env in (
        Hello(version=1, token=None, name="x"),
        HelloReply(ok=True, version=1),
        Request(3, "m", wire.CommitRequest(ids=[1], keys=[b"k" * 16]).to_dict()),
        Response(3, [True, None, False]),
        ErrorReply(0, "bad_frame", "no"),
    ):
        body = encode_envelope(env)
        assert body["t"] == env.T
        assert decode_envelope(body) == env
    params = wire.LeaseRequest(keys=[b"k" * 16])
    encoded = encode_envelope(Request(1, "m", params))["params"]
    assert encoded == {"keys": [b"k" * 16], "prefix": True}
    with pytest.raises(ProtocolError, match=r"unknown message type \['req'\]"):
        decode_envelope({"t": ["req"], "id": 1, "method": "m"})
    with pytest.raises(ProtocolError, match=r"^Request\.id: expected int, got bool$"):
        decode_envelope({"t": "req", "id": True, "method": "m"})
