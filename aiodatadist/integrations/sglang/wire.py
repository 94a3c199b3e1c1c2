"""The backend's messages (sans-IO): on SGLang's control sockets, and as aiodatadist notifications.

SGLang's common control plane carries the first two: the decode rank sends the prefill rank's ZeroMQ socket a
*registration* once (where its aiodatadist instance listens, and its buffer layout), then per request a *room*
message (the decode pages and aux row the request's KV goes to).  Both are ``[GUARD, kind, msgpack header, *raw]``
frames; every field is checked, and a malformed message raises ``ValueError`` (the reader logs and drops it).
SGLang's own messages on the same sockets (``ABORT``, ``KV_STATUS``, ``ABORT_ACK``, ``BOOTSTRAP``) keep their formats.

The transfer itself talks with aiodatadist notifications (at most 4 KiB each, delivered in order on a link):

* prefill -> decode, ``kv-ready``: pages of a room are ready to be pulled (the prefill's page indices, where they go
  in the room's page list, whether it is the room's last piece, the size of its aux row);
* prefill -> decode, ``kv-aux``: a piece of the room's aux row (sent before the room's last ``kv-ready``);
* decode -> prefill, ``kv-pulled``: rides on the pull of a piece (delivered only if the pull succeeded);
* decode -> prefill, ``kv-failed``: the room failed on the decode side, and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import numpy.typing as npt

from ...notifications import MAX_NOTIFICATION_BYTES

__all__ = ["AUX_PER_NOTE", "GUARD", "PAGES_PER_NOTE", "READY_HEADER_BYTES", "AuxPiece", "Failed", "PeerRegistration", "Pulled", "Ready", "RoomTarget",
           "encode_aux", "encode_failed", "encode_pulled", "encode_ready", "parse", "parse_note"]

GUARD = b"AiodatadistKV1"
_REGISTER = b"R"
_ROOM = b"M"
_READY = b"kv-ready "
_AUX = b"kv-aux "
_PULLED = b"kv-pulled "
_FAILED = b"kv-failed "
READY_HEADER_BYTES = 96
"""Room a ``kv-ready`` or ``kv-aux`` notification keeps for its header (the rest: page indices or aux bytes)."""
PAGES_PER_NOTE = (MAX_NOTIFICATION_BYTES - READY_HEADER_BYTES) // 4
"""Page indices one ``kv-ready`` notification carries."""
AUX_PER_NOTE = MAX_NOTIFICATION_BYTES - READY_HEADER_BYTES
"""Aux bytes one ``kv-aux`` notification carries."""


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


def _indices(raw: bytes) -> npt.NDArray[np.int32]:
    if len(raw) % 4:
        raise ValueError(f"page indices of {len(raw)} bytes: not int32 values")
    indices = np.frombuffer(raw, dtype="<i4")
    if indices.size and int(indices.min()) < 0:
        raise ValueError("negative page index")
    return indices


def parse(frames: Sequence[bytes]) -> PeerRegistration | RoomTarget:
    """One of this backend's control messages (``frames[0] == GUARD``); ``ValueError`` if it is malformed."""
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
        is_dummy = header.get("is_dummy")
        if type(is_dummy) is not bool:
            raise ValueError(f"field 'is_dummy': expected a bool, got {is_dummy!r}")
        return RoomTarget(
            room=_int(header, "room"), agent_name=_str(header, "agent_name"), endpoint=_str(header, "endpoint"),
            dst_port=_int(header, "dst_port", 1, 65535), dst_kv_indices=_indices(frames[3]),
            dst_aux_index=_int(header, "dst_aux_index"),
            required_dst_info_num=_int(header, "required_dst_info_num", 1),
            decode_prefix_len=_int(header, "decode_prefix_len"), is_dummy=is_dummy)
    raise ValueError(f"unknown message kind {frames[1][:8]!r} with {len(frames)} frames")


# -- notifications ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    """Prefill pages ``src`` of a room are ready: they go to the room's pages ``start ..`` on the decode."""

    room: int
    prefill_rank: int
    start: int  # position in the room's page list (SGLang's index_slice)
    src: npt.NDArray[np.int32]
    last: bool  # the room's last piece: pulled once the room's earlier pieces were
    aux_len: int  # bytes of the aux row sent before it (kv-aux), on the last piece


@dataclass(frozen=True, slots=True)
class AuxPiece:
    """``data`` goes at ``offset`` of a room's aux row (the shared aux buffers' rows, back to back)."""

    room: int
    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Pulled:
    """The decode pulled one piece of a room."""

    room: int


@dataclass(frozen=True, slots=True)
class Failed:
    """The room failed on the decode side."""

    room: int
    reason: str


def encode_ready(room: int, prefill_rank: int, start: int, src: npt.NDArray[np.integer], last: bool,
                 aux_len: int = 0) -> bytes:
    """A ``kv-ready`` notification (``src``: at most ``(4096 - READY_HEADER_BYTES) / 4`` page indices)."""
    head = b"%d %d %d %d %d\n" % (room, prefill_rank, start, int(last), aux_len)
    return _READY + head + np.ascontiguousarray(src, dtype="<i4").tobytes()


def encode_aux(room: int, offset: int, data: bytes) -> bytes:
    """A ``kv-aux`` notification."""
    return _AUX + b"%d %d\n" % (room, offset) + data


def encode_pulled(room: int) -> bytes:
    """A ``kv-pulled`` notification."""
    return _PULLED + b"%d" % room


def encode_failed(room: int, reason: str) -> bytes:
    """A ``kv-failed`` notification (the reason cut to fit)."""
    return _FAILED + b"%d\n" % room + reason.encode("utf-8", "replace")[:3500]


def _numbers(head: bytes, count: int) -> list[int] | None:
    parts = head.split(b" ")
    if len(parts) != count or not all(p.isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


def parse_note(message: bytes) -> Ready | AuxPiece | Pulled | Failed | None:
    """One of the backend's notifications, None for anything else (malformed included)."""
    if message.startswith(_READY):
        head, newline, raw = message[len(_READY):].partition(b"\n")
        numbers = _numbers(head, 5)
        if not newline or numbers is None or numbers[3] > 1:
            return None
        try:
            src = _indices(raw)
        except ValueError:
            return None
        return Ready(numbers[0], numbers[1], numbers[2], src, bool(numbers[3]), numbers[4])
    if message.startswith(_AUX):
        head, newline, data = message[len(_AUX):].partition(b"\n")
        numbers = _numbers(head, 2)
        return AuxPiece(numbers[0], numbers[1], data) if newline and numbers is not None else None
    if message.startswith(_PULLED):
        numbers = _numbers(message[len(_PULLED):], 1)
        return Pulled(numbers[0]) if numbers is not None else None
    if message.startswith(_FAILED):
        head, newline, reason = message[len(_FAILED):].partition(b"\n")
        numbers = _numbers(head, 1)
        return Failed(numbers[0], reason.decode("utf-8", "replace")) if newline and numbers is not None else None
    return None
