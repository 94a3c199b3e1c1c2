"""Sans-IO control protocol: message kinds, msgpack codec and field validation.

A message is one msgpack map.  Requests carry ``"i"`` (request id, unique per sender and link); responses carry
``"r"`` (the id they answer) plus ``"code"`` (an :class:`LLMStatusCode` value, 0 = success) and ``"msg"``.
Bulk bytes never travel in these messages.  Every decoded field is validated; malformed input raises
:class:`ProtocolError`, which the control plane answers with an error or by dropping the message.

The typed messages (one encoder and one decoder per kind) are in :mod:`aiodatadist.protocol.messages`, the
handshake's rules in :mod:`aiodatadist.protocol.handshake`.
"""

from __future__ import annotations

from enum import StrEnum, nonmember
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

from .._checks import U64_MAX

__all__ = [
    "MAX_BATCH",
    "MAX_LIST_ITEMS",
    "MAX_MAP_LEN",
    "MAX_MESSAGE_BYTES",
    "MAX_STR_LEN",
    "Kind",
    "ProtocolError",
    "decode",
    "decode_batch",
    "encode",
    "encode_batch",
    "field",
    "int_field",
    "opt_int_list",
    "uint64_array",
]

MAX_MESSAGE_BYTES = 64 << 20
MAX_LIST_ITEMS = 1 << 22
MAX_BATCH = 4096
MAX_STR_LEN = 1 << 20
MAX_MAP_LEN = 1 << 10


class Kind(StrEnum):
    """Message kinds (the ``"k"`` of every message)."""

    HELLO = "hello"          # client -> server: handshake
    BYE = "bye"              # either side: the link is being torn down
    BEGIN = "begin"          # requester -> owner: resolve a key for a transfer, take a lease
    END = "end"              # requester -> owner: transfer finished (ok or not), drop the lease
    ABORT = "abort"          # owner -> requester: the cache of a running transfer was released, stop
    FREED = "freed"          # owner -> same-host peers: a cache's memory is gone, unmap / close what maps it
    WITHDRAW = "withdraw"    # owner -> requester: stop writing a caller-owned cache one-sided, then END the lease
    PING = "ping"            # either side: liveness check
    NOTIFY = "notify"        # either side: a notification (direct, or of a transfer that had no END)
    RESOLVE = "resolve"      # requester -> owner: which registered tensors hold these addresses (TransferConfig)
    REPLY = "reply"          # response to any request

    REQUESTS = nonmember(frozenset({HELLO, BYE, BEGIN, END, ABORT, FREED, WITHDRAW, PING, NOTIFY, RESOLVE}))
    # handled in the reader task, in order (never wait)
    INLINE = nonmember(frozenset({BEGIN, END, ABORT, FREED, WITHDRAW, PING, NOTIFY, RESOLVE, REPLY}))
    ALL = nonmember(frozenset({HELLO, BYE, BEGIN, END, ABORT, FREED, WITHDRAW, PING, NOTIFY, RESOLVE, REPLY}))


class ProtocolError(ValueError):
    """A message that does not follow the protocol."""


def encode(message: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(message, use_bin_type=True)
    return data


def encode_batch(messages: list[dict[str, Any]]) -> bytes:
    """One frame for several messages (a msgpack array of maps); a single message stays a plain map."""
    return encode(messages[0]) if len(messages) == 1 else encode(messages)  # type: ignore[arg-type]


def decode_batch(data: bytes) -> list[dict[str, Any]]:
    """Decode a frame holding one message (a map) or several (an array of maps), each checked like
    :func:`decode`."""
    message = _unpack(data)
    if isinstance(message, list):
        if not message or len(message) > MAX_BATCH:
            raise ProtocolError("empty or oversized batch")
        return [_check_envelope(m) for m in message]
    return [_check_envelope(message)]


def decode(data: bytes) -> dict[str, Any]:
    """Decode and check the envelope (kind, ids); fields are checked by their consumers."""
    return _check_envelope(_unpack(data))


def _unpack(data: bytes) -> Any:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES, max_str_len=MAX_STR_LEN,
            max_array_len=MAX_LIST_ITEMS, max_map_len=MAX_MAP_LEN, max_ext_len=0,
        )
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated classes for garbage
        raise ProtocolError(f"undecodable message: {exc}") from None
    return message


def _check_envelope(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ProtocolError("message is not a map")
    kind = message.get("k")
    if not isinstance(kind, str) or kind not in Kind.ALL:
        raise ProtocolError(f"unknown message kind {kind!r}")
    id_name = "r" if kind == Kind.REPLY else "i"
    int_field(message, id_name, 0, U64_MAX)
    return message


def field(message: dict[str, Any], name: str, types: type | tuple[type, ...], *, optional: bool = False) -> Any:
    value = message.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ProtocolError(f"field {name!r} has the wrong type")
    if not isinstance(value, types):
        raise ProtocolError(f"field {name!r} has the wrong type")
    return value


def int_field(message: dict[str, Any], name: str, low: int = -(2**63), high: int = U64_MAX) -> int:
    value = field(message, name, int)
    if not low <= value <= high:
        raise ProtocolError(f"field {name!r} out of range")
    return int(value)


def opt_int_list(message: dict[str, Any], name: str, low: int = 0, high: int = U64_MAX) -> list[int]:
    """An optional list of integers in ``[low, high]`` (absent: empty).  Checked without a Python loop per item
    (``set(map(type, ...))``, ``min``, ``max`` run in C): a BEGIN carries block lists of hundreds of items."""
    values = field(message, name, list, optional=True) or []
    if len(values) > MAX_LIST_ITEMS:
        raise ProtocolError(f"field {name!r} has too many items")
    if values and (set(map(type, values)) != _INT_ONLY or min(values) < low or max(values) > high):
        raise ProtocolError(f"field {name!r} has an invalid item")
    return values


_INT_ONLY = {int}  # (bool is a type of its own here: True is not an item)


def uint64_array(message: dict[str, Any], name: str) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """A list of unsigned 64-bit integers as a numpy array (vectorised check: no bools, floats or negatives)."""
    values = field(message, name, list)
    if len(values) > MAX_LIST_ITEMS or not all(type(v) is int for v in values):
        raise ProtocolError(f"field {name!r} must be a list of integers")
    try:
        return np.asarray(values, dtype=np.uint64)
    except (OverflowError, ValueError):
        raise ProtocolError(f"field {name!r} has an item out of range") from None
