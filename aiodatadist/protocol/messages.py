"""Every wire form of the control protocol in one place: one typed value per message kind, one encoder and one
decoder each.

``to_wire()`` gives the body of a message (a dict: the fields without the envelope's ``"k"``/``"i"``/``"r"``);
:func:`request_to_wire` and :func:`reply_to_wire` add the envelope exactly as the channel does.  ``from_wire()``
takes a decoded message (the envelope already checked by :func:`~aiodatadist.protocol.codec.decode_batch`) and
raises :class:`ProtocolError` for anything malformed.

Fields that the receiver has always tolerated when malformed (the peer's host probe, its announced segments and
directory, ``reads``, the server's ``plane``, its data-connection offer, ...) decode to a neutral value (None, an
empty tuple, ``False``) instead of raising, exactly as the readers did: a wrong announcement only costs an
optimisation.  Absent optional fields decode to their defaults.

The wire format is that of protocol version 9 (:data:`aiodatadist.protocol.handshake.PROTOCOL_VERSION`, whose
comment lists what each version added); the handshake refuses a peer of any other version.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple, Self, TypeVar

import numpy as np

from .._arrays import UInt64Array
from .._checks import I64_MAX, I64_MIN, U64_LIMIT, U64_MAX
from ..layout.plans import CacheGeometry, TransferParams
from ..types import Transport
from .auth import NONCE_BYTES
from .codec import Kind, ProtocolError, field, int_field, opt_int_list, uint64_array
from .identity import SegmentIdentity

__all__ = [
    "ACL_IPC_KEY_BYTES",
    "FDS_PREFIX",
    "FD_TOKEN_BYTES",
    "HOST_NONCE_BYTES",
    "IPC_HANDLE_BYTES",
    "IPC_HANDLE_SIZES",
    "MAX_ANNOUNCED_SEGMENTS",
    "MAX_DATA_CONNECTIONS",
    "MAX_IPC_ALLOCATIONS",
    "MAX_NOTE_BYTES",
    "MAX_RESOLVED_ADDRS",
    "Abort",
    "Begin",
    "BeginReply",
    "Bye",
    "DataOffer",
    "Descriptor",
    "DeviceIdentity",
    "End",
    "EndReply",
    "Freed",
    "Hello",
    "HelloChallenge",
    "HelloReply",
    "HostInfo",
    "IpcAllocation",
    "Located",
    "NixlReach",
    "Notify",
    "Ping",
    "Plane",
    "Reply",
    "Request",
    "Resolve",
    "ResolveReply",
    "WireKey",
    "Withdraw",
    "geometry_from_wire",
    "geometry_to_wire",
    "hello_reply_from_wire",
    "ipc_from_wire",
    "is_challenge",
    "note_from_wire",
    "params_from_wire",
    "params_to_wire",
    "published_from_wire",
    "range_from_wire",
    "range_to_wire",
    "reply_to_wire",
    "request_from_wire",
    "request_to_wire",
    "segment_from_wire",
    "segment_to_wire",
    "segments_from_wire",
    "transport_from_wire",
]

Plane = Literal["shm", "tcp", "nixl"]
IpcAllocation = tuple[bytes, int, int]
"""A device allocation a same-host peer opens by IPC: ``(handle, base, size)``."""

MAX_IPC_ALLOCATIONS = 4096
"""Device allocations one cache descriptor (or one FREED) may name."""
IPC_HANDLE_BYTES = 64
"""Size of a CUDA IPC memory handle."""
ACL_IPC_KEY_BYTES = 65
"""Size of an ACL IPC export key (``aclrtIpcMemGetExportKey``: a NUL-terminated string)."""
IPC_HANDLE_SIZES = frozenset({IPC_HANDLE_BYTES, ACL_IPC_KEY_BYTES})
"""The IPC handle sizes a descriptor may carry: its length says whose runtime's memory it is."""
MAX_ANNOUNCED_SEGMENTS = 4096
"""Segments of a HELLO (or its reply) that the receiver looks at; the rest are mapped lazily at first use."""
MAX_DATA_CONNECTIONS = 16
"""TCP data connections per link (``MAX_CONNS`` in ``native/src/net.c``; the TCP plane's bound)."""
HOST_NONCE_BYTES = 32
"""Size of the nonce in a host probe."""
MAX_NOTE_BYTES = 4096
"""Size limit of a notification (END's ``note``, NOTIFY's ``note``)."""
FDS_PREFIX = "\0aiodatadist-"
"""How the abstract Unix socket names of :mod:`aiodatadist.transport.fd_passing` begin."""
FD_TOKEN_BYTES = 16
"""Size of the token a peer presents to that socket."""
DATA_TOKEN_BYTES = 16
_U32_MAX = 2**32 - 1
_KEY_KINDS = ("id", "blocks", "req", "prefix")
_TRANSPORTS = frozenset(t.value for t in Transport)
_T = TypeVar("_T")


