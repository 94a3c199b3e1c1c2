"""How a GPU copy's end reaches its caller: the job (:class:`CudaJob`, whose future settles once the GPU no longer
touches its memory), the stream callbacks that complete blocking waits, and the loop's side of a job's completion
event (:class:`EventWatch`: a timer, then a query per loop iteration, then a thread).  The executor they report to
is seen through :class:`Completions`."""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import threading
import time
from typing import Final, Protocol

from ..jobs.base import resolve_job
from .copy_calls import CTX_FAILED, CopyCalls
from .driver import STREAM_CALLBACK, CudaError, Device
from .kernels import KERNEL_NAME
from .launches import Descriptors

__all__ = ["STREAM_DONE", "Completions", "CudaJob", "EventWatch", "Work", "await_callback", "forget_callback"]

log = logging.getLogger("aiodatadist.cuda")

CUDA_ERROR_NOT_READY: Final = 600
POLL_AT: Final = 0.8  # a job's event is first queried after this share of its expected duration
POLL_FOR_S: Final = 0.002  # then queried every loop iteration until this long past the expected end
TIMER_MIN_S: Final = 0.002  # shorter waits poll from the next iteration: the loop's timers round up to 1 ms
TIMER_SLACK_S: Final = 0.001  # (epoll's timeout is in milliseconds, rounded up)


class Completions(Protocol):
    """What a job and its event watch need of the executor that enqueued them."""

    device: Device
    _calls: CopyCalls
    _rates: list[float]
    _timed_events: list[ctypes.c_void_p]

    def _job_stopped(self, desc: Descriptors | None, seq: int) -> None: ...

    def _event_done(self, event: ctypes.c_void_p, nbytes: int, took: float, at_first_query: bool,
                    timed: bool = False, kind: int = 0) -> None: ...


class _StopFlag:
    """Set once, waited for by any thread: what ``threading.Event`` does, at a tenth of its cost to create (a
    lock held until :meth:`set`)."""

    __slots__ = ("_done", "_lock")

    def __init__(self) -> None:
        self._done = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        if not self._done:
            self._done = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        if self._done:
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return False
        self._lock.release()
        return True


class Work:
    """What the stream callback completes: a copy enqueued on a :class:`~.executor.CudaExecutor`'s stream."""

    def __init__(self) -> None:
        self.stopped = _StopFlag()
        self.error: BaseException | None = None
        self._status = 0  # CUresult the stream callback reported
        self._executor: Completions | None = None
        self._desc: Descriptors | None = None
        self._seq = 0  # its place in the stream's order (0: nothing enqueued)

    def wait_stopped_sync(self, timeout: float | None = None) -> bool:
        """Block until the GPU no longer touches the job's memory (True), or ``timeout`` passed (False)."""
        return self.stopped.wait(timeout)

    def _gpu_done(self, status: int, *, in_order: bool = False) -> None:
        """On the driver's callback thread (no CUDA calls allowed there; ``in_order``: the stream reached it), or
        inline after a failed enqueue."""
        self._stopped(status, in_order)
        self._notify()

    def _stopped(self, status: int, in_order: bool) -> None:
        """The GPU no longer touches the job's memory (``status``: how its stream ended; ``in_order``: the stream
        reached this job, so it is past every job enqueued before it)."""
        self._status = status
        desc, self._desc = self._desc, None
        if self._executor is not None:
            self._executor._job_stopped(desc, self._seq if in_order else 0)
        self.stopped.set()

    def _take_status(self) -> None:
        """Turn a failure the stream reported into :attr:`error` (off the callback thread: it calls CUDA)."""
        if self._status and self.error is None and self._executor is not None:
            driver = self._executor.device.driver
            self.error = CudaError(f"copy on {self._executor.device!r} failed: "
                                   f"{driver.describe(self._status)}", result=self._status,
                                   function=KERNEL_NAME)
        self._status = 0

    def _notify(self) -> None:
        pass


class CudaJob(Work):
    """One copy on the GPU: ``future`` (on the caller's loop) settles once ``stopped`` is set, i.e. once the
    GPU finished touching the job's memory; ``error`` is what the future raises."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop = loop
        self.future: asyncio.Future[None] = loop.create_future()
        self.stop_waiter: asyncio.Future[None] | None = None  # created by wait_stopped when it has to wait
        # perf_counter() before its first driver call, once the copy is enqueued and once the loop saw its event
        # complete (0.0: not yet, or completed by a stream callback); `bench --device` reads them to split a call
        self.launch_at = 0.0
        self.enqueued_at = 0.0
        self.gpu_seconds = 0.0  # the copy's time on the GPU, with CudaExecutor.time_copies on (else 0.0)
        self.seen_at = 0.0
        self.watch: EventWatch | None = None  # the loop's side of its completion event, if it has one

    def _notify(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._resolve)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _resolve(self) -> None:
        self._take_status()
        resolve_job(self)

    def _gpu_done_here(self, status: int) -> None:
        """On the job's loop: the GPU is done (its event completed with ``status``)."""
        self._stopped(status, True)
        self._resolve()


