"""The control protocol's codec, sans IO: bytes in, messages (or ProtocolError) out.

No sockets, no event loop: frames are built with msgpack directly (or by hand, for what msgpack would refuse to
write) and fed to :func:`decode_batch`.
"""

from __future__ import annotations

import ast
from enum import StrEnum
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest
from helpers.examples import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiodatadist.protocol
from aiodatadist.protocol.codec import (
    MAX_BATCH,
    MAX_LIST_ITEMS,
    MAX_MAP_LEN,
    MAX_MESSAGE_BYTES,
    MAX_STR_LEN,
    Kind,
    ProtocolError,
    decode,
    decode_batch,
    encode,
    encode_batch,
    field,
    int_field,
    opt_int_list,
    uint64_array,
)

U64_MAX = 2**64 - 1


def pack(value: Any) -> bytes:
    return bytes(msgpack.packb(value, use_bin_type=True))


# -- kinds ---------------------------------------------------------------------------------------------------------
def test_kinds_are_a_str_enum_with_the_wire_strings() -> None:
    assert issubclass(Kind, StrEnum)
    assert {k.name: k.value for k in Kind} == {
        "HELLO": "hello", "BYE": "bye", "BEGIN": "begin", "END": "end", "ABORT": "abort", "FREED": "freed",
        "WITHDRAW": "withdraw", "PING": "ping", "NOTIFY": "notify", "RESOLVE": "resolve", "REPLY": "reply"}
    begin: str = Kind.BEGIN
    assert begin == "begin" and str(Kind.BEGIN) == "begin" and f"{Kind.END}" == "end"
    assert Kind("ping") is Kind.PING


def test_kind_sets() -> None:
    assert Kind.ALL == {"hello", "bye", "begin", "end", "abort", "freed", "withdraw", "ping", "notify", "resolve",
                        "reply"} == set(Kind)
    assert Kind.REQUESTS == Kind.ALL - {"reply"}
    # HELLO and BYE may wait; NOTIFY is inline so that notifications are delivered in the order they came
    assert Kind.INLINE == {"begin", "end", "abort", "freed", "withdraw", "ping", "notify", "resolve", "reply"}
    assert "REQUESTS" not in Kind.__members__ and len(Kind) == 11


def test_a_kind_encodes_as_its_plain_string() -> None:
    assert encode({"k": Kind.REPLY, "r": 1}) == pack({"k": "reply", "r": 1})


# -- frames --------------------------------------------------------------------------------------------------------
def test_one_message_is_a_plain_map_several_are_an_array() -> None:
    one = {"k": "ping", "i": 1}
    two = {"k": "reply", "r": 1, "code": 0, "msg": ""}
    assert encode_batch([one]) == encode(one) == pack(one)
    assert encode_batch([one, two]) == pack([one, two])
    assert decode_batch(encode_batch([one])) == [one]
    assert decode_batch(encode_batch([one, two])) == [one, two]
    assert decode(encode(one)) == one


def test_batch_limits() -> None:
    ping = {"k": "ping", "i": 7}
    assert len(decode_batch(encode_batch([ping] * MAX_BATCH))) == MAX_BATCH
    with pytest.raises(ProtocolError, match="batch"):
        decode_batch(encode_batch([ping] * (MAX_BATCH + 1)))
    with pytest.raises(ProtocolError, match="batch"):
        decode_batch(pack([]))
    with pytest.raises(ProtocolError, match="not a map"):
        decode_batch(pack([ping, [ping]]))
    with pytest.raises(ProtocolError, match="kind"):
        decode_batch(pack([ping, {"k": "nonsense", "i": 1}]))  # one bad message refuses the whole frame


def test_message_size_limit() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_batch(b"\x80" + b"\x00" * MAX_MESSAGE_BYTES)


def test_unpacker_limits() -> None:
    ok = {"k": "ping", "i": 1}
    assert decode(pack({**ok, "x": "s" * MAX_STR_LEN}))["x"] == "s" * MAX_STR_LEN
    with pytest.raises(ProtocolError, match="undecodable"):
        decode(pack({**ok, "x": "s" * (MAX_STR_LEN + 1)}))
    assert len(decode(pack({**ok, **{f"f{n}": n for n in range(MAX_MAP_LEN - 2)}}))) == MAX_MAP_LEN
    with pytest.raises(ProtocolError, match="undecodable"):
        decode(pack({**ok, **{f"f{n}": n for n in range(MAX_MAP_LEN - 1)}}))
    assert len(decode(pack({**ok, "x": [0] * MAX_LIST_ITEMS}))["x"]) == MAX_LIST_ITEMS
    with pytest.raises(ProtocolError, match="undecodable"):
        decode(pack({**ok, "x": [0] * (MAX_LIST_ITEMS + 1)}))
    with pytest.raises(ProtocolError, match="undecodable"):
        decode(pack({**ok, "x": msgpack.ExtType(1, b"ab")}))  # no extension types at all
    with pytest.raises(ProtocolError, match="undecodable"):
        decode(pack({**ok, 1: "x"}))  # map keys are strings


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x81", b"\x82\xa1k", pack({"k": "ping", "i": 1})[:-1],
                                  pack({"k": "ping", "i": 1}) + b"\x00"])
def test_garbage_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_batch(data)