def _is_int(v: object) -> bool:
    return type(v) is int


def _lenient(parse: Callable[[Any], _T], value: Any) -> _T | None:
    """``parse(value)``, or None where it is malformed (for fields whose readers have always tolerated that)."""
    try:
        return parse(value)
    except ProtocolError:
        return None


# -- wire forms shared by several messages ---------------------------------------------------------------------
def geometry_to_wire(g: CacheGeometry) -> list[Any]:
    """``[num_tensors, tensor_size, slots, is_blocks, data_type]`` (the data type since protocol version 3)."""
    return [g.num_tensors, g.tensor_size, g.slots, g.is_blocks, g.data_type]


def geometry_from_wire(value: Any) -> CacheGeometry:
    if not (isinstance(value, list) and len(value) == 5 and isinstance(value[3], bool)
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= I64_MAX for v in value[:3])
            and _is_int(value[4]) and I64_MIN <= value[4] <= I64_MAX):
        raise ProtocolError("invalid cache geometry")
    num_tensors, tensor_size, slots, is_blocks, data_type = value
    if num_tensors <= 0 or slots <= 0 or tensor_size <= 0 or tensor_size % slots:
        raise ProtocolError("invalid cache geometry")
    return CacheGeometry(num_tensors, tensor_size, slots, is_blocks, data_type)


def segment_to_wire(s: SegmentIdentity | None, base: int) -> list[int] | None:
    return None if s is None else [s.pid, s.fd, s.inode, s.device, s.size, base]


def segment_from_wire(value: Any) -> tuple[SegmentIdentity, int] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 6
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= U64_MAX for v in value)):
        raise ProtocolError("invalid segment identity")
    pid, fd, inode, device, size, base = value
    return SegmentIdentity(pid, fd, inode, device, size), base


def segments_from_wire(value: Any) -> tuple[tuple[SegmentIdentity, int], ...]:
    """The shared-memory segments a peer announced at link time: the valid ones among the first
    :data:`MAX_ANNOUNCED_SEGMENTS` (a wrong announcement only costs the lazy mapping at first use)."""
    if not isinstance(value, list):
        return ()
    out = []
    for item in value[:MAX_ANNOUNCED_SEGMENTS]:
        parsed = _lenient(segment_from_wire, item)
        if parsed is not None:
            out.append(parsed)
    return tuple(out)


def _directory_from_wire(value: Any) -> SegmentIdentity | None:
    """A peer's cache directory segment ``[pid, fd, inode, device, size]`` (None: absent or malformed)."""
    if not (isinstance(value, list) and len(value) == 5 and all(_is_int(v) for v in value)):
        return None
    return SegmentIdentity(*value)


def _directory_to_wire(value: SegmentIdentity | None) -> list[int] | None:
    return None if value is None else [value.pid, value.fd, value.inode, value.device, value.size]


def note_from_wire(value: Any) -> bytes:
    """A notification: bytes, at most :data:`MAX_NOTE_BYTES`."""
    if not (isinstance(value, bytes) and len(value) <= MAX_NOTE_BYTES):
        raise ProtocolError("invalid notification")
    return value


def range_to_wire(r: range | None) -> list[int] | None:
    return None if r is None else [r.start, r.stop]


def range_from_wire(value: Any) -> range | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 for v in value)):
        raise ProtocolError("invalid layer range")
    return range(value[0], value[1])


def transport_from_wire(value: object) -> Transport:
    """A peer's ``llm.Transport`` setting; anything unknown counts as ``auto``."""
    return Transport(value) if isinstance(value, str) and value in _TRANSPORTS else Transport.AUTO


class WireKey(NamedTuple):
    """A cache key as the owner indexes it: ``kind`` is ``id``, ``blocks``, ``req`` or ``prefix`` (a named tuple:
    cheap to build at every call)."""

    kind: str
    a: int
    b: int

    def to_wire(self) -> list[Any]:
        return [self.kind, self.a, self.b]

    @classmethod
    def from_wire(cls, value: Any) -> WireKey:
        if not (isinstance(value, list) and len(value) == 3 and value[0] in _KEY_KINDS
                and all(isinstance(v, int) and not isinstance(v, bool) and I64_MIN <= v <= U64_MAX
                        for v in value[1:])):
            raise ProtocolError("invalid cache key")
        return cls(value[0], value[1], value[2])


