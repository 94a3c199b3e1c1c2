"""``CopyEngine``: the copy jobs of one instance, on the host executor or on its device, behind one job table.

Local copies (``copy_cache``, ``swap_blocks``, ...), the requester side of pulls and pushes and the copies a
same-host plane makes for its owner all start here, so that ``finalize`` can stop every copy of the instance and
the device is set up once, on first use.  The engine knows caches only by what it touches of them
(:class:`CopiedCache`: the registry's entries are one).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Protocol, cast

import numpy as np
import numpy.typing as npt

from ..errors import LLMException, LLMNotInitializedError, LLMStatusCode
from ..jobs.base import ExecutorBase, wait_stopped
from ..layout.plans import CopyPlan
from ..native import CopySpec
from .device import DeviceSupport, merged_ranges
from .device_runtime import DeviceExecutor
from .python_pool import CopyJob
from .spans import copier_for_local

__all__ = ["CopyEngine"]

log = logging.getLogger("aiodatadist.cache")
UInt64Array = npt.NDArray[np.uint64]


class _Sized(Protocol):
    @property
    def size(self) -> int: ...


class _Span(Protocol):
    @property
    def address(self) -> int: ...

    @property
    def size(self) -> int: ...


class CopiedCache(Protocol):
    """What the engine reads and keeps on a cache whose memory a job touches."""

    addrs: UInt64Array
    device_addrs: UInt64Array | None  # host memory page-locked for device copies: its device view
    on_free: list[Callable[[], None]]  # run before the memory goes (unpin, ...)
    jobs: set[CopyJob]  # the jobs touching it (its release waits for them or stops them)

    @property
    def on_device(self) -> bool: ...

    @property
    def desc(self) -> _Sized: ...

    @property
    def segment(self) -> _Span | None: ...


class CopyEngine:
    """Starts, awaits and stops the copies of one instance (``device_id``: its device for DEVICE caches)."""

    def __init__(self, executor: ExecutorBase, device_id: int) -> None:
        self._executor = executor
        self._device_id = device_id
        self._device: DeviceSupport | None = None
        self._jobs: dict[CopyJob, ExecutorBase | DeviceExecutor] = {}  # running jobs and who runs them
        self._closed = False

    @property
    def executor(self) -> ExecutorBase:
        return self._executor

    def device(self) -> DeviceSupport:
        """This instance's device, set up on first use; raises ``LLM_FEATURE_NOT_ENABLED`` saying why when no
        device runtime can be used."""
        if self._device is None:
            self._device = DeviceSupport(self._device_id)
        return self._device

    def device_addrs(self, entry: CopiedCache) -> UInt64Array:
        """The tensors' addresses as the device sees them: device memory as is, host memory page-locked (once per
        cache, until it is freed)."""
        if entry.on_device:
            return entry.addrs
        if entry.device_addrs is None:
            device = self.device()
            if entry.segment is not None:
                spans = [(entry.segment.address, entry.segment.size)]
            else:
                spans = merged_ranges(entry.addrs, entry.desc.size)
            deltas = []
            for addr, size in spans:
                deltas.append(device.pin(addr, size))
                entry.on_free.append(functools.partial(device.unpin, addr, size))
            starts = np.array([a for a, _ in spans], dtype=np.uint64)
            which = np.searchsorted(starts, entry.addrs, side="right") - 1
            entry.device_addrs = entry.addrs + np.array(deltas, dtype=np.uint64)[which]
        return entry.device_addrs

    def copy_now(self, plan: CopyPlan, src_addrs: UInt64Array, dst_addrs: UInt64Array,
                 copier: CopySpec | None) -> bool:
        """Copy a small host plan on this thread (:func:`~aiodatadist.copy.spans.copy_grid_now`); False, having
        copied nothing, when it is not small enough (start a job instead)."""
        if self._closed:
            raise LLMNotInitializedError()
        return self._executor.copy_now(plan, src_addrs, dst_addrs, copier or copier_for_local(plan.total_bytes))

    def start_job(self, plan: CopyPlan, src_addrs: UInt64Array, dst_addrs: UInt64Array, copier: CopySpec | None,
                  entries: tuple[CopiedCache, ...], *, on_device: bool = False) -> CopyJob:
        """Queue the copy of ``plan`` from tensors at ``src_addrs`` to ``dst_addrs``, touching ``entries``
        (callers hold leases on them); ``copier`` None = both ends in this process.  ``on_device``: the device
        copies (addresses as :meth:`device_addrs` gives them)."""
        if self._closed:
            raise LLMNotInitializedError()
        executor: ExecutorBase | DeviceExecutor
        job: CopyJob
        if on_device:  # the device copies: no host copier
            executor = device = self.device().executor
            job = cast("CopyJob", device.start_plan(plan, src_addrs, dst_addrs))  # (a job of any executor)
        else:
            executor = self._executor
            job = executor.start_plan(plan, src_addrs, dst_addrs, copier or copier_for_local(plan.total_bytes))
        self._jobs[job] = executor
        for entry in entries:
            entry.jobs.add(job)
        return job

    async def wait_job(self, job: CopyJob, entries: tuple[CopiedCache, ...]) -> None:
        """Await a job; cancelling the caller stops it and returns only once its workers are done."""
        try:
            await self._jobs.get(job, self._executor).wait(job)
        finally:
            self._jobs.pop(job, None)
            for entry in entries:
                entry.jobs.discard(job)

    async def wait_stopped(self, job: CopyJob) -> None:
        """Wait (through cancellations) until no worker touches the job's memory."""
        await wait_stopped(job)

    def cancel_job(self, job: CopyJob, error: BaseException | None = None) -> None:
        """Stop a job at its next chunk (a device copy cannot be stopped: its waiter waits for it)."""
        self._jobs.get(job, self._executor).cancel(job, error)

    def abort_jobs(self, jobs: list[CopyJob], reason: str) -> None:
        """Stop jobs that use caller-owned memory being released; waits at most one chunk per job."""
        for job in jobs:
            self.cancel_job(job, LLMException(reason, status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST))
        for job in jobs:
            if not job.wait_stopped_sync(5.0):
                log.error("a copy on released memory did not stop within 5 s; the memory may still be written")

    async def close(self) -> None:
        """Stop every running copy (no new one may start) and let go of the device."""
        if self._closed:
            return
        self._closed = True
        error = LLMException("LLMDataDist was finalized during the transfer", status_code=LLMStatusCode.LLM_FAILED)
        for job in list(self._jobs):
            self.cancel_job(job, error)
        for job in list(self._jobs):
            await wait_stopped(job)

    def close_device(self) -> None:
        """Let go of the device (after the caches that used it are freed)."""
        if self._device is not None:
            self._device.close()