@pytest.mark.parametrize("message", [
    {"k": "nonsense", "i": 1}, {"k": 7, "i": 1}, {"k": None, "i": 1}, {"i": 1}, {"k": "REPLY", "r": 1},
    {"k": "ping"}, {"k": "ping", "i": -1}, {"k": "ping", "i": True}, {"k": "ping", "i": 1.0}, {"k": "ping", "i": "1"},
    {"k": "ping", "r": 1}, {"k": "reply", "i": 1}, {"k": "reply", "r": -1}, {"k": "reply", "r": False},
])
def test_the_envelope_is_checked(message: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        decode_batch(pack(message))


@pytest.mark.parametrize("kind", sorted(Kind.REQUESTS))
def test_every_request_kind_with_any_id_passes_the_envelope(kind: str) -> None:
    for req_id in (0, 1, U64_MAX):
        assert decode(pack({"k": kind, "i": req_id})) == {"k": kind, "i": req_id}
    assert decode(pack({"k": "reply", "r": U64_MAX})) == {"k": "reply", "r": U64_MAX}


envelopes = st.one_of(
    st.fixed_dictionaries({"k": st.sampled_from(sorted(Kind.REQUESTS)), "i": st.integers(0, U64_MAX)}),
    st.fixed_dictionaries({"k": st.just("reply"), "r": st.integers(0, U64_MAX)}),
)
json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), U64_MAX), st.floats(allow_nan=False),
              st.text(max_size=8), st.binary(max_size=16)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)),
    max_leaves=10,
)


@st.composite
def valid_messages(draw: st.DrawFn) -> dict[str, Any]:
    extra = draw(st.dictionaries(st.text(max_size=6).map(lambda s: "x" + s), json_like,
                                 max_size=5))
    return {**extra, **draw(envelopes)}


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(valid_messages(), min_size=1, max_size=8))
def test_round_trip_of_any_valid_frame(messages: list[dict[str, Any]]) -> None:
    assert decode_batch(encode_batch(messages)) == messages


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=200), json_like.map(pack),
                 st.lists(st.one_of(valid_messages(), json_like), max_size=4).map(pack)))
def test_any_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    try:
        messages = decode_batch(data)
    except ProtocolError:
        return
    for m in messages:
        assert isinstance(m, dict) and m["k"] in Kind.ALL
        id_name = "r" if m["k"] == "reply" else "i"
        assert type(m[id_name]) is int and 0 <= m[id_name] <= U64_MAX


# -- field validators ----------------------------------------------------------------------------------------------
def test_field() -> None:
    m = {"s": "x", "b": True, "i": 3, "n": None, "l": [1]}
    assert field(m, "s", str) == "x"
    assert field(m, "b", bool) is True
    assert field(m, "i", int) == 3
    assert field(m, "i", (int, str)) == 3
    assert field(m, "n", int, optional=True) is None
    assert field(m, "absent", int, optional=True) is None
    cases: list[tuple[str, type | tuple[type, ...]]] = [
        ("s", int), ("b", int), ("b", (int, str)), ("i", bool), ("n", int), ("absent", str), ("l", dict)]
    for name, types in cases:
        with pytest.raises(ProtocolError, match=repr(name)):
            field(m, name, types)


def test_int_field_bounds_are_inclusive() -> None:
    m = {"lo": 0, "hi": 10, "neg": -(2**63), "big": U64_MAX, "f": 1.0, "b": False, "s": "1"}
    assert int_field(m, "lo", 0, 10) == 0
    assert int_field(m, "hi", 0, 10) == 10
    assert int_field(m, "neg") == -(2**63)
    assert int_field(m, "big") == U64_MAX
    for name, low, high in [("lo", 1, 10), ("hi", 0, 9), ("neg", -(2**63) + 1, 0), ("big", 0, U64_MAX - 1)]:
        with pytest.raises(ProtocolError, match="out of range"):
            int_field(m, name, low, high)
    for name in ("f", "b", "s", "absent"):
        with pytest.raises(ProtocolError, match="wrong type"):
            int_field(m, name)


def test_opt_int_list() -> None:
    assert opt_int_list({}, "x") == []
    assert opt_int_list({"x": None}, "x") == []
    assert opt_int_list({"x": [0, 5, U64_MAX]}, "x") == [0, 5, U64_MAX]
    assert opt_int_list({"x": [1, 3]}, "x", 1, 3) == [1, 3]
    for bad in ([True], [1.0], ["1"], [None], [-1], [4]):
        with pytest.raises(ProtocolError, match="invalid item"):
            opt_int_list({"x": bad}, "x", 0, 3)
    with pytest.raises(ProtocolError, match="wrong type"):
        opt_int_list({"x": (1, 2)}, "x")
    with pytest.raises(ProtocolError, match="too many"):
        opt_int_list({"x": [0] * (MAX_LIST_ITEMS + 1)}, "x")


def test_uint64_array() -> None:
    array = uint64_array({"a": [0, 1, U64_MAX]}, "a")
    assert array.dtype == np.uint64 and array.tolist() == [0, 1, U64_MAX]
    assert uint64_array({"a": []}, "a").tolist() == []
    for bad in ([True], [1.5], [-1], ["1"], [None], [[1]]):
        with pytest.raises(ProtocolError, match="'a'"):
            uint64_array({"a": bad}, "a")
    with pytest.raises(ProtocolError, match="wrong type"):
        uint64_array({"a": None}, "a")
    with pytest.raises(ProtocolError):
        uint64_array({"a": [0] * (MAX_LIST_ITEMS + 1)}, "a")


# -- sans IO -------------------------------------------------------------------------------------------------------
def test_the_protocol_package_does_no_io() -> None:
    """Nothing in aiodatadist/protocol imports zmq, asyncio, socket, ctypes, threading or reads a clock."""
    forbidden = {"zmq", "asyncio", "socket", "ctypes", "threading", "selectors", "time", "anyio"}
    folder = Path(aiodatadist.protocol.__file__).parent
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path.name} imports {name}"
