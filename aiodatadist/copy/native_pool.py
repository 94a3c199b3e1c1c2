"""The native executor: span copies run on POSIX threads of the compiled helper, never holding the GIL.

Python only submits a job (span arrays, chunk boundaries, a :class:`~aiodatadist.native.CopySpec`) and learns
about its end through a pipe watched by the event loop (workers write the addresses of finished jobs), so copies overlap with the loop's work instead of
contending with it for the interpreter lock.  Same contract as :class:`~aiodatadist.copy.python_pool.CopyExecutor`:
cancelling stops the job at its next span and ``wait`` returns only when no worker touches its memory.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import numpy as np

from .._arrays import UInt64Array
from ..errors import LLMException, LLMStatusCode
from ..jobs.base import ExecutorBase, default_workers, resolve_job, worker_nice, worker_spin_ns
from ..jobs.chunks import PIECE, as_u64, split_spans
from ..jobs.completion import NotifyPipe, Polling
from ..layout.plans import CopyPlan, Spans
from ..native import CopySpec, Streaming, native_extension, native_pool
from ..settings.environment import usable_cpus
from .spans import STREAMING_THRESHOLD, copy_grid_now, measured_streaming_share, streaming_share

__all__ = ["NativeExecutor", "NativeJob"]

_ext: Any = native_extension()

POLL_RATE = 8e9
"""Bytes/s the pool is assumed to copy when deciding whether a job's end is polled for (:class:`Polling`): the
two-thread streaming copy of a 2-vCPU VM measures 12-23 GB/s, and a 2 MiB job ends 60-90 us after its submit."""


class _Flag:
    """Set once, from the event loop thread (cheaper than a threading.Event)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class NativeJob:
    """A job in the native pool; arrays it was given stay referenced here until the pool is done with them."""

    __slots__ = ("_executor", "error", "future", "handle", "keepalive", "polled", "spec", "stop_waiter", "stopped")

    def __init__(self, executor: NativeExecutor, spec: CopySpec, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[None] = loop.create_future()
        self.stop_waiter: asyncio.Future[None] | None = None
        self.stopped = _Flag()
        self.error: BaseException | None = None
        self.spec = spec
        self.handle: int | None = None
        self.keepalive: tuple[Any, ...] = ()
        self.polled = False  # its waiter polls for its end (:meth:`Polling.poll`)
        self._executor = executor

    def ended(self) -> bool:
        """Whether the pool is done with the job (then finished: its future settled)."""
        return self._executor._poll(self)

    def wait_stopped_sync(self, timeout: float) -> bool:
        """Block until the pool is done with the job (bounded by one span per worker)."""
        deadline = time.monotonic() + timeout
        while not self.stopped.is_set() and not self._executor._poll(self):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0002)
        return True


class _Notifier(NotifyPipe):
    """The notify pipe of one event loop (workers write the addresses of finished jobs) and its jobs."""

    def __init__(self, executor: NativeExecutor, loop: asyncio.AbstractEventLoop) -> None:
        self.jobs: dict[int, NativeJob] = {}
        self._executor = executor
        super().__init__(loop, self._finished)

    def _finished(self, handle: int) -> None:
        job = self.jobs.get(handle)
        if job is not None:
            self._executor._poll(job)


