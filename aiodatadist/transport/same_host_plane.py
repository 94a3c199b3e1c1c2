"""The same-host data plane: the requester copies between its cache and the peer's memory itself.

The peer's memory is reached through :class:`~aiodatadist.transport.same_host.PeerMemory`, per cache: its shared
segment mapped here (``map``, or handed over with ``fds``), or ``process_vm_readv``/``writev`` (``pvm``) for
caller-registered memory outside any segment.  Device caches, on either side, are copied by this process's GPU
(CUDA IPC for the peer's device memory, its host segment page-locked otherwise): one link moves host caches on
the copy threads and device caches on the GPU, so the mechanism is chosen per transfer, inside this one plane.
With the peer's cache directory mapped (``llm.Directory``), a transfer on a cache the owner published before
skips the round trip: the directory says whether it is still live, before and after the copy.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._arrays import UInt64Array
from .._checks import U64_LIMIT
from ..copy.device import LinkDeviceState
from ..copy.python_pool import CopyJob
from ..copy.spans import INLINE_BYTES, STREAMING_THRESHOLD
from ..errors import LLMException, LLMLinkError, LLMStatusCode
from ..layout.plans import CacheGeometry, CopyPlan, TransferParams
from ..native import CopySpec, pvm_copier
from ..protocol.identity import SegmentIdentity
from ..protocol.messages import Descriptor, Freed, IpcAllocation
from .directory import DirectoryView, Resolved
from .plane import (
    Copies,
    DataPlane,
    LocalCache,
    OfferedSource,
    OnUntrusted,
    Route,
    ServedCache,
    Transfer,
)
from .same_host import PeerCapabilities, PeerMemory

__all__ = ["OWNER_COPY_SPANS", "SameHostPlane"]

log = logging.getLogger("aiodatadist.transport.same_host")

S = LLMStatusCode
OWNER_COPY_SPANS = 1536
"""Spans of a push into memory the owner does not share in place from which the owner copies it itself, reading
the requester's memory (covering reads: a few page pins for a tensor's close spans) instead of the requester
writing it with ``process_vm_writev``, which pins a page per span (about 0.7 us each).  The owner's copy costs a
control round trip through its event loop, a few hundred microseconds: more than the pins of a thousand spans
(the crossover measured on a 2-vCPU VM: between 1024 and 2048)."""


class _Served(NamedTuple):
    """A push the owner copies itself: its copy job, the owner's cache it writes, and the mapping of the
    requester's segment it reads (held until the job ended), if it reads one."""

    job: CopyJob
    cache: ServedCache
    held: tuple[int, int] | None

    @property
    def error(self) -> BaseException | None:
        return self.job.error