# Stream callbacks find their work by id: userData is an integer, never a pointer to a Python object.
_pending: dict[int, Work] = {}
_pending_lock = threading.Lock()
_ids = itertools.count(1)


def _on_stream_done(stream: int | None, status: int, user_data: int | None) -> None:
    try:
        with _pending_lock:
            work = _pending.pop(user_data or 0, None)
        if work is not None:
            work._gpu_done(int(status), in_order=True)
    except BaseException:  # never propagate into the driver's thread
        log.exception("CUDA stream callback failed")


# Module-level and never freed: the driver may call it as long as the process lives.
STREAM_DONE = STREAM_CALLBACK(_on_stream_done)
"""The stream callback (``cuStreamAddCallback``) that completes the work :func:`await_callback` registered."""


def await_callback(work: Work) -> int:
    """Register ``work`` for :data:`STREAM_DONE`; returns the key to pass as its ``userData``."""
    key = next(_ids)
    with _pending_lock:
        _pending[key] = work
    return key


def forget_callback(key: int) -> None:
    """The callback of ``key`` could not be added: it will never run."""
    with _pending_lock:
        _pending.pop(key, None)


class EventWatch:
    """The loop's side of a job's completion event: a timer for most of the expected duration, then a query per
    loop iteration, then (a copy far past its expected end) a thread blocked in ``cuEventSynchronize``."""

    __slots__ = ("_query", "done", "event", "event_at", "executor", "job", "kind", "nbytes", "queries", "slept",
                 "start", "started", "until")

    def __init__(self, executor: Completions, job: CudaJob, event: ctypes.c_void_p, nbytes: int, kind: int,
                 start: ctypes.c_void_p | None = None) -> None:
        self.executor, self.job, self.event, self.nbytes, self.start = executor, job, event, nbytes, start
        self.event_at = event.value or 0
        self._query = executor._calls.query
        self.kind = kind
        self.started = time.perf_counter()
        self.queries = 0
        self.done = False
        expected = nbytes / executor._rates[kind]
        self.until = self.started + expected + POLL_FOR_S
        delay = expected * POLL_AT
        self.slept = delay >= TIMER_MIN_S
        if self.slept:  # a timer for the bulk of a long copy
            job._loop.call_later(delay - TIMER_SLACK_S, self._poll)
        else:  # shorter ones are polled from the next loop iteration on
            job._loop.call_soon(self._poll)

    def polled_each_iteration(self) -> bool:
        """Whether the loop queries the event every iteration now (not sleeping on a timer first, not yet handed
        to a thread)."""
        return not self.done and (not self.slept or self.queries > 0) and time.perf_counter() < self.until

    def query(self) -> bool:
        """Query the event once: True once the job completed; False while the copy runs, or when the query failed
        (a thread then waits for the copy and completes the job)."""
        if self.done:
            return True
        self.queries += 1
        result = self._query(self.event_at)
        if result == CUDA_ERROR_NOT_READY:
            return False
        if result & CTX_FAILED:  # e.g. the device was released: wait in a thread instead
            log.debug("cuEventQuery: %s", self.executor._calls.error("cuEventQuery", result))
            self.until = 0.0
            return False
        self._done(result)
        return True

    def _poll(self) -> None:
        if self.query():
            return
        if time.perf_counter() < self.until:
            self.job._loop.call_soon(self._poll)
        else:
            waited = self.job._loop.run_in_executor(None, self._synchronize)
            waited.add_done_callback(lambda f: self._done(f.result() if not f.cancelled() else 0))

    def _synchronize(self) -> int:
        """In a thread: block until the event completed; its status (never raises)."""
        try:
            self.executor.device.make_current()
            return int(self.executor.device.driver.fn("cuEventSynchronize")(self.event))
        except Exception:
            log.exception("cuEventSynchronize failed")
            return 999  # CUDA_ERROR_UNKNOWN

    def _done(self, status: int) -> None:
        if self.done:
            return
        self.done = True
        self.job.seen_at = now = time.perf_counter()
        took = now - self.started
        executor = self.executor
        if self.start is not None:
            elapsed = ctypes.c_float()
            if not status and not executor.device.driver.fn("cuEventElapsedTime_v2")(ctypes.byref(elapsed),
                                                                                       self.start, self.event):
                self.job.gpu_seconds = elapsed.value / 1e3
            executor._timed_events.append(self.start)
        executor._event_done(self.event, self.nbytes, took, self.slept and self.queries == 1, self.start is not None,
                             self.kind)
        self.job._gpu_done_here(status)