class NativeExecutor(ExecutorBase):
    """A pool of native worker threads shared by every instance in the process."""

    polling: Polling  # every job is a candidate: the short ones are polled for

    def __init__(self, workers: int | None = None, *, stream_share: int | None = None) -> None:
        """``workers`` threads (default: :func:`~aiodatadist.jobs.base.default_workers`); ``stream_share``: the
        chunk size from which local jobs stream (default: :func:`~aiodatadist.copy.spans.streaming_share`, measured
        on a thread of its own the first time, plain stores meanwhile)."""
        lib = native_pool()
        if lib is None or native_extension() is None:
            raise RuntimeError("the native helper is not built")
        self._lib = lib
        self.workers = workers or default_workers()
        self.polling = Polling(POLL_RATE)
        self.cpus = usable_cpus()
        # A local job of chunks this big streams (0: never so).
        known = stream_share if stream_share is not None else measured_streaming_share()
        self.stream_share = known or 0
        if known is None:  # (its measurement copies for ~2 ms: never on the event loop)
            threading.Thread(target=self._learn_stream_share, name="aiodatadist-cache-probe", daemon=True).start()
        # Local copies stream once the jobs queued together reach STREAMING_THRESHOLD (submit in native/src/pool.c).
        self._pool: int | None = lib.adt_pool_new(self.workers, worker_nice(), worker_spin_ns(), STREAMING_THRESHOLD)
        if not self._pool:
            raise LLMException("cannot start the native copy threads", status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)
        self._notifiers: dict[asyncio.AbstractEventLoop, _Notifier] = {}

    def _learn_stream_share(self) -> None:
        self.stream_share = streaming_share()

    def _notifier(self, loop: asyncio.AbstractEventLoop) -> _Notifier:
        notifier = self._notifiers.get(loop)
        if notifier is None:
            for old in [n for n in self._notifiers.values() if n.loop.is_closed()]:  # loops that went away
                del self._notifiers[old.loop]
                old.close()
            notifier = self._notifiers[loop] = _Notifier(self, loop)
        return notifier

    def copy_now(self, plan: CopyPlan, src_addrs: UInt64Array, dst_addrs: UInt64Array, copier: CopySpec) -> bool:
        return copy_grid_now(plan, src_addrs, dst_addrs, copier)

    def _sizing(self, total: int, chunk_bytes: int | None) -> tuple[int, bool]:
        """Bytes per chunk of a job of ``total`` bytes, and whether the event loop polls for its end.

        Polling takes a CPU of its own, so a job is polled for only where that leaves a CPU to each of the workers
        that share it: where every CPU has a worker, a job of a chunk per worker is left to all of them with the loop
        asleep.  On 2 vCPUs a 2 MiB pull took 114-131 us that way against 180-187 us on one worker, polled for (p99
        0.22-0.30 ms either way): the loop's wake-up costs less than the second half's copy; with both workers and
        the loop polling, workers lost their CPU to it (p99 0.8-4.2 ms)."""
        chunk = chunk_bytes or self.chunk_bytes_for(total)
        sharing = min(self.workers, -(-total // chunk))
        return chunk, sharing < self.cpus and self.polling.polls(total)

    def _streams(self, copier: CopySpec, chunk: int) -> Streaming:
        """Whether a job of ``chunk``-byte chunks copies with streaming stores: in lanes as ``copier`` asks (a copy
        from memory), or a span at a time because a worker's share is too big for its core's cache
        (:func:`~aiodatadist.copy.spans.streaming_share`: the source is likely in the shared cache); the pool may
        still decide on lanes (the jobs queued with it)."""
        if copier.streaming:
            return Streaming.LANES
        share = self.stream_share
        return Streaming.ALONE if share > 0 and chunk >= share and copier.mode == 0 else Streaming.PLAIN

    def start(self, spans: Spans, copier: CopySpec, *, chunk_bytes: int | None = None) -> NativeJob:
        """Queue a job (from the event loop thread); await it with :meth:`wait`."""
        chunk, polled = self._sizing(spans.total_bytes, chunk_bytes)
        spans, bounds = split_spans(copier.translate(spans), chunk, min(PIECE, chunk))
        arrays = (np.ascontiguousarray(spans.dst, dtype=np.uint64), np.ascontiguousarray(spans.src, dtype=np.uint64),
                  np.ascontiguousarray(spans.length, dtype=np.uint64), np.ascontiguousarray(bounds, dtype=np.int64))
        dst, src, length, bounds = arrays
        loop, notifier, pool = self._target()
        return self._track(self._lib.adt_job_submit(
            pool, dst.ctypes.data, src.ctypes.data, length.ctypes.data, bounds.ctypes.data, len(bounds) - 1,
            copier.mode, copier.pid, self._streams(copier, chunk), notifier.fd), loop, notifier, copier, arrays,
            polled)

    def start_plan(self, plan: CopyPlan, src_addrs: UInt64Array, dst_addrs: UInt64Array, copier: CopySpec, *,
                   chunk_bytes: int | None = None) -> NativeJob:
        """Queue a plan's copy; the helper's workers walk its grid themselves (no span list is built)."""
        runs, total = plan.runs, plan.total_bytes
        chunk, polled = self._sizing(total, chunk_bytes)
        loop, notifier, pool = self._target()
        return self._track(_ext.submit_grid(
            pool, as_u64(src_addrs), as_u64(dst_addrs), plan.src_tensor, plan.dst_tensor, runs.src_offset,
            runs.dst_offset, runs.length, copier.src_delta, copier.dst_delta, chunk, min(PIECE, chunk),
            int(copier.mode), copier.pid, self._streams(copier, chunk), notifier.fd), loop, notifier, copier, (runs,),
            polled)

    def _target(self) -> tuple[asyncio.AbstractEventLoop, _Notifier, int]:
        """The running loop, its notify pipe and the pool a job is queued on (the executor must be open)."""
        pool = self._pool
        if pool is None:
            raise LLMException("the copy executor was shut down", status_code=LLMStatusCode.LLM_FAILED)
        loop = asyncio.get_running_loop()
        return loop, self._notifiers.get(loop) or self._notifier(loop), pool

    def _track(self, handle: int | None, loop: asyncio.AbstractEventLoop, notifier: _Notifier, copier: CopySpec,
               keepalive: tuple[Any, ...], polled: bool) -> NativeJob:
        """The job of a queued ``handle`` (0 or None: the helper was out of memory), awaited from now on (its waiter
        polls for its end if ``polled``)."""
        if not handle:
            raise LLMException("cannot queue a copy job: out of memory", status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)
        job = NativeJob(self, copier, loop)
        job.handle = handle
        job.keepalive = keepalive
        notifier.jobs[handle] = job
        job.polled = polled
        return job

    async def _ended(self, job: NativeJob) -> None:
        if job.polled:  # asked directly: its announcement in the pipe is then read and found reaped already
            await self.polling.poll(job.ended)
        await job.future

    def cancel(self, job: NativeJob, error: BaseException | None = None) -> None:
        """Stop the job at its next span; with ``error`` its waiter gets that exception."""
        if job.stopped.is_set() or job.handle is None:
            return
        if error is not None and job.error is None:
            job.error = error
        self._lib.adt_job_cancel(self._pool, job.handle)

    def _poll(self, job: NativeJob) -> bool:
        """Whether the pool is done with ``job`` (and, if so, finish it)."""
        if job.handle is None:
            return True
        reaped = _ext.reap(job.handle)
        if reaped is None:
            return False
        err = reaped[1]
        if err and job.error is None:
            job.error = OSError(err, f"copy failed: {os.strerror(err)}")
        notifier = self._notifiers.get(job.future.get_loop())
        if notifier is not None:
            notifier.jobs.pop(job.handle, None)
        job.handle = None
        job.stopped.set()
        resolve_job(job)
        return True

    def shutdown(self) -> None:
        """Join the worker threads (blocking: call it off the event loop, after every job ended)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        self._lib.adt_pool_free(pool)
        for notifier in self._notifiers.values():  # announced but never read: nobody waits for them any more
            for handle in list(notifier.jobs):
                self._lib.adt_job_free(handle)
            notifier.jobs.clear()
        for notifier in self._notifiers.values():
            if notifier.loop.is_closed() or notifier.loop.is_running() is False:
                notifier.close()
            else:
                notifier.loop.call_soon_threadsafe(notifier.close)
        self._notifiers.clear()