def params_to_wire(p: TransferParams) -> dict[str, Any]:
    return {
        "op": p.op, "api": p.api, "sb": list(p.src_blocks), "db": list(p.dst_blocks),
        "sr": range_to_wire(p.src_layer_range), "dr": range_to_wire(p.dst_layer_range),
        "n": p.tensor_num_per_layer, "size": p.size, "slot": p.local_slot,
    }


def params_from_wire(m: dict[str, Any]) -> TransferParams:
    op, api = field(m, "op", str), field(m, "api", str)
    if op not in ("pull", "push") or api not in ("cache", "blocks"):
        raise ProtocolError("unknown transfer kind")
    return TransferParams(
        op=op, api=api,
        src_blocks=tuple(opt_int_list(m, "sb", 0, I64_MAX)), dst_blocks=tuple(opt_int_list(m, "db", 0, I64_MAX)),
        src_layer_range=range_from_wire(m.get("sr")), dst_layer_range=range_from_wire(m.get("dr")),
        tensor_num_per_layer=int_field(m, "n", 1, _U32_MAX), size=int_field(m, "size", -1, I64_MAX),
        local_slot=int_field(m, "slot", 0, _U32_MAX),
    )


def ipc_from_wire(value: Any) -> tuple[IpcAllocation, ...] | None:
    """A device cache's allocations ``[handle, base, size]``, sorted by base (None: a host cache)."""
    if value is None:
        return None
    if not (isinstance(value, list) and 0 < len(value) <= MAX_IPC_ALLOCATIONS):
        raise ProtocolError("invalid device allocations")
    out = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], bytes)
                and len(item[0]) in IPC_HANDLE_SIZES
                and all(type(v) is int and 0 < v < U64_LIMIT for v in item[1:]) and item[1] + item[2] < U64_LIMIT):
            raise ProtocolError("invalid device allocation")
        out.append((item[0], item[1], item[2]))
    return tuple(sorted(out, key=lambda item: item[1]))


def published_from_wire(value: Any) -> tuple[int, int]:
    """Where the owner published a cache in its directory: ``(row, stamp)``."""
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)):
        raise ProtocolError("invalid directory entry")
    return value[0], value[1]


def _addrs_inside(addrs: UInt64Array, tensor_size: int, segment: tuple[SegmentIdentity, int] | None,
                  window: tuple[int, int] | None) -> bool:
    """Whether the bytes ``window`` (None: all) of every tensor lie inside ``segment`` (if any)."""
    if segment is None:
        return True
    identity, base = segment
    low, high = window if window is not None else (0, tensor_size)
    return bool(((addrs + np.uint64(low) >= base) & (addrs + np.uint64(high) <= base + identity.size)).all())


@dataclass(frozen=True, slots=True)
class NixlReach:
    """How a requester's NIXL agent reaches an owner's cache: the owner agent's metadata for that cache (its
    connection info and the cache's registration), the memory type (``DRAM``/``VRAM``) and device."""

    metadata: bytes
    mem: str = "DRAM"
    dev: int = 0

    def to_wire(self) -> list[Any]:
        return [self.metadata, self.mem, self.dev]

    @classmethod
    def from_wire(cls, value: Any) -> Self:
        if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], bytes) and value[0]
                and value[1] in ("DRAM", "VRAM") and _is_int(value[2]) and 0 <= value[2] < 2**16):
            raise ProtocolError("invalid NIXL reach")
        return cls(value[0], value[1], value[2])