class SameHostPlane(DataPlane):
    """A link to a process on this host: copies by this side's threads or GPU, no data connection."""

    kind = "shm"
    serves_whole = True

    def __init__(self, peer: int, name: str, caps: PeerCapabilities, on_untrusted: OnUntrusted, copies: Copies,
                 fd_token: bytes | None) -> None:
        super().__init__(peer, name, caps, on_untrusted)
        self._copies = copies
        self.memory = PeerMemory(caps)
        self.memory.fd_token = fd_token  # what the peer's fd socket asks of this side
        self.directory: DirectoryView | None = None  # the peer's cache directory, when mappable
        self._device: LinkDeviceState | None = None  # the peer's memory as this GPU reaches it
        self.owner_reads: bool | None = None  # whether the peer copies large pushes into its unshared memory
        self._served: set[_Served] = set()  # owner side: pushes this side copies itself

    def adopt_announced(self, directory: SegmentIdentity | None, enabled: bool,
                        segments: Sequence[tuple[SegmentIdentity, int]]) -> list[asyncio.Task[Any]]:
        """Map the peer's cache directory (not with handed-over segments) and its caches; returns the page-table
        population tasks."""
        if enabled and self.caps.can_map and not self.caps.fds:
            self.directory = DirectoryView.from_wire(directory, self.caps.pid)
        return self.memory.premap(segments)

    # -- requester side --------------------------------------------------------------------------------------
    @property
    def device_path(self) -> str:
        return "device-direct"

    def route(self, resolved: Resolved, descriptor: Descriptor | None, pull: bool, local: LocalCache) -> Route:
        if self.directory is None or descriptor is None:
            return Route.OWNER
        if not self.directory.live(resolved.row, resolved.stamp, resolved.cache_id, resolved.model_id):
            return Route.STALE  # released or re-keyed: ask the owner again
        return Route.ONE_SIDED  # into caller-owned memory too: unregistering it WITHDRAWs the write first

    def remembers(self, model_id: int) -> bool:
        return self.directory is not None

    def prefers_owner(self, transfer: Transfer) -> bool:
        return self.owner_reads is not False and self._owner_would_copy(transfer)  # (None: ask it)

    def source_for_owner(self, local: LocalCache, params: TransferParams) -> OfferedSource | None:
        # Only where the owner may copy it: a push of at least OWNER_COPY_SPANS spans if no two of its source
        # blocks' runs merge (runs of consecutive blocks are one span each at most).
        if params.op == "pull" or local.on_device or self.owner_reads is False:
            return None
        tensors, blocks = local.geometry.num_tensors, params.src_blocks
        if max(1, len(blocks)) * tensors < OWNER_COPY_SPANS:
            return None
        if _source_runs(blocks) * tensors < OWNER_COPY_SPANS:
            return None
        shared = local.shared_segment
        segment = (shared.identity, shared.address) if shared is not None and local.shared_window is None else None
        return OfferedSource(local.addrs, segment)

    def begun(self, transfer: Transfer) -> None:
        if self._owner_would_copy(transfer):  # (it did if it can read this process)
            self.owner_reads = transfer.owner_copies

    def _owner_would_copy(self, transfer: Transfer) -> bool:
        """Whether ``transfer`` is a push the owner copies itself if it can read this process (see
        :data:`OWNER_COPY_SPANS`)."""
        return (not transfer.pull and not transfer.local.on_device and transfer.descriptor.ipc is None
                and transfer.plan.num_spans >= OWNER_COPY_SPANS and self._host_segment(transfer) is None)

    async def move_published(self, transfer: Transfer, resolved: Resolved) -> bool:
        failure: LLMLinkError | None = None
        try:
            await self.move(transfer)
        except LLMLinkError as exc:  # process_vm_readv of caller memory the owner released meanwhile: EFAULT
            failure = exc
        self._check_published(resolved, failure)
        return True

    def moved_published_now(self, transfer: Transfer, resolved: Resolved) -> bool:
        if not self._small_host(transfer):
            return False
        failure: LLMLinkError | None = None
        try:
            if not self._copied_now(transfer, self._host_segment(transfer)):
                return False
        except LLMLinkError as exc:
            failure = exc
        self._check_published(resolved, failure)
        return True

    def _check_published(self, resolved: Resolved, failure: LLMLinkError | None) -> None:
        """After a copy of a published cache: raise if the owner released it meanwhile (the bytes are then
        unspecified), or ``failure`` (how the copy failed) if it did not."""
        directory = self.directory
        assert directory is not None
        if self.closed is not None:  # dropped meanwhile: its directory view reads as empty, which says nothing
            raise failure or LLMLinkError(f"the link to cluster {self.peer} was dropped during the "
                                          "transfer")
        live = directory.live(resolved.row, resolved.stamp, resolved.cache_id, None)
        if failure is not None and live:
            raise failure
        if not live or failure is not None:
            raise LLMException(f"cluster {self.peer} released cache {resolved.cache_id} during the transfer",
                               status_code=S.LLM_KV_CACHE_NOT_EXIST)

    def _host_segment(self, transfer: Transfer) -> tuple[SegmentIdentity, int] | None:
        """The peer's shared segment that holds the bytes ``transfer`` touches there; None: they are reached
        the unshared way (``process_vm_*``)."""
        descriptor, segment = transfer.descriptor, transfer.descriptor.segment
        if segment is not None and descriptor.window is not None and not _inside(transfer.plan, descriptor.window,
                                                                              transfer.pull):
            return None  # bytes outside what the peer shares in place
        return segment

    @staticmethod
    def _small_host(transfer: Transfer) -> bool:
        """Whether ``transfer`` is between host memory at both ends and small enough for :meth:`_copied_now`."""
        return (not transfer.local.on_device and transfer.descriptor.ipc is None
                and transfer.plan.total_bytes <= INLINE_BYTES)

    def _copied_now(self, transfer: Transfer, segment: tuple[SegmentIdentity, int] | None) -> bool:
        """Copy a :meth:`_small_host` transfer on this thread; False, having copied nothing, when its segment is not
        handed over yet or the copier cannot take it."""
        local, pull = transfer.local, transfer.pull
        if segment is not None and not self.memory.handed_over(segment[0]):
            return False
        copy = self.memory.copier(remote_is_src=pull, segment=segment, streaming=False)
        remote = transfer.descriptor.addrs
        src, dst = (remote, local.addrs) if pull else (local.addrs, remote)
        try:
            return self._copies.copy_now(transfer.plan, src, dst, copy)
        except OSError as exc:
            if isinstance(exc, LLMException):
                raise
            raise _copy_failed(self.peer, exc) from exc

    async def move(self, transfer: Transfer) -> None:
        """Copy the bytes (the caller holds a lease on the local cache); closing the link cancels the copy."""
        descriptor, local, plan, pull = transfer.descriptor, transfer.local, transfer.plan, transfer.pull
        segment = self._host_segment(transfer)
        if segment is not None and self.caps.fds:  # a peer under another user hands its segments over (once)
            try:
                await self.memory.ensure(segment[0])
            except OSError as exc:
                raise LLMLinkError(f"cluster {self.peer} did not hand over its cache: {exc}") from exc
        if self._small_host(transfer) and self._copied_now(transfer, segment):
            return
        ipc = list(descriptor.ipc) if descriptor.ipc is not None else None
        # The peer may free this cache meanwhile (FREED): its mapping here stays until the copy is done.
        held = self.memory.hold(segment[0]) if segment is not None else None
        device = None
        copies = self._copies
        try:
            if ipc is not None:
                device = self._link_device()
                device.hold(ipc)
            if local.on_device or ipc is not None:  # the GPU copies (see aiodatadist.copy.device)
                remote = self._device_view(descriptor.geometry, descriptor.addrs, segment, ipc)
                mine = copies.device_addrs(local)
                src, dst = (remote, mine) if pull else (mine, remote)
                job = copies.start_job(plan, src, dst, None, (local,), on_device=True)
            else:
                copy = self.memory.copier(remote_is_src=pull, segment=segment,
                                          streaming=plan.total_bytes >= STREAMING_THRESHOLD)
                src, dst = (descriptor.addrs, local.addrs) if pull else (local.addrs, descriptor.addrs)
                job = copies.start_job(plan, src, dst, copy, (local,))
            self._jobs[transfer.tid] = job
            try:
                await copies.wait_job(job, (local,))
            finally:
                self._jobs.pop(transfer.tid, None)
        except OSError as exc:
            if isinstance(exc, LLMException):  # LLMTimeoutError / LLMLinkError are OSErrors too
                raise
            raise _copy_failed(self.peer, exc) from exc
        finally:
            if held is not None:
                self.memory.release(held)
            if device is not None and ipc is not None:
                device.release(ipc)

    def _cancel(self, job: Any, error: LLMException) -> None:
        self._copies.cancel_job(job, error)

    # -- owner side ------------------------------------------------------------------------------------------
    def serve(self, tid: int, pull: bool, plan: CopyPlan, cache: ServedCache, source: OfferedSource | None) -> Any:
        """A large push into memory this side does not share in place, whose requester offered its source: copied
        here, from the requester's segment mapped here where it offered one, else reading its memory
        (``process_vm_readv`` with covering reads); None: the requester copies (see :data:`OWNER_COPY_SPANS`)."""
        if (pull or source is None or not self.caps.can_pvm or cache.on_device or self.closed is not None
                or plan.num_spans < OWNER_COPY_SPANS or _shared_in_place(plan, cache)):
            return None
        copier, held = self._source_copier(source, plan)
        try:
            job = self._copies.start_job(plan, source.addrs, cache.addrs, copier, (cache,))
        except BaseException:
            if held is not None:
                self.memory.release(held)
            raise
        served = _Served(job, cache, held)
        self._served.add(served)
        return served

    def _source_copier(self, source: OfferedSource, plan: CopyPlan) -> tuple[CopySpec, tuple[int, int] | None]:
        """How this side reads an offered push source: through the requester's segment, mapped here (then held:
        the second value), where every source tensor lies inside it; else with ``process_vm_readv``.  Copying from
        the mapping is a ``memcpy`` per span, where reading the requester's memory pins its pages (8192 spans of 64
        bytes: ~0.7 us a page, covering reads included)."""
        segment = source.segment
        if (segment is not None and segment[0].pid == self.caps.pid and self.caps.can_map
                and self.memory.handed_over(segment[0])
                and _reads_inside(source.addrs, plan, segment)):
            try:
                copier = self.memory.copier(remote_is_src=True, segment=segment,
                                            streaming=plan.total_bytes >= STREAMING_THRESHOLD)
            except (OSError, ValueError, LLMException) as exc:  # not mappable here: read it the unshared way
                log.debug("cannot map the segment of cluster %s's push source: %s", self.peer, exc)
            else:
                return copier, self.memory.hold(segment[0])
        return pvm_copier(self.caps.pid, remote_is_src=True), None

    async def finish_served(self, job: Any, complete: bool) -> None:
        served: _Served = job
        if not complete:
            self._copies.cancel_job(served.job, LLMException("the requester stopped the push",
                                                             status_code=S.LLM_FAILED))
        try:
            await self._copies.wait_job(served.job, (served.cache,))
        except (OSError, LLMException) as exc:
            if not complete:
                return  # stopped: no thread writes the cache any more
            if isinstance(exc, LLMException):
                raise
            raise _copy_failed(self.peer, exc) from exc
        finally:
            if served in self._served:
                self._served.discard(served)
                if served.held is not None:
                    self.memory.release(served.held)

    def cancel_served(self, job: Any) -> None:
        self._copies.cancel_job(job.job, LLMException("the cache was released during the transfer",
                                                      status_code=S.LLM_KV_CACHE_NOT_EXIST))

    def served_done(self, job: Any) -> bool:
        return job not in self._served  # settled by finish_served (which also drops the engine's bookkeeping)

    async def _wait_stopped(self, job: Any) -> None:
        await self._copies.wait_stopped(job)

    def freed(self, message: Freed) -> None:
        device = self._device
        if message.seg is not None:
            self.memory.forget(message.seg, device.forget_pinned if device is not None else lambda _: None)
        if device is not None:
            for handle in message.ipc:
                device.forget_handle(handle)

    def _link_device(self) -> LinkDeviceState:
        if self._device is None:
            self._device = LinkDeviceState(self._copies.device(), self.caps.pid == os.getpid())
        return self._device

    def _device_view(self, geometry: CacheGeometry, remote_addrs: UInt64Array,
                     segment: tuple[SegmentIdentity, int] | None, ipc: list[IpcAllocation] | None) -> UInt64Array:
        """The peer's tensors as this process's GPU reaches them: its device memory through IPC, its host
        cache through the mapped segment, page-locked."""
        device = self._link_device()
        if ipc is not None:
            return device.remote_delta(ipc, remote_addrs, geometry.tensor_size)
        if segment is None or not self.caps.can_map:
            raise LLMException(f"a GPU copy needs the host cache of cluster {self.peer} mapped in this process: "
                               "allocate it with allocate_cache/allocate_blocks_cache (caller-registered host "
                               "memory is reachable only by process_vm_readv/writev)",
                               status_code=S.LLM_FEATURE_NOT_ENABLED)
        identity, remote_base = segment
        local_base = self.memory.local_base(identity)
        delta = device.pinned_delta(local_base, identity.size)
        return remote_addrs + np.uint64((local_base - remote_base + delta) % U64_LIMIT)

    # -- lifetime --------------------------------------------------------------------------------------------
    async def stop(self, error: LLMException) -> None:
        await super().stop(error)
        await self._stop_jobs(error)
        served = list(self._served)
        for one in served:
            self._copies.cancel_job(one.job, error)
        for one in served:
            await self.finish_served(one, False)

    async def close(self) -> None:
        if self._device is not None:  # no GPU copy uses the peer's memory any more
            self._device.close()
            self._device = None
        try:
            await self.memory.close()
        finally:
            if self.directory is not None:
                self.directory.close()


