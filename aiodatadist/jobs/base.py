"""What every copy executor shares: chunk sizing, awaiting a job through cancellations, how a job ends on the
event loop, and how many threads the pools start.

The executors (:class:`~aiodatadist.copy.python_pool.CopyExecutor`,
:class:`~aiodatadist.copy.native_pool.NativeExecutor`, :class:`~aiodatadist.cuda.executor.CudaExecutor`) derive
from :class:`ExecutorBase`; their jobs follow :class:`ExecutorJob`.  Neither pool imports the other: the factory
and the process-wide executor are in :mod:`aiodatadist.copy`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from .._aio import settle, wait_through_cancellation
from .._arrays import UInt64Array
from ..layout.plans import CopyPlan, Spans, plan_to_spans
from ..native import CopySpec
from ..settings.environment import env_knobs
from .chunks import MAX_CHUNK, MIN_CHUNK, SINGLE_CHUNK, SMALL

__all__ = [
    "ExecutorBase",
    "ExecutorJob",
    "default_workers",
    "resolve_job",
    "wait_stopped",
    "worker_nice",
    "worker_spin_ns",
]



def worker_nice() -> int:
    """How much lower the native copy threads' priority is than the process's: ``AIODATADIST_COPY_NICE``
    (0-19, default 10), so that bulk copies never starve the event loop where they occupy every core."""
    return env_knobs().copy_nice


def worker_spin_ns() -> int:
    """How long one idle native copy thread spins for new work before sleeping: ``AIODATADIST_COPY_SPIN_US``
    (microseconds, 0 = never; default 200).  A job that arrives meanwhile starts without a wake-up, which on a VM
    takes tens of microseconds from the submitting event loop."""
    return env_knobs().copy_spin_us * 1000


def default_workers() -> int:
    """Copy threads: ``AIODATADIST_COPY_THREADS`` (1-64) if set, else one per CPU this process may run on
    (its affinity; 2 to 8)."""
    return env_knobs().copy_threads


class _Stopped(Protocol):
    def is_set(self) -> bool: ...


class ExecutorJob(Protocol):
    """A job of any executor: ``future`` settles (and ``stopped`` is set) once no worker touches its memory."""

    future: asyncio.Future[None]
    stop_waiter: asyncio.Future[None] | None  # created by wait_stopped when it has to wait
    error: BaseException | None

    @property
    def stopped(self) -> _Stopped: ...


def resolve_job(job: ExecutorJob) -> None:
    """On the event loop, once no worker touches ``job`` any more: settle its future and wake ``wait_stopped``."""
    settle(job.future, job.error)
    if job.stop_waiter is not None:
        settle(job.stop_waiter)


async def wait_stopped(job: ExecutorJob) -> None:
    """Wait (through further cancellations) until no worker touches ``job``'s memory any more.

    The job's own future may have been cancelled with its waiter, so this waits on ``stop_waiter``, which
    :func:`resolve_job` settles.
    """
    try:
        if not job.stopped.is_set():
            if job.stop_waiter is None:
                job.stop_waiter = asyncio.get_running_loop().create_future()
            await wait_through_cancellation(job.stop_waiter)
    finally:
        if job.future.done() and not job.future.cancelled():
            job.future.exception()  # mark retrieved


class ExecutorBase:
    """What both executors share: chunk sizing, awaiting a job, and ``run`` = ``start`` + ``wait``.

    Subclasses provide ``workers``, ``start(spans, copier, chunk_bytes=...)`` and ``cancel(job, error=None)``.
    """

    workers: int

    def chunk_bytes_for(self, total: int) -> int:
        """Bytes per chunk (what a worker takes at once) of a job of ``total`` bytes: one chunk up to
        :data:`~aiodatadist.jobs.chunks.SINGLE_CHUNK`, one per worker up to :data:`~aiodatadist.jobs.chunks.SMALL`,
        and 4-16 MiB beyond."""
        if total <= SINGLE_CHUNK:
            return max(total, 1)
        if total <= SMALL:
            return -(-total // self.workers)
        return int(min(MAX_CHUNK, max(MIN_CHUNK, total // (2 * self.workers))))

    def start(self, spans: Spans, copier: CopySpec, *, chunk_bytes: int | None = None) -> Any:
        raise NotImplementedError

    def copy_now(self, plan: CopyPlan, src_addrs: UInt64Array, dst_addrs: UInt64Array, copier: CopySpec) -> bool:
        """Copy a small plan on the calling thread instead of queueing a job; False (nothing copied): queue it.
        Only the native pool does (:func:`~aiodatadist.copy.spans.copy_grid_now`)."""
        return False

    def start_plan(self, plan: CopyPlan, src_addrs: UInt64Array, dst_addrs: UInt64Array, copier: CopySpec, *,
                   chunk_bytes: int | None = None) -> Any:
        """Queue the copy of a plan between two caches' tensors (``copier`` translates and streams)."""
        return self.start(plan_to_spans(plan, src_addrs, dst_addrs), copier, chunk_bytes=chunk_bytes)

    def cancel(self, job: Any, error: BaseException | None = None) -> None:
        raise NotImplementedError

    async def run(self, spans: Spans, copier: CopySpec, *, chunk_bytes: int | None = None) -> None:
        """Copy ``spans`` with ``copier``; on cancellation stop early and return only once no worker runs.

        After a cancellation the destination holds an unspecified mix of old and new bytes, but nothing is
        written into it after this coroutine has returned or raised.
        """
        await self.wait(self.start(spans, copier, chunk_bytes=chunk_bytes))

    async def wait(self, job: Any) -> None:
        """Await a job; if the caller is cancelled, stop the job and wait until its workers are done."""
        try:
            await self._ended(job)
        except asyncio.CancelledError:
            self.cancel(job)
            await wait_stopped(job)
            raise

    async def _ended(self, job: Any) -> None:
        """Return once ``job`` ended (its error raised); a cancellation of the caller cancels its future too, and
        the job ends on its own."""
        await job.future