@dataclass(frozen=True, slots=True, eq=False)
class Descriptor:
    """An owner's cache as the requester knows it: geometry, tensor addresses (inside its shared-memory segment,
    if any), that segment and its base address (None: caller-registered memory outside any shareable segment),
    device allocations to open by CUDA IPC (None: a host cache); ``borrowed``: caller-owned memory (registered,
    possibly inside a shareable segment), which pushes always reach through the owner (so that unregistering it
    aborts them); ``window``: the bytes ``[low, high)`` of each tensor that the segment holds (None: all; memory
    shared in place leaves out the partial pages at its ends, which are copied the unshared way)."""

    geometry: CacheGeometry
    addrs: UInt64Array
    segment: tuple[SegmentIdentity, int] | None = None
    ipc: tuple[IpcAllocation, ...] | None = None
    borrowed: bool = False
    nixl: NixlReach | None = None
    window: tuple[int, int] | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Descriptor):
            return NotImplemented
        return (self.geometry == other.geometry and self.segment == other.segment and self.ipc == other.ipc
                and self.borrowed == other.borrowed and self.nixl == other.nixl and self.window == other.window
                and np.array_equal(self.addrs, other.addrs))

    def to_wire(self) -> dict[str, Any]:
        segment = self.segment
        out: dict[str, Any] = {
            "geometry": geometry_to_wire(self.geometry), "addrs": self.addrs.tolist(),
            "segment": segment_to_wire(segment[0] if segment else None, segment[1] if segment else 0),
        }
        if self.ipc is not None:
            out["ipc"] = [list(item) for item in self.ipc]
        if self.borrowed:
            out["borrowed"] = True
        if self.nixl is not None:
            out["nixl"] = self.nixl.to_wire()
        if self.window is not None:
            out["window"] = list(self.window)
        return out

    @classmethod
    def from_wire(cls, value: Any) -> Self:
        if not isinstance(value, dict):
            raise ProtocolError("invalid cache descriptor")
        geometry = geometry_from_wire(value.get("geometry"))
        addrs = uint64_array(value, "addrs")
        segment = segment_from_wire(value.get("segment"))
        window = value.get("window")
        if window is not None and not (isinstance(window, list) and len(window) == 2 and all(map(_is_int, window))
                                       and 0 <= window[0] < window[1] <= geometry.tensor_size):
            raise ProtocolError("invalid window in a cache descriptor")
        window = (int(window[0]), int(window[1])) if window is not None else None
        if len(addrs) != geometry.num_tensors or not _addrs_inside(addrs, geometry.tensor_size, segment, window):
            raise ProtocolError("the owner announced addresses outside its cache")
        borrowed = value.get("borrowed", False)
        if not isinstance(borrowed, bool):
            raise ProtocolError("invalid cache descriptor")
        nixl = value.get("nixl")
        return cls(geometry, addrs, segment, ipc_from_wire(value.get("ipc")), borrowed,
                   NixlReach.from_wire(nixl) if nixl is not None else None, window)


@dataclass(frozen=True, slots=True)
class HostInfo:
    """A process's host probe (see :mod:`aiodatadist.transport.same_host`): the host's boot id, the pid, a
    one-page shared segment (and its address in that process) holding ``nonce``; ``fds``: the abstract Unix
    socket that hands out its segments (:mod:`aiodatadist.transport.fd_passing`), if any."""

    boot: str
    pid: int
    probe: SegmentIdentity
    address: int
    nonce: bytes
    fds: str | None = None

    def to_wire(self) -> dict[str, Any]:
        p = self.probe
        out = {"boot": self.boot, "pid": self.pid, "probe": [p.pid, p.fd, p.inode, p.device, p.size, self.address],
               "nonce": self.nonce}
        if self.fds is not None:
            out["fds"] = self.fds
        return out

    @classmethod
    def from_wire(cls, value: Any) -> Self:
        """Types only: whether the probe is real (same boot id, a readable segment) is for the receiver to try."""
        try:
            boot, pid, probe, nonce = value["boot"], value["pid"], value["probe"], value["nonce"]
            ok = (isinstance(boot, str) and isinstance(pid, int) and isinstance(nonce, bytes)
                  and isinstance(probe, list) and len(probe) == 6 and all(isinstance(v, int) for v in probe))
        except (KeyError, TypeError):
            ok = False
        if not ok or len(nonce) != HOST_NONCE_BYTES:
            raise ProtocolError("invalid host probe")
        fds = value.get("fds")
        if fds is not None and not (isinstance(fds, str) and fds.startswith(FDS_PREFIX) and len(fds) <= 107):
            fds = None  # not our kind of socket: never connected to
        return cls(boot, pid, SegmentIdentity(*probe[:5]), probe[5], nonce, fds)


@dataclass(frozen=True, slots=True)
class DataOffer:
    """The server's TCP data connections: its port and the token they present (None on an authenticated link,
    where both ends derive it from the handshake and it is never sent)."""

    port: int
    token: bytes | None = None

    def to_wire(self) -> list[Any]:
        return [self.port] if self.token is None else [self.port, self.token]

    @classmethod
    def from_wire(cls, value: Any) -> Self:
        if not (isinstance(value, list) and len(value) in (1, 2) and _is_int(value[0]) and 0 < value[0] < 65536
                and (len(value) == 1 or (isinstance(value[1], bytes) and len(value[1]) == DATA_TOKEN_BYTES))):
            raise ProtocolError("invalid data connection offer")
        return cls(value[0], value[1] if len(value) == 2 else None)


