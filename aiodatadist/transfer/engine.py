"""``CopyEngine``: the copy jobs of one instance, on the host executor or on its GPU, behind one job table.

Local copies (``copy_cache``, ``swap_blocks``, ...) and the requester side of pulls and pushes both start their
copies here, so that ``finalize`` can stop every copy of the instance and the GPU is set up once, on first use.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, cast

import numpy as np

from ..copy.base import ExecutorBase, wait_stopped
from ..copy.python_pool import CopyJob
from ..copy.spans import copier_for_local
from ..errors import LLMException, LLMNotInitializedError, LLMStatusCode
from ..layout.plans import CopyPlan
from ..native import CopySpec
from ..registry.caches import CacheEntry
from ..transport.device import DeviceSupport, merged_ranges

__all__ = ["CopyEngine"]

log = logging.getLogger("aiodatadist.cache")


class CopyEngine:
    """Starts, awaits and stops the copies of one instance (``device_id``: its GPU for DEVICE caches)."""

    def __init__(self, executor: ExecutorBase, device_id: int) -> None:
        self._executor = executor
        self._device_id = device_id
        self._device: DeviceSupport | None = None
        self._jobs: dict[CopyJob, ExecutorBase] = {}  # running jobs and who runs them
        self._closed = False

    @property
    def executor(self) -> ExecutorBase:
        return self._executor

    def device(self) -> DeviceSupport:
        """This instance's GPU, set up on first use; raises ``LLM_FEATURE_NOT_ENABLED`` saying why when CUDA
        cannot be used."""
        if self._device is None:
            self._device = DeviceSupport(self._device_id)
        return self._device

    def device_addrs(self, entry: CacheEntry) -> np.ndarray:
        """The tensors' addresses as the GPU sees them: device memory as is, host memory page-locked (once per
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

    def copy_now(self, plan: CopyPlan, src_addrs: Any, dst_addrs: Any, copier: CopySpec | None) -> bool:
        """Copy a small host plan on this thread (:func:`~aiodatadist.copy.spans.copy_grid_now`); False, having
        copied nothing, when it is not small enough (start a job instead)."""
        if self._closed:
            raise LLMNotInitializedError()
        return self._executor.copy_now(plan, src_addrs, dst_addrs, copier or copier_for_local(plan.total_bytes))

    def start_job(self, plan: CopyPlan, src_addrs: Any, dst_addrs: Any, copier: CopySpec | None,
                  entries: tuple[CacheEntry, ...], *, on_device: bool = False) -> CopyJob:
        """Queue the copy of ``plan`` from tensors at ``src_addrs`` to ``dst_addrs``, touching ``entries``
        (callers hold leases on them); ``copier`` None = both ends in this process.  ``on_device``: the GPU
        copies (addresses as :meth:`device_addrs` gives them)."""
        if self._closed:
            raise LLMNotInitializedError()
        executor: ExecutorBase
        job: CopyJob
        if on_device:  # the GPU copies: no host copier
            executor = gpu = self.device().executor
            job = cast("CopyJob", gpu.start_plan(plan, src_addrs, dst_addrs))  # (a job of any executor)
        else:
            executor = self._executor
            job = executor.start_plan(plan, src_addrs, dst_addrs, copier or copier_for_local(plan.total_bytes))
        self._jobs[job] = executor
        for entry in entries:
            entry.jobs.add(job)
        return job

    async def wait_job(self, job: CopyJob, entries: tuple[CacheEntry, ...]) -> None:
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
        """Stop a job at its next chunk (a GPU copy cannot be stopped: its waiter waits for it)."""
        self._jobs.get(job, self._executor).cancel(job, error)

    def abort_jobs(self, jobs: list[CopyJob], reason: str) -> None:
        """Stop jobs that use caller-owned memory being released; waits at most one chunk per job."""
        for job in jobs:
            self.cancel_job(job, LLMException(reason, status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST))
        for job in jobs:
            if not job.wait_stopped_sync(5.0):
                log.error("a copy on released memory did not stop within 5 s; the memory may still be written")

    async def close(self) -> None:
        """Stop every running copy (no new one may start) and let go of the GPU."""
        if self._closed:
            return
        self._closed = True
        error = LLMException("LLMDataDist was finalized during the transfer", status_code=LLMStatusCode.LLM_FAILED)
        for job in list(self._jobs):
            self.cancel_job(job, error)
        for job in list(self._jobs):
            await wait_stopped(job)

    def close_device(self) -> None:
        """Let go of the GPU (after the caches that used it are freed)."""
        if self._device is not None:
            self._device.close()
