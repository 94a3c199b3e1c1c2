"""Copy executor: runs span copies in worker threads, in bounded chunks, fairly across transfers.

A transfer is a :class:`CopyJob`: its spans are cut into chunks of at most a few MiB; worker threads take chunks
round-robin across all running jobs, so concurrent transfers share bandwidth.  Cancelling a job drops its pending
chunks and waits for the chunks already running (at most one per worker), so when :meth:`CopyExecutor.run`
returns or raises, no worker touches the job's memory any more.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from ..jobs.base import ExecutorBase, default_workers, resolve_job
from ..jobs.chunks import PIECE, split_spans
from ..layout.plans import Spans
from ..native import CopySpec, StopFlag, bind_runner

__all__ = ["CopyExecutor", "CopyJob"]


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
        except BaseException as exc:  # noqa: BLE001 - reported to the awaiting coroutine, never lost in the pool
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

