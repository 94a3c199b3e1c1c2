"""A link's data plane: the one object that moves a link's bytes, whatever the mechanism.

A link is a control channel plus a :class:`DataPlane`, chosen once at link time from the handshake (the link
layer's factory).  The transfer layer drives every plane through this interface and never asks which one it
has:

* requester side: :meth:`~DataPlane.check_local` (can this plane move that cache at all),
  :meth:`~DataPlane.route` and :meth:`~DataPlane.move_published` (a cache the owner published: one-sided, no
  round trip, where the plane can), :meth:`~DataPlane.expect` and :meth:`~DataPlane.source_for_owner` (set up
  before ``BEGIN``), :meth:`~DataPlane.move` (after the owner's ``BEGIN`` reply, unless the owner copied),
  :meth:`~DataPlane.cut_short` (a push stopped mid-way), :meth:`~DataPlane.abort` (the owner released the cache);
* owner side: :meth:`~DataPlane.refusal`, :meth:`~DataPlane.serve`, :meth:`~DataPlane.finish_served`,
  :meth:`~DataPlane.publishes`, :meth:`~DataPlane.reach`, :meth:`~DataPlane.tells_freed`;
* lifetime: :meth:`~DataPlane.stop` (no thread touches memory any more), then :meth:`~DataPlane.close`.

The planes depend on the layers above them only through the small structural types here (:class:`LocalCache`),
so ``transport`` imports neither the registry nor the transfer layer; they copy through the copy layer below them
(:class:`Copies`, the instance's :class:`~aiodatadist.copy.engine.CopyEngine` as a plane uses it).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

from .._arrays import UInt64Array
from ..copy.device import DeviceSupport
from ..copy.engine import CopiedCache
from ..copy.python_pool import CopyJob
from ..errors import LLMException
from ..layout.plans import CacheGeometry, CopyPlan, TransferParams
from ..native import CopySpec
from ..protocol.identity import SegmentIdentity
from ..protocol.messages import Descriptor, Freed, NixlReach, Plane
from ..stats import OneSided
from .directory import Resolved
from .same_host import PeerCapabilities

__all__ = ["Copies", "DataPlane", "LocalCache", "OfferedSource", "OnUntrusted", "Route", "ServedCache", "Transfer"]

OnUntrusted = Callable[[LLMException], Awaitable[None]]
"""Drops the link: its peer may still write what it was sent, or its plane broke."""


class LocalCache(CopiedCache, Protocol):
    """What a plane needs of this side's cache (the registry's entry): what its copies touch, and more."""

    @property
    def geometry(self) -> CacheGeometry: ...

    @property
    def shared_segment(self) -> Any: ...

    @property
    def shared_window(self) -> tuple[int, int] | None: ...


class ServedCache(LocalCache, Protocol):
    """What a plane needs of the owner's cache it serves (the registry's entry)."""


class OfferedSource(NamedTuple):
    """The source tensors of a push that ``BEGIN`` offers the owner to copy itself (``Begin.src``/``sseg``): their
    addresses in the requester and, where they lie in one of its shared-memory segments, that segment and its
    base address there (an owner that maps it copies with ``memcpy`` instead of ``process_vm_readv``)."""

    addrs: UInt64Array
    segment: tuple[SegmentIdentity, int] | None


class Copies(Protocol):
    """This instance's copy engine (:class:`~aiodatadist.copy.engine.CopyEngine`), as the same-host plane uses
    it."""

    def device(self) -> DeviceSupport: ...

    def device_addrs(self, entry: CopiedCache) -> UInt64Array: ...

    def copy_now(self, plan: CopyPlan, src_addrs: UInt64Array, dst_addrs: UInt64Array,
                 copier: CopySpec | None) -> bool: ...

    def start_job(self, plan: CopyPlan, src_addrs: UInt64Array, dst_addrs: UInt64Array, copier: CopySpec | None,
                  entries: tuple[CopiedCache, ...], *, on_device: bool = False) -> CopyJob: ...

    async def wait_job(self, job: CopyJob, entries: tuple[CopiedCache, ...]) -> None: ...

    def cancel_job(self, job: CopyJob, error: BaseException | None = None) -> None: ...

    async def wait_stopped(self, job: CopyJob) -> None: ...


class Route(enum.Enum):
    """How a transfer on a cache the owner published before goes."""

    OWNER = "owner"  # through the owner (BEGIN/END); the resolution is kept
    STALE = "stale"  # through the owner, and the resolution is forgotten (released or re-keyed)
    ONE_SIDED = "one-sided"  # by this plane alone: :meth:`DataPlane.move_published`


@dataclass(slots=True)
class Transfer:
    """One transfer as a plane moves it."""

    tid: int
    pull: bool
    plan: CopyPlan
    local: LocalCache
    descriptor: Descriptor  # the owner's cache
    cache_id: int  # its id on the owner
    pending: Any = None  # what :meth:`DataPlane.expect` set up
    job: Any = None  # the plane's running job (a TCP push's send job, for :meth:`DataPlane.cut_short`)
    owner_copies: bool = False  # a push the owner copied itself before its BEGIN reply: nothing to move here


class DataPlane:
    """The data plane of one link.  Subclasses override what their mechanism does; the defaults describe a plane
    that moves nothing one-sided, needs nothing before ``BEGIN`` and serves nothing itself on the owner side."""

    kind: ClassVar[Plane]
    confirms_push: ClassVar[bool] = False  # a push ends with END(confirm): the owner answers once every byte landed
    serves_whole: ClassVar[bool] = False  # a job :meth:`serve` returns moves every byte (the requester, none)

    def __init__(self, peer: int, name: str, caps: PeerCapabilities, on_untrusted: OnUntrusted) -> None:
        self.peer = peer  # the remote cluster id
        self.name = name
        self.caps = caps
        self._on_untrusted = on_untrusted
        self._jobs: dict[int, Any] = {}  # requester side: this plane's running transfers, by transfer id
        self.closed: LLMException | None = None

    def adopt_announced(self, directory: SegmentIdentity | None, enabled: bool,
                        segments: Sequence[tuple[SegmentIdentity, int]]) -> list[asyncio.Task[Any]]:
        """What the peer announced at link time (its cache directory, ``enabled`` by ``llm.Directory``, and its
        shared segments), for a plane that reaches its memory directly; returns tasks worth waiting for."""
        return []

    # -- requester side --------------------------------------------------------------------------------------
    def check_local(self, local: LocalCache, cluster_id: int) -> None:
        """Raise if this plane cannot move ``local`` (e.g. a device cache over TCP)."""

    @property
    def device_path(self) -> str:
        """How this link moves device caches: ``"device-direct"`` (the peer's device memory opened through IPC),
        ``"device-staged"`` (through page-locked host memory, over TCP), ``"nixl"``, or ``"refused"``."""
        return "refused"

    def staging(self) -> dict[str, Any] | None:
        """The link's staging rings and what moved through them (``links()``), or None without one."""
        return None

    def path_of(self, on_device: bool) -> str:
        """What the statistics call a transfer of this plane: its kind, and for a device cache the device path
        (``"tcp/device-staged"``, ``"shm/device-direct"``; ``"nixl"`` either way)."""
        path = self.device_path
        return f"{self.kind}/{path}" if on_device and path not in (self.kind, "refused") else self.kind

    def route(self, resolved: Resolved, descriptor: Descriptor | None, pull: bool, local: LocalCache) -> Route:
        """How a transfer between ``local`` and ``resolved`` (a cache the owner published before) goes."""
        return Route.OWNER

    def remembers(self, model_id: int) -> bool:
        """Whether a publication the owner reports is worth remembering (this plane can use it one-sided)."""
        return False

    async def move_published(self, transfer: Transfer, resolved: Resolved) -> bool:
        """Move a transfer on a published cache without the owner's event loop; False: the cache is no longer
        the one resolved and nothing was moved (ask the owner again).  A cache released meanwhile raises
        ``LLM_KV_CACHE_NOT_EXIST``."""
        raise NotImplementedError

    def moved_published_now(self, transfer: Transfer, resolved: Resolved) -> bool:
        """:meth:`move_published` done on this thread, at once, for a transfer small enough (no task switch, no
        worker woken); False: nothing was done, await :meth:`move_published`."""
        return False

    def prefers_owner(self, transfer: Transfer) -> bool:
        """Whether a transfer on a published cache goes through the owner after all (the owner copies it faster
        than this side can)."""
        return False

    def source_for_owner(self, local: LocalCache, params: TransferParams) -> OfferedSource | None:
        """The source tensors ``BEGIN`` offers the owner to copy a push from itself (``Begin.src``), or None."""
        return None

    def begun(self, transfer: Transfer) -> None:
        """The owner's ``BEGIN`` reply is in (``transfer.owner_copies`` says whether it copied the push)."""

    def expect(self, tid: int, pull: bool) -> Any:
        """What must exist before ``BEGIN`` goes out (the owner may start sending as soon as it accepts)."""
        return None

    async def move(self, transfer: Transfer) -> None:
        """Move the bytes of a transfer the owner began (the caller holds a lease on the local cache)."""
        raise NotImplementedError

    async def discard(self, transfer_or_pending: Any) -> None:
        """``BEGIN`` failed or the transfer was cancelled: drop what :meth:`expect` set up."""

    def needs_fence(self, transfer: Transfer) -> bool:
        """A push cut short whose bytes may still sit in the owner's socket buffers."""
        return False

    async def cut_short(self, transfer: Transfer) -> bool:
        """Return once the owner's data path confirmed that nothing of a cut-short push is written any more;
        False: this plane cannot confirm it, the owner must (END over the control channel)."""
        return False

    def abort(self, tid: int, error: LLMException) -> bool:
        """The owner released the cache of running transfer ``tid``: stop it; False if it is not running here."""
        job = self._jobs.get(tid)
        if job is None:
            return False
        self._cancel(job, error)
        return True

    def _cancel(self, job: Any, error: LLMException) -> None:
        """Stop one of :attr:`_jobs` (its waiter gets ``error``)."""

    async def _wait_stopped(self, job: Any) -> None:
        """Return once no thread touches a job stopped by :meth:`_cancel`."""

    async def _stop_jobs(self, error: LLMException) -> None:
        jobs = list(self._jobs.values())
        for job in jobs:
            self._cancel(job, error)
        for job in jobs:
            await self._wait_stopped(job)

    def freed(self, message: Freed) -> None:
        """The peer freed a cache: let go of what reaches it here (once idle)."""

    # -- owner side ------------------------------------------------------------------------------------------
    def refusal(self, cache_id: int, on_device: bool) -> LLMException | None:
        """Why this plane cannot serve that cache to the peer, or None."""
        return None

    def serve(self, tid: int, pull: bool, plan: CopyPlan, cache: ServedCache, source: OfferedSource | None) -> Any:
        """Start this side's end of a transfer the peer began on the owner's ``cache`` (``source``: the
        requester's tensors ``BEGIN`` offered for a push); returns its job, or None when the requester moves the
        bytes itself."""
        return None

    async def finish_served(self, job: Any, complete: bool) -> None:
        """Wait for a served job to move every byte (``complete``) or stop it; returns once no thread touches
        the cache."""

    def cancel_served(self, job: Any) -> None:
        """Stop a served job (the cache is being released)."""

    def served_done(self, job: Any) -> bool:
        """Whether a served job has ended."""
        return True

    def publishes(self, tcp_readable: bool) -> bool:
        """Whether the requester may go one-sided on a published cache (``tcp_readable``: its directory row
        names its memory, so that the owner's I/O threads can check a one-sided TCP transfer's spans)."""
        return True

    def reach(self, entry: Any) -> NixlReach | None:
        """Extra reach a descriptor carries for this plane's requester (NIXL's agent metadata)."""
        return None

    def tells_freed(self, cache_id: int, mapped: bool) -> bool:
        """Whether the peer must hear that a cache was freed (it maps or described it)."""
        return mapped and self.caps.same_host

    # -- lifetime and diagnostics ----------------------------------------------------------------------------
    def moving(self) -> int:
        """How many of this side's transfers the plane is moving now (diagnostics and tests)."""
        return len(self._jobs)

    def idle(self) -> bool:
        """No transfer of the link runs on this plane, from either side (diagnostics and tests)."""
        return not self._jobs

    @property
    def connections(self) -> int:
        """Data connections (TCP planes)."""
        return 0

    @property
    def congestion(self) -> str | None:
        """The data connections' TCP congestion control (TCP planes; ``AIODATADIST_TCP_CONGESTION``), else None."""
        return None

    def served_one_sided(self) -> OneSided | None:
        """The one-sided reads and writes this link's I/O threads served (the native TCP plane), or None."""
        return None

    async def untrusted(self, error: LLMException) -> None:
        """Drop the link (e.g. its peer did not confirm that a cut-short push stopped)."""
        await self._on_untrusted(error)

    async def stop(self, error: LLMException) -> None:
        """Stop every transfer of the link: returns once no thread of this plane touches memory."""
        if self.closed is None:
            self.closed = error

    async def close(self) -> None:
        """Let go of what reaches the peer (mappings, descriptors), after :meth:`stop`."""