# -- requests --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Hello:
    """Client -> server: the handshake.  ``cn`` is the client's nonce (always sent); ``sn``/``cp`` (the server's
    nonce and the client proof) only in the second HELLO of an authenticated link (see
    :mod:`aiodatadist.protocol.auth`)."""

    KIND: ClassVar[Kind] = Kind.HELLO
    version: int
    cluster: int
    target: int
    role: int
    transport: Transport = Transport.AUTO
    host: HostInfo | None = None
    segs: tuple[tuple[SegmentIdentity, int], ...] = ()
    directory: SegmentIdentity | None = None
    reads: bool = False
    cn: bytes | None = None
    sn: bytes | None = None
    cp: bytes | None = None
    fdt: bytes | None = None  # the token this client's fd socket asks of the server (only once it is trusted)
    dev: DeviceIdentity | None = None  # the client's device runtime, once it opened one

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "v": self.version, "cluster": self.cluster, "to": self.target, "role": self.role,
            "host": self.host.to_wire() if self.host is not None else None, "transport": self.transport.value,
            "segs": [segment_to_wire(s, base) for s, base in self.segs], "dir": _directory_to_wire(self.directory),
            "reads": self.reads,
        }
        for name in ("cn", "sn", "cp", "fdt"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.dev is not None:
            out["dev"] = device_to_wire(self.dev)
        return out

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        version = int_field(m, "v")
        cluster = int_field(m, "cluster", 0)
        target = int_field(m, "to", 0)
        role = int_field(m, "role", 0, 3)
        transport = transport_from_wire(field(m, "transport", str))
        cn, sn, cp, fdt = m.get("cn"), m.get("sn"), m.get("cp"), m.get("fdt")
        return cls(
            version, cluster, target, role, transport,
            host=_lenient(HostInfo.from_wire, m.get("host")), segs=segments_from_wire(m.get("segs")),
            directory=_directory_from_wire(m.get("dir")), reads=m.get("reads") is True,
            cn=cn if isinstance(cn, bytes) and len(cn) == NONCE_BYTES else None,
            sn=sn if isinstance(sn, bytes) else None,
            # A proof that is there but not bytes is still a (failed) proof, never a request for a challenge.
            cp=None if cp is None else cp if isinstance(cp, bytes) else b"",
            fdt=fdt if isinstance(fdt, bytes) and len(fdt) == FD_TOKEN_BYTES else None,
            dev=device_from_wire(m.get("dev")),
        )


@dataclass(frozen=True, slots=True)
class Begin:
    """Requester -> owner: resolve ``key`` for a transfer and take a lease.  ``peer`` is the requester's cache
    geometry, ``known`` the owner caches it already has descriptors of.  ``src``: a same-host push's source
    tensors (their addresses in the requester), offered so that the owner may copy the bytes itself (see
    :class:`BeginReply`'s ``copies``); ``sseg``: the requester's shared-memory segment that holds them, and its
    base address there (the owner may map it rather than read the requester's memory)."""

    KIND: ClassVar[Kind] = Kind.BEGIN
    tid: int
    key: WireKey
    peer: CacheGeometry
    params: TransferParams
    known: tuple[int, ...] = ()
    src: tuple[int, ...] | None = None
    sseg: tuple[SegmentIdentity, int] | None = None
    dev: DeviceIdentity | None = None  # the requester's device runtime (the owner names its PID on IPC exports)

    def to_wire(self) -> dict[str, Any]:
        out = {"tid": self.tid, "key": self.key.to_wire(), "peer": geometry_to_wire(self.peer),
               "known": list(self.known), **params_to_wire(self.params)}
        if self.dev is not None:
            out["dev"] = device_to_wire(self.dev)
        if self.src is not None:
            out["src"] = list(self.src)
            if self.sseg is not None:
                out["sseg"] = segment_to_wire(*self.sseg)
        return out

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        tid = int_field(m, "tid", 0)
        key = WireKey.from_wire(m.get("key"))
        params = params_from_wire(m)
        peer = geometry_from_wire(m.get("peer"))
        known = tuple(opt_int_list(m, "known", 1, I64_MAX))
        src = sseg = None
        if m.get("src") is not None:
            src = tuple(opt_int_list(m, "src"))
            if len(src) != peer.num_tensors or params.op != "push":
                raise ProtocolError(f"BEGIN offers {len(src)} source tensors for a {params.op} of "
                                    f"{peer.num_tensors}")
            sseg = segment_from_wire(m.get("sseg"))
        return cls(tid, key, peer, params, known, src, sseg, device_from_wire(m.get("dev")))


@dataclass(frozen=True, slots=True)
class End:
    """Requester -> owner: the transfer is over (``ok`` or not); ``confirm``: answer only once every byte of a
    TCP push has landed; ``note``: a notification the owner delivers if the transfer succeeded (at most
    :data:`MAX_NOTE_BYTES`; a malformed one makes the END malformed)."""

    KIND: ClassVar[Kind] = Kind.END
    tid: int
    ok: bool
    confirm: bool = False
    note: bytes | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tid": self.tid, "ok": self.ok}
        if self.confirm:
            out["confirm"] = True
        if self.note is not None:
            out["note"] = self.note
        return out

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        tid = int_field(m, "tid", 0)
        note = m.get("note")
        return cls(tid, field(m, "ok", bool), m.get("confirm") is True,
                   None if note is None else note_from_wire(note))


@dataclass(frozen=True, slots=True)
class Notify:
    """Either side: a notification (``LLMDataDist.notify``, or the one of a transfer that had no END: a cache read
    through the owner's directory or by one-sided TCP reads); answered with an empty reply once queued."""

    KIND: ClassVar[Kind] = Kind.NOTIFY
    note: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"note": self.note}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        return cls(note_from_wire(m.get("note")))


