"""The backend's messages on SGLang's control sockets, and its completion notification (sans-IO).

SGLang's common control plane carries them: the decode rank sends the prefill rank's ZeroMQ socket a
*registration* once (where its aiodatadist instance listens, and its buffer layout), then per request a
*room* message (the decode pages and aux row the request's KV goes to).  Both are
``[GUARD, kind, msgpack header, *raw]`` frames; every field is checked, and a malformed message raises
``ValueError`` (the reader logs and drops it).  SGLang's own messages on the same sockets (``ABORT``, ``KV_STATUS``,
``ABORT_ACK``, ``BOOTSTRAP``) keep their formats.

The prefill tells the decode that a request's KV is in place with an aiodatadist notification, delivered only once
the push it travels with (or every push of the request) succeeded: :func:`encode_done` / :func:`decode_done`.  It
carries the request's aux row when that fits in a notification (4 KiB).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import numpy.typing as npt

__all__ = ["GUARD", "PeerRegistration", "RoomTarget", "decode_done", "encode_done", "parse"]

GUARD = b"AiodatadistKV1"
_REGISTER = b"R"
_ROOM = b"M"
_DONE = b"kv-done "


@dataclass(frozen=True, slots=True)
class PeerRegistration:
    """A decode rank: where its aiodatadist instance listens, and what it registered."""

    agent_name: str  # the decode instance's cluster id, in decimal: SGLang's "agent" key
    endpoint: str  # the decode rank's ZeroMQ address (status messages go there)
    dst_port: int
    cluster_id: int
    host: str  # where the aiodatadist instance listens
    port: int
    tp_size: int
    tp_rank: int
    page_size: int
    kv_item_lens: tuple[int, ...]
    aux_item_lens: tuple[int, ...]

    def encode(self) -> list[bytes]:
        """The registration's frames."""
        header = {name: getattr(self, name) for name in self.__slots__}
        header["kv_item_lens"] = list(self.kv_item_lens)
        header["aux_item_lens"] = list(self.aux_item_lens)
        return [GUARD, _REGISTER, msgpack.packb(header)]


@dataclass(frozen=True, slots=True)
class RoomTarget:
    """Where one request's KV goes on one decode rank.  The attribute names are those SGLang's common manager
    reads from its ``transfer_infos`` (``endpoint``, ``dst_port``, ``is_dummy``, ``required_dst_info_num``,
    ``decode_prefix_len``)."""

    room: int
    agent_name: str
    endpoint: str
    dst_port: int
    dst_kv_indices: npt.NDArray[np.int32]
    dst_aux_index: int
    required_dst_info_num: int
    decode_prefix_len: int
    is_dummy: bool

    def encode(self) -> list[bytes]:
        """The room message's frames (the page indices travel raw, after the header)."""
        header = {"room": self.room, "agent_name": self.agent_name, "endpoint": self.endpoint,
                  "dst_port": self.dst_port, "dst_aux_index": self.dst_aux_index,
                  "required_dst_info_num": self.required_dst_info_num,
                  "decode_prefix_len": self.decode_prefix_len, "is_dummy": self.is_dummy}
        indices = np.ascontiguousarray(self.dst_kv_indices, dtype=np.int32)
        return [GUARD, _ROOM, msgpack.packb(header), indices.tobytes()]


def _int(header: dict[str, Any], name: str, low: int = 0, high: int = (1 << 64) - 1) -> int:
    value = header.get(name)
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"field {name!r}: expected an integer in [{low}, {high}], got {value!r}")
    return value


def _str(header: dict[str, Any], name: str) -> str:
    value = header.get(name)
    if type(value) is not str or not value:
        raise ValueError(f"field {name!r}: expected a non-empty string, got {value!r}")
    return value


def _ints(header: dict[str, Any], name: str) -> tuple[int, ...]:
    value = header.get(name)
    if not isinstance(value, list) or not all(type(v) is int and v > 0 for v in value):
        raise ValueError(f"field {name!r}: expected a list of positive integers, got {value!r}")
    return tuple(value)


def _header(frame: bytes) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(frame)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"undecodable header: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a map")  # noqa: TRY004 - a malformed message is a ValueError
    return header


def parse(frames: Sequence[bytes]) -> PeerRegistration | RoomTarget:
    """One of this backend's messages (``frames[0] == GUARD``); ``ValueError`` if it is malformed."""
    if len(frames) < 3 or frames[0] != GUARD:
        raise ValueError(f"not an aiodatadist backend message ({len(frames)} frames)")
    header = _header(frames[2])
    if frames[1] == _REGISTER and len(frames) == 3:
        return PeerRegistration(
            agent_name=_str(header, "agent_name"), endpoint=_str(header, "endpoint"),
            dst_port=_int(header, "dst_port", 1, 65535), cluster_id=_int(header, "cluster_id", 1),
            host=_str(header, "host"), port=_int(header, "port", 1, 65535), tp_size=_int(header, "tp_size", 1),
            tp_rank=_int(header, "tp_rank"), page_size=_int(header, "page_size", 1),
            kv_item_lens=_ints(header, "kv_item_lens"), aux_item_lens=_ints(header, "aux_item_lens"))
    if frames[1] == _ROOM and len(frames) == 4:
        raw = frames[3]
        if len(raw) % 4:
            raise ValueError(f"page indices of {len(raw)} bytes: not int32 values")
        indices = np.frombuffer(raw, dtype=np.int32)
        if indices.size and int(indices.min()) < 0:
            raise ValueError("negative page index")
        is_dummy = header.get("is_dummy")
        if type(is_dummy) is not bool:
            raise ValueError(f"field 'is_dummy': expected a bool, got {is_dummy!r}")
        return RoomTarget(
            room=_int(header, "room"), agent_name=_str(header, "agent_name"), endpoint=_str(header, "endpoint"),
            dst_port=_int(header, "dst_port", 1, 65535), dst_kv_indices=indices,
            dst_aux_index=_int(header, "dst_aux_index"),
            required_dst_info_num=_int(header, "required_dst_info_num", 1),
            decode_prefix_len=_int(header, "decode_prefix_len"), is_dummy=is_dummy)
    raise ValueError(f"unknown message kind {frames[1][:8]!r} with {len(frames)} frames")


def encode_done(room: int, prefill_rank: int, aux: bytes = b"") -> bytes:
    """The notification that tells a decode rank that request ``room``'s KV landed, from prefill rank
    ``prefill_rank``; ``aux``: the request's aux row (its buffers' rows back to back), when it travels inline."""
    return _DONE + b"%d %d\n" % (room, prefill_rank) + aux


def decode_done(message: bytes) -> tuple[int, int, bytes] | None:
    """``(room, prefill_rank, aux)`` of a done notification, None for anything else."""
    if not message.startswith(_DONE):
        return None
    head, newline, aux = message[len(_DONE):].partition(b"\n")
    parts = head.split(b" ")
    if not newline or len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]), aux
