"""Copy executor: runs span copies in worker threads, in bounded chunks, fairly across transfers.

A transfer is a :class:`CopyJob`: its spans are cut into chunks of at most a few MiB; worker threads take chunks
round-robin across all running jobs, so concurrent transfers share bandwidth.  Cancelling a job drops its pending
chunks and waits for the chunks already running (at most one per worker), so when :meth:`CopyExecutor.run`
returns or raises, no worker touches the job's memory any more.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from ..layout import CopyPlan, Spans, plan_to_spans
from ..native import CopySpec, StopFlag, bind_runner

__all__ = ["CopyExecutor", "CopyJob", "ExecutorBase", "release_shared_executor", "shared_executor"]

UInt64Array = npt.NDArray[np.uint64]

# Spans are cut into pieces of at most PIECE bytes: native copies poll the stop flag between pieces, so a stop
# takes effect within ~0.1 ms.  Pieces are grouped into chunks (the units workers take, round-robin across
# jobs): tiny transfers are one chunk (one thread hand-off), small ones one chunk per worker (latency), big ones
# chunks of 4-16 MiB for parallelism and fairness.
PIECE = 1 << 20
SINGLE_CHUNK = 512 << 10
SMALL = 4 << 20
MIN_CHUNK = 4 << 20
MAX_CHUNK = 16 << 20


def split_spans(spans: Spans, chunk_bytes: int, piece_bytes: int | None = None) -> tuple[
        Spans, npt.NDArray[np.int64]]:
    """Split spans longer than ``piece_bytes`` (default: ``chunk_bytes``) and group them into chunks of about
    ``chunk_bytes``.

    Returns the (possibly longer) span list and the chunk boundaries (indices into it, first 0, last n).
    """
    piece = piece_bytes or chunk_bytes
    length = spans.length
    total = int(length.sum())
    if total <= chunk_bytes and (not len(length) or int(length.max()) <= piece):
        # the common small transfer: one chunk, nothing to compute
        return spans, np.array([0, len(length)] if len(length) else [0], dtype=np.int64)
    pieces = np.maximum((length + np.uint64(piece - 1)) // np.uint64(piece), np.uint64(1)).astype(np.int64)
    if int(pieces.max(initial=1)) > 1:
        owner = np.repeat(np.arange(len(length)), pieces)
        first = np.concatenate(([0], np.cumsum(pieces)[:-1]))
        k = (np.arange(len(owner)) - first[owner]).astype(np.uint64)
        off = k * np.uint64(piece)
        new_len = np.minimum(length[owner] - off, np.uint64(piece))
        spans = Spans(spans.src[owner] + off, spans.dst[owner] + off, new_len)
    ends = np.cumsum(spans.length, dtype=np.uint64)
    total = int(ends[-1]) if len(ends) else 0
    marks = np.arange(chunk_bytes, total, chunk_bytes, dtype=np.uint64)
    cuts = np.searchsorted(ends, marks, side="left") + 1
    bounds = np.unique(np.concatenate(([0], cuts, [len(spans)]))).astype(np.int64)
    return spans, bounds


def worker_nice() -> int:
    """How much lower the native copy threads' priority is than the process's: ``AIODATADIST_COPY_NICE``
    (0-19, default 10), so that bulk copies never starve the event loop where they occupy every core."""
    value = os.environ.get("AIODATADIST_COPY_NICE", "")
    return min(19, int(value)) if value.isdigit() else 10


def worker_spin_ns() -> int:
    """How long one idle native copy thread spins for new work before sleeping: ``AIODATADIST_COPY_SPIN_US``
    (microseconds, 0 = never; default 200).  A job that arrives meanwhile starts without a wake-up, which on a VM
    takes tens of microseconds from the submitting event loop."""
    value = os.environ.get("AIODATADIST_COPY_SPIN_US", "")
    return min(100_000, int(value)) * 1000 if value.isdigit() else 200_000


def default_workers() -> int:
    """Copy threads: ``AIODATADIST_COPY_THREADS`` if set, else one per core (2 to 8)."""
    value = os.environ.get("AIODATADIST_COPY_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return min(64, int(value))
    return max(2, min(8, os.cpu_count() or 2))


class CopyJob:
    """One transfer's spans and its progress; completion is signalled to the owning event loop."""

    def __init__(self, spans: Spans, copier: CopySpec, chunk_bytes: int, loop: asyncio.AbstractEventLoop) -> None:
        self.spans, bounds = split_spans(spans, chunk_bytes, min(PIECE, chunk_bytes))
        self.stop_flag = StopFlag()
        self._pending: deque[tuple[int, int]] = deque(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
        self._run = bind_runner(copier, self.spans)
        self._loop = loop
        self.future: asyncio.Future[None] = loop.create_future()
        self.stop_waiter: asyncio.Future[None] | None = None  # created by wait_stopped when it has to wait
        self.stopped = threading.Event()
        self.inflight = 0
        self.error: BaseException | None = None

    @property
    def num_chunks(self) -> int:
        return len(self._pending)

    def wait_stopped_sync(self, timeout: float) -> bool:
        """Block (briefly: one chunk) until no worker touches the job's memory; for synchronous callers."""
        return self.stopped.wait(timeout)

    def _finish_locked(self) -> None:
        if self._pending or self.inflight or self.stopped.is_set():
            return
        self.stopped.set()
        try:
            self._loop.call_soon_threadsafe(self._resolve)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _resolve(self) -> None:
        resolve_job(self)


class ExecutorBase:
    """What both executors share: chunk sizing, awaiting a job, and ``run`` = ``start`` + ``wait``.

    Subclasses provide ``workers``, ``start(spans, copier, chunk_bytes=...)`` and ``cancel(job, error=None)``.
    """

    workers: int

    def chunk_bytes_for(self, total: int) -> int:
        if total <= SINGLE_CHUNK:
            return max(total, 1)
        if total <= SMALL:
            return -(-total // self.workers)
        return int(min(MAX_CHUNK, max(MIN_CHUNK, total // (2 * self.workers))))

    def start(self, spans: Spans, copier: CopySpec, *, chunk_bytes: int | None = None) -> Any:
        raise NotImplementedError

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
            await job.future  # a cancellation of the caller cancels this future too: the job ends on its own
        except asyncio.CancelledError:
            self.cancel(job)
            await wait_stopped(job)
            raise


class CopyExecutor(ExecutorBase):
    """Worker threads that execute :class:`CopyJob` chunks round-robin (the fallback without the C helper)."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="aiodatadist-copy")
        self._lock = threading.Lock()
        self._ready: deque[CopyJob] = deque()

    def start(self, spans: Spans, copier: CopySpec, *, chunk_bytes: int | None = None) -> CopyJob:
        """Queue a job (call from the event loop thread); await it with :meth:`wait`."""
        job = CopyJob(spans, copier, chunk_bytes or self.chunk_bytes_for(spans.total_bytes),
                      asyncio.get_running_loop())
        if job.num_chunks == 0:
            with self._lock:
                job._finish_locked()
        else:
            self.submit(job)
        return job

    def submit(self, job: CopyJob) -> None:
        with self._lock:
            self._ready.append(job)
        # Each drain loops over chunks of every job until none is left, so a busy worker goes from chunk to
        # chunk without sleeping in between; drains beyond the running ones return at once.
        for _ in range(min(self.workers, job.num_chunks)):
            self._pool.submit(self._drain)

    def cancel(self, job: CopyJob, error: BaseException | None = None) -> None:
        """Drop the job's pending chunks and stop its running ones at their next piece (<= 1 MiB; between
        ``process_vm_*`` calls for peer memory).

        With ``error`` the job's waiter gets that exception instead of a plain early stop.
        """
        job.stop_flag.set()  # running native copies stop at their next piece
        with self._lock:
            if error is not None and job.error is None and not job.stopped.is_set():
                job.error = error
            job._pending.clear()
            if job in self._ready:
                self._ready.remove(job)
            job._finish_locked()

    def _drain(self) -> None:
        while self._run_one():
            pass

    def _run_one(self) -> bool:
        with self._lock:
            if not self._ready:
                return False
            job = self._ready.popleft()
            lo, hi = job._pending.popleft()
            if job._pending:
                self._ready.append(job)  # round-robin: the next chunk goes to the next job
            job.inflight += 1
        error: BaseException | None = None
        try:
            job._run(lo, hi, job.stop_flag)
        except BaseException as exc:  # reported to the awaiting coroutine, never lost in the pool
            error = exc
        with self._lock:
            job.inflight -= 1
            if error is not None:
                if job.error is None:
                    job.error = error
                job.stop_flag.set()
                job._pending.clear()
                if job in self._ready:
                    self._ready.remove(job)
            job._finish_locked()
        return True

    def shutdown(self) -> None:
        """Wait for running chunks and stop the worker threads (blocking: call it off the event loop)."""
        self._pool.shutdown(wait=True, cancel_futures=False)


def resolve_job(job: Any) -> None:
    """On the event loop, once no worker touches ``job`` any more: settle its future and wake ``wait_stopped``."""
    if not job.future.done():
        if job.error is not None:
            job.future.set_exception(job.error)
        else:
            job.future.set_result(None)
    if job.stop_waiter is not None and not job.stop_waiter.done():
        job.stop_waiter.set_result(None)


async def wait_stopped(job: Any) -> None:
    """Wait (through further cancellations) until no worker touches ``job``'s memory any more."""
    cancelled = False
    while not job.stopped.is_set():
        if job.stop_waiter is None:
            job.stop_waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.shield(job.stop_waiter)
        except asyncio.CancelledError:
            cancelled = True  # keep waiting: the memory must be free of workers first
    if job.future.done() and not job.future.cancelled():
        job.future.exception()  # mark retrieved
    if cancelled:
        raise asyncio.CancelledError


_shared: CopyExecutor | None = None
_users = 0
_shared_lock = threading.Lock()


def shared_executor() -> CopyExecutor:
    """The process-wide executor; each call must be paired with :func:`release_shared_executor`."""
    global _shared, _users
    with _shared_lock:
        if _shared is None:
            from .native_pool import make_executor

            _shared = make_executor()
        _users += 1
        return _shared


async def release_shared_executor() -> None:
    """Drop one user; the last one joins the worker threads (in a helper thread, off the event loop)."""
    global _shared, _users
    with _shared_lock:
        _users -= 1
        if _users > 0 or _shared is None:
            return
        executor, _shared = _shared, None
    await asyncio.to_thread(executor.shutdown)