@dataclass(frozen=True, slots=True)
class Abort:
    """Owner -> requester: the cache of running transfer ``tid`` was released, stop."""

    KIND: ClassVar[Kind] = Kind.ABORT
    tid: int

    def to_wire(self) -> dict[str, Any]:
        return {"tid": self.tid}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        return cls(int_field(m, "tid", 0))


@dataclass(frozen=True, slots=True)
class Withdraw:
    """Owner -> requester: caller-owned cache ``cid``, which the requester may write without a round trip, is
    being unregistered.  The requester forgets its resolution, stops its writes into it and, once none runs,
    sends ``END(tid, ok=False)``: ``tid`` names the lease the owner holds on the cache until then."""

    KIND: ClassVar[Kind] = Kind.WITHDRAW
    tid: int
    cid: int

    def to_wire(self) -> dict[str, Any]:
        return {"tid": self.tid, "cid": self.cid}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        return cls(int_field(m, "tid", 0), int_field(m, "cid", 1, I64_MAX))


@dataclass(frozen=True, slots=True)
class Freed:
    """Owner -> same-host peers: cache ``cid`` is gone; ``seg`` is its segment ``(inode, device)``, ``ipc`` the
    IPC handles it exported."""

    KIND: ClassVar[Kind] = Kind.FREED
    cid: int
    seg: tuple[int, int] | None = None
    ipc: tuple[bytes, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cid": self.cid}
        if self.seg is not None:
            out["seg"] = list(self.seg)
        if self.ipc:
            out["ipc"] = list(self.ipc)
        return out

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        cid = int_field(m, "cid", 1, I64_MAX)
        value, handles = m.get("seg"), m.get("ipc")
        seg = None
        if isinstance(value, list) and len(value) == 2 and all(_is_int(v) for v in value):
            seg = (value[0], value[1])
        ipc: tuple[bytes, ...] = ()
        if isinstance(handles, list):
            ipc = tuple(h for h in handles[:MAX_IPC_ALLOCATIONS] if isinstance(h, bytes) and len(h) in IPC_HANDLE_SIZES)
        return cls(cid, seg, ipc)


@dataclass(frozen=True, slots=True)
class Ping:
    """Either side: liveness check."""

    KIND: ClassVar[Kind] = Kind.PING

    def to_wire(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        return cls()


@dataclass(frozen=True, slots=True)
class Bye:
    """Either side: the link is being torn down."""

    KIND: ClassVar[Kind] = Kind.BYE

    def to_wire(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        return cls()


MAX_RESOLVED_ADDRS = 1024
"""Addresses one RESOLVE may name (2 per layer of a TransferConfig)."""


@dataclass(frozen=True, slots=True)
class Resolve:
    """Requester -> owner: which of the owner's registered tensors hold ``addrs`` (a ``TransferConfig``'s raw
    destination addresses); answered with a :class:`ResolveReply`, or ``LLM_KV_CACHE_NOT_EXIST``."""

    KIND: ClassVar[Kind] = Kind.RESOLVE
    addrs: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"addrs": list(self.addrs)}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        addrs = uint64_array(m, "addrs")
        if not 0 < len(addrs) <= MAX_RESOLVED_ADDRS:
            raise ProtocolError(f"resolve names {len(addrs)} addresses (1 to {MAX_RESOLVED_ADDRS})")
        return cls(tuple(int(a) for a in addrs))


@dataclass(frozen=True, slots=True)
class Located:
    """Where an address lies on the owner: tensor ``tensor`` of cache ``cid``, at slot (or block) ``slot`` (its
    offset from the tensor's base is a whole number of them); ``model``: the ``BlocksCacheKey.model_id`` a blocks
    cache answers to (-1: none)."""

    cid: int
    tensor: int
    slot: int
    is_blocks: bool
    model: int


@dataclass(frozen=True, slots=True)
class ResolveReply:
    """Owner -> requester: one :class:`Located` per address of the RESOLVE, in order."""

    at: tuple[Located, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"at": [[a.cid, a.tensor, a.slot, int(a.is_blocks), a.model] for a in self.at]}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        rows = field(m, "at", list)
        located = []
        for row in rows:
            if not (isinstance(row, list) and len(row) == 5 and all(type(v) is int for v in row)):
                raise ProtocolError(f"malformed resolve reply row {row!r}")
            located.append(Located(row[0], row[1], row[2], bool(row[3]), row[4]))
        return cls(tuple(located))


Request = Hello | Bye | Begin | End | Abort | Withdraw | Freed | Ping | Notify | Resolve
_REQUESTS: dict[str, type[Request]] = {cls.KIND: cls for cls in (Hello, Bye, Begin, End, Abort, Withdraw, Freed, Ping,
                                                                  Notify, Resolve)}


def request_from_wire(m: dict[str, Any]) -> Request:
    """The typed request of a decoded message (by its ``"k"``)."""
    cls = _REQUESTS.get(m.get("k"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"not a request: {m.get('k')!r}")
    return cls.from_wire(m)


def request_to_wire(message: Request, req_id: int) -> dict[str, Any]:
    """The whole message, as :meth:`Channel.request <aiodatadist.control.channel.Channel.request>` sends it."""
    return {**message.to_wire(), "k": message.KIND, "i": req_id}


# -- replies ---------------------------------------------------------------------------------------------------
def reply_to_wire(req_id: int, body: dict[str, Any] | None = None, *, code: int = 0, msg: str = "") -> dict[str, Any]:
    """The whole reply to request ``req_id``: a body (a reply type's ``to_wire()``) in the reply envelope."""
    return {**(body or {}), "k": Kind.REPLY, "r": req_id, "code": code, "msg": msg}


@dataclass(frozen=True, slots=True)
class Reply:
    """The envelope of any reply: which request it answers, its status code (0: success) and message.

    ``msg`` is None when the reply has none; a code that is not an integer counts as -1 (any non-zero code is
    an error, reported as ``LLMStatusCode.from_code(code)``)."""

    r: int
    code: int = 0
    msg: str | None = ""

    @property
    def error(self) -> str:
        """The text of a failed reply's error."""
        return "peer reported an error" if self.msg is None else self.msg

    def to_wire(self) -> dict[str, Any]:
        return reply_to_wire(self.r, code=self.code, msg="" if self.msg is None else self.msg)

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        code, msg = m.get("code", 0), m.get("msg")
        return cls(int_field(m, "r", 0, U64_MAX), 0 if not code else int(code) if isinstance(code, int) else -1,
                   None if "msg" not in m else str(msg))


@dataclass(frozen=True, slots=True)
class HelloChallenge:
    """Server -> client, first answer to HELLO on an authenticated server: its nonce and the server proof."""

    challenge: bytes
    sp: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"challenge": self.challenge, "sp": self.sp}

    def reply_to_wire(self, req_id: int) -> dict[str, Any]:
        """The whole reply, as the server sends it (no ``"msg"``)."""
        return {"k": Kind.REPLY, "r": req_id, "code": 0, **self.to_wire()}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        challenge, sp = m.get("challenge"), m.get("sp")
        if not (isinstance(challenge, bytes) and len(challenge) == NONCE_BYTES):
            raise ProtocolError("invalid challenge")
        if not isinstance(sp, bytes):
            raise ProtocolError("invalid server proof")
        return cls(challenge, sp)


@dataclass(frozen=True, slots=True)
class HelloReply:
    """Server -> client: the link is admitted.  ``plane`` is the server's choice (``tcp`` makes both ends use
    TCP); ``data``/``dconns`` (TCP data connections: the offer and how many to open) are there when the server
    listens for them."""

    cluster: int
    role: int = 0
    host: HostInfo | None = None
    transport: Transport = Transport.AUTO
    segs: tuple[tuple[SegmentIdentity, int], ...] = ()
    directory: SegmentIdentity | None = None
    plane: Plane = "shm"
    reads: bool = False
    data: DataOffer | None = None
    dconns: int | None = None
    fdt: bytes | None = None  # the token the server's fd socket asks of this client
    dev: DeviceIdentity | None = None  # the server's device runtime, once it opened one

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cluster": self.cluster, "role": self.role, "host": self.host.to_wire() if self.host is not None else None,
            "transport": self.transport.value, "segs": [segment_to_wire(s, base) for s, base in self.segs],
            "dir": _directory_to_wire(self.directory), "plane": self.plane, "reads": self.reads,
        }
        if self.data is not None:
            out["data"] = self.data.to_wire()
        if self.dconns is not None:
            out["dconns"] = self.dconns
        if self.fdt is not None:
            out["fdt"] = self.fdt
        if self.dev is not None:
            out["dev"] = device_to_wire(self.dev)
        return out

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        role, dconns, fdt = m.get("role", 0), m.get("dconns"), m.get("fdt")
        return cls(
            host=_lenient(HostInfo.from_wire, m.get("host")), cluster=int_field(m, "cluster", 0),
            role=int(role) if isinstance(role, int) else 0, transport=transport_from_wire(m.get("transport")),
            segs=segments_from_wire(m.get("segs")), directory=_directory_from_wire(m.get("dir")),
            plane=_plane_from_wire(m.get("plane")), reads=m.get("reads") is True,
            data=_lenient(DataOffer.from_wire, m.get("data")),
            dconns=dconns if isinstance(dconns, int) and _is_int(dconns) and 1 <= dconns <= MAX_DATA_CONNECTIONS
            else None,
            fdt=fdt if isinstance(fdt, bytes) and len(fdt) == FD_TOKEN_BYTES else None,
            dev=device_from_wire(m.get("dev")),
        )


DeviceIdentity = tuple[str, int]
"""A process's device runtime (``"cuda"``, ``"acl"``) and the PID its IPC imports present (ACL's bare TGID)."""
DEVICE_RUNTIME_NAMES = frozenset({"cuda", "acl"})


def device_to_wire(dev: DeviceIdentity) -> list[Any]:
    return [dev[0], dev[1]]


def device_from_wire(value: Any) -> DeviceIdentity | None:
    """A peer's device runtime, or None (not announced, or not understood: only an optimisation is lost)."""
    if (isinstance(value, list) and len(value) == 2 and value[0] in DEVICE_RUNTIME_NAMES and _is_int(value[1])
            and 0 < value[1] < 2**31):
        return value[0], value[1]
    return None


def _plane_from_wire(value: object) -> Plane:
    return "tcp" if value == "tcp" else "nixl" if value == "nixl" else "shm"


def is_challenge(m: dict[str, Any]) -> bool:
    """Whether an answer to HELLO is a challenge (else the link is admitted, or refused by its code)."""
    return m.get("challenge") is not None


def hello_reply_from_wire(m: dict[str, Any]) -> HelloChallenge | HelloReply:
    """The server's (successful) answer to the first HELLO: a challenge, or the admission."""
    return HelloChallenge.from_wire(m) if is_challenge(m) else HelloReply.from_wire(m)


@dataclass(frozen=True, slots=True)
class BeginReply:
    """Owner -> requester: the owner cache ``cid`` and batch slot the key resolved to; ``pub``: where it is
    published in the owner's directory (``(row, stamp)``); ``desc``: its descriptor, unless the requester
    listed it as known; ``copies``: the owner copied this push itself, reading the source BEGIN offered, and
    answers only now that every byte landed (the requester moves nothing and ends it with ``END``)."""

    cid: int
    slot: int
    pub: tuple[int, int] | None = None
    desc: Descriptor | None = None
    copies: bool = False

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cid": self.cid, "slot": self.slot}
        if self.pub is not None:
            out["pub"] = list(self.pub)
        if self.desc is not None:
            out["desc"] = self.desc.to_wire()
        if self.copies:
            out["copies"] = True
        return out

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        slot = int_field(m, "slot", 0, _U32_MAX)
        cid = int_field(m, "cid", 1, I64_MAX)
        described, published = m.get("desc"), m.get("pub")
        desc = Descriptor.from_wire(described) if described is not None else None
        return cls(cid, slot, published_from_wire(published) if published is not None else None, desc,
                   m.get("copies") is True)


@dataclass(frozen=True, slots=True)
class EndReply:
    """Owner -> requester, answer to END: how long (ms) the owner waited for its end of a TCP stream to settle."""

    waited: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return {} if self.waited is None else {"waited": self.waited}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Self:
        waited = m.get("waited")
        return cls(waited if isinstance(waited, float) else None)