def _copy_failed(peer: int, exc: OSError) -> LLMLinkError:
    """A copy that failed in the system (e.g. ``EFAULT``: the peer's memory is gone), as the transfer raises it."""
    return LLMLinkError(f"copy with cluster {peer} failed: {exc}")


def _shared_in_place(plan: CopyPlan, cache: ServedCache) -> bool:
    """Whether every byte a push of ``plan`` writes in the owner's ``cache`` lies in memory it shares in place."""
    if cache.shared_segment is None:
        return False
    window = cache.shared_window
    return window is None or _inside(plan, window, False)


def _reads_inside(addrs: UInt64Array, plan: CopyPlan, segment: tuple[SegmentIdentity, int]) -> bool:
    """Whether every byte ``plan`` reads from the tensors at ``addrs`` lies inside ``segment`` (its identity and
    base address in the process those addresses are of)."""
    touched = _touched(plan, True)
    if touched is None or len(plan.src_tensor) == 0:
        return True
    (identity, base), (low, high) = segment, touched
    used = addrs[plan.src_tensor]
    return base <= int(used.min()) + low and int(used.max()) + high <= base + identity.size


def _source_runs(blocks: Sequence[int]) -> int:
    """Runs of consecutive blocks in ``blocks`` (at least 1).  A plain loop: numpy's conversion of a short list
    costs more than the whole count (128 blocks: 4.5 against 2.7 us alone, 29 us within a call)."""
    runs, previous = 1, None
    for block in blocks:
        if previous is not None and block != previous + 1:
            runs += 1
        previous = block
    return runs


def _inside(plan: CopyPlan, window: tuple[int, int], pull: bool) -> bool:
    """Whether every byte ``plan`` touches in the peer's tensors lies in their ``window``."""
    touched = _touched(plan, pull)
    return touched is None or (window[0] <= touched[0] and touched[1] <= window[1])


def _touched(plan: CopyPlan, source: bool) -> tuple[int, int] | None:
    """The bytes ``[low, high)`` of each tensor that ``plan`` reads (``source``) or writes; None: no run."""
    runs = plan.runs
    offsets = runs.src_offset if source else runs.dst_offset
    if len(offsets) == 0:
        return None
    return int(offsets.min()), int((offsets + runs.length).max())
