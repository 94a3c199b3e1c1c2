"""Span copies on an NPU, completed asynchronously: :class:`AclExecutor`.

A job is a plan's spans, merged where they continue each other (the native helper walks the plan's grid in one
pass), queued on the executor's own stream: device to device one ``aclrtMemcpyAsync`` per span, host to device
and device to host ``aclrtMemcpyBatchAsync`` (one direction a batch, at most 4096 spans each; span by span where
the runtime refuses batches).  ACL has no pointer-list kernel that could be loaded without a SoC-specific binary,
so a job of many short spans costs one runtime call per span (or per 4096 over the bus).

How the event loop learns that the NPU is done: an event recorded after the job (``aclrtRecordEvent``, events
from a pool), which the loop queries (``aclrtQueryEventStatus``: COMPLETE is 1 there) once per iteration, after a
timer for most of a long copy's expected time; a copy still running well past that is waited for in a thread
(``aclrtSynchronizeEventWithTimeout``).  An ACL event carries no error: the stream runs with
``ACL_STOP_ON_FAILURE``, and every query also asks the stream (``aclrtStreamQuery``), where a failed copy is kept.
A failed stream is aborted (its remaining tasks never run), the job fails with ``LLM_DEVICE_MEM_ERROR`` and ACL's
message (read on the thread that saw the failure: ACL's messages are per thread), and every job queued behind it
whose event had not completed fails too: its copies were dropped.

Host memory that could not be page-locked makes ACL copy synchronously inside the call: such jobs are issued
from a worker thread, never on the event loop.  A queued copy cannot be stopped: :meth:`AclExecutor.cancel` only
records an error, and :meth:`~aiodatadist.jobs.base.ExecutorBase.wait` of a cancelled caller still waits until
the NPU is done, so once it returns nothing of the job is queued or running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from .._arrays import UInt64Array
from ..errors import LLMException, LLMStatusCode
from ..jobs.base import ExecutorBase, resolve_job
from ..jobs.chunks import as_u64
from ..layout.plans import CopyPlan, Spans, plan_to_spans
from ..native import native_extension
from .device import ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, AclDevice
from .library import ACL_ERROR_RT_EVENT_SYNC_TIMEOUT, AclError, describe

__all__ = ["AclExecutor", "AclJob"]

log = logging.getLogger("aiodatadist.acl")

ACL_MEMCPY_DEVICE_TO_DEVICE: Final = 3
ACL_STREAM_FAST_LAUNCH: Final = 0x1
ACL_STREAM_FAST_SYNC: Final = 0x2
ACL_STOP_ON_FAILURE: Final = 1
ACL_EVENT_SYNC: Final = 0x1
ACL_EVENT_RECORDED_STATUS_COMPLETE: Final = 1
NO_PIECES: Final = 1 << 62  # grid_table's piece size: spans are merged, never cut (ACL copies any length)
RATES: Final = {ACL_MEMCPY_DEVICE_TO_DEVICE: 500e9, ACL_MEMCPY_HOST_TO_DEVICE: 20e9, ACL_MEMCPY_DEVICE_TO_HOST: 20e9}
POLL_AT: Final = 0.8  # a job's event is first queried after this share of its expected duration
POLL_FOR_S: Final = 0.002  # then every loop iteration until this long past the expected end; then a thread
TIMER_MIN_S: Final = 0.002  # shorter waits poll from the next iteration (the loop's timers round up to 1 ms)
SYNC_SLICE_MS: Final = 50  # a thread's wait for an event, between checks of the stream
KINDS_KEPT: Final = 4096  # address pairs whose copy kind an executor remembers
PENDING: Final = -1  # device_query: the event's work still runs

_grid_table: Callable[..., tuple[int, int, int]] | None = getattr(native_extension(), "grid_table", None)


class _StopFlag:
    """Set once (any thread), read by any thread."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


class AclJob:
    """One copy on the NPU: ``future`` (on the caller's loop) settles once ``stopped`` is set, i.e. once the NPU
    no longer touches the job's memory; ``error`` is what the future raises."""

    __slots__ = ("_loop", "error", "event", "future", "nbytes", "started", "stop_waiter", "stopped", "until")

    def __init__(self, loop: asyncio.AbstractEventLoop, nbytes: int) -> None:
        self._loop = loop
        self.future: asyncio.Future[None] = loop.create_future()
        self.stop_waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.stopped = _StopFlag()
        self.event = 0  # recorded after the job's copies (0: none)
        self.nbytes = nbytes
        self.started = time.perf_counter()
        self.until = 0.0


class _Calls:
    """The runtime calls on a copy's path, one call into the native helper each (the device's context made
    current in the same call): ``copy(stream, kind, table, n) -> (aclError, queued)``, ``record(event, stream)``,
    ``query(event, stream) -> -1 | 0 | aclError``.  Without the native helper the same calls run through ctypes."""

    def __init__(self, device: AclDevice) -> None:
        lib, ext = device.library, native_extension()
        self.table: object | None = None
        self._device = device
        bind = getattr(ext, "acl_bind", None)
        if bind is not None:
            names = ("aclrtGetCurrentContext", "aclrtSetCurrentContext", "aclrtMemcpyAsync", "aclrtMemcpyBatchAsync",
                     "aclrtRecordEvent", "aclrtQueryEventStatus", "aclrtStreamQuery", "aclrtStreamAbort")
            if all(lib.has(n) for n in names if n != "aclrtMemcpyBatchAsync"):
                addresses = [_address(lib.fn(n)) if lib.has(n) else 0 for n in names]
                table = self.table = bind(*addresses, device.ordinal)
                self.copy: Callable[[int, int, UInt64Array, int], tuple[int, int]] = functools.partial(
                    ext.acl_copy, table, device.context)
                self.record: Callable[[int, int], int] = functools.partial(ext.device_record, table, device.context)
                self.query: Callable[[int, int], int] = functools.partial(ext.device_query, table, device.context)
                return
        self.copy, self.record, self.query = self._ctypes_copy, self._ctypes_record, self._ctypes_query

    def _ctypes_copy(self, stream: int, kind: int, table: UInt64Array, n: int) -> tuple[int, int]:
        self._device.bind_thread()
        memcpy = self._device.library.fn("aclrtMemcpyAsync")
        for i, (src, dst, length) in enumerate(zip(*(table[k * n:(k + 1) * n].tolist() for k in range(3)),
                                                   strict=True)):
            result = memcpy(ctypes.c_void_p(dst), length, ctypes.c_void_p(src), length, kind, ctypes.c_void_p(stream))
            if result:
                return result, i
        return 0, n

    def _ctypes_record(self, event: int, stream: int) -> int:
        self._device.bind_thread()
        return self._device.library.fn("aclrtRecordEvent")(ctypes.c_void_p(event), ctypes.c_void_p(stream))

    def _ctypes_query(self, event: int, stream: int) -> int:
        self._device.bind_thread()
        lib = self._device.library
        status, state = ctypes.c_int(), ctypes.c_int()
        result = lib.fn("aclrtQueryEventStatus")(ctypes.c_void_p(event), ctypes.byref(status))
        if result:
            return result
        result = lib.fn("aclrtStreamQuery")(ctypes.c_void_p(stream), ctypes.byref(state))
        if result:
            if lib.has("aclrtStreamAbort"):
                lib.fn("aclrtStreamAbort")(ctypes.c_void_p(stream))
            return result
        return 0 if status.value == ACL_EVENT_RECORDED_STATUS_COMPLETE else PENDING


class AclExecutor(ExecutorBase):
    """Copies spans with one NPU, asynchronously, in submission order, on a stream of its own.  ``start_plan``
    belongs on the event loop thread; ``close`` when no job is awaited any more."""

    workers = 1

    def __init__(self, device: AclDevice) -> None:
        self.device = device
        lib = device.library
        device.bind_thread()
        stream = ctypes.c_void_p()
        if lib.has("aclrtCreateStreamWithConfig"):
            lib.call("aclrtCreateStreamWithConfig", ctypes.byref(stream), 0,
                     ACL_STREAM_FAST_LAUNCH | ACL_STREAM_FAST_SYNC)
        else:
            lib.call("aclrtCreateStream", ctypes.byref(stream))
        self._stream = stream.value or 0
        if lib.has("aclrtSetStreamFailureMode"):
            lib.call("aclrtSetStreamFailureMode", ctypes.c_void_p(self._stream), ACL_STOP_ON_FAILURE)
        self._calls = _Calls(device)
        self._events: list[int] = []
        self._inflight: dict[int, AclJob] = {}  # id(job) -> job, in submission order
        self._kinds: dict[tuple[int, int], tuple[int, bool]] = {}
        self._blocking: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def stream(self) -> int:
        """The executor's stream (an ``aclrtStream``)."""
        return self._stream

    @property
    def device_table(self) -> object | None:
        """The native device-runtime table of this executor's runtime functions (a capsule), or None."""
        return self._calls.table

    # -- jobs ---------------------------------------------------------------------------------------------------
    def start_plan(self, plan: CopyPlan, src_addrs: np.ndarray, dst_addrs: np.ndarray, copier: object = None, *,
                   chunk_bytes: int | None = None) -> AclJob:
        """Queue the copy of a plan between tensors at ``src_addrs`` and ``dst_addrs``; await it with
        :meth:`wait`.  ``copier`` and ``chunk_bytes`` exist for the executor interface and are ignored."""
        src_addrs, dst_addrs = as_u64(src_addrs), as_u64(dst_addrs)
        if _grid_table is None:
            return self.start(plan_to_spans(plan, src_addrs, dst_addrs))
        runs = plan.runs
        out = np.empty(3 * (plan.num_spans + 1), dtype=np.uint64)
        n, _, _ = _grid_table(src_addrs, dst_addrs, plan.src_tensor, plan.dst_tensor, runs.src_offset,
                              runs.dst_offset, runs.length, NO_PIECES, out)
        first = (int(src_addrs[0]), int(dst_addrs[0])) if len(src_addrs) and len(dst_addrs) else (0, 0)
        return self._submit(out[:3 * n], n, plan.total_bytes, first)

    def start(self, spans: Spans, copier: object = None, *, chunk_bytes: int | None = None) -> AclJob:
        """Queue the copy of ``spans`` (all of one kind: within device memory, or one direction over the bus)."""
        length = np.asarray(spans.length, dtype=np.uint64)
        keep = length != 0
        src = np.asarray(spans.src, dtype=np.uint64)[keep]
        dst = np.asarray(spans.dst, dtype=np.uint64)[keep]
        table = np.concatenate((src, dst, length[keep])).astype(np.uint64, copy=False)
        first = (int(src[0]), int(dst[0])) if len(src) else (0, 0)
        return self._submit(table, len(src), int(length.sum()), first)

    def _kind(self, src: int, dst: int) -> tuple[int, bool]:
        """The memcpy kind of a copy from ``src`` to ``dst`` and whether ACL copies it synchronously (a host end
        that is not page-locked), remembered per pair of tensor addresses."""
        found = self._kinds.get((src, dst))
        if found is not None:
            return found
        device = self.device
        src_dev, dst_dev = device.is_device_pointer(src), device.is_device_pointer(dst)
        if src_dev and dst_dev:
            found = (ACL_MEMCPY_DEVICE_TO_DEVICE, False)
        elif src_dev or dst_dev:
            host = dst if src_dev else src
            kind = ACL_MEMCPY_DEVICE_TO_HOST if src_dev else ACL_MEMCPY_HOST_TO_DEVICE
            found = (kind, device.host_kind(host) not in ("malloc", "registered"))
        else:
            raise LLMException(f"a copy from {src:#x} to {dst:#x} touches no memory of {device!r}",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if len(self._kinds) >= KINDS_KEPT:
            self._kinds.clear()
        self._kinds[(src, dst)] = found
        return found

    def _submit(self, table: UInt64Array, n: int, nbytes: int, first: tuple[int, int]) -> AclJob:
        job = AclJob(asyncio.get_running_loop(), nbytes)
        if self._closed:
            job.error = LLMException("the ACL executor is closed", status_code=LLMStatusCode.LLM_FAILED)
            self._stopped(job)
            return job
        if n == 0:
            self._stopped(job)
            return job
        table = np.ascontiguousarray(table)
        try:
            kind, blocking = self._kind(*first)
        except LLMException as exc:
            job.error = exc
            self._stopped(job)
            return job
        if blocking:
            if self._blocking is None:
                self._blocking = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aiodatadist-acl")
            self._inflight[id(job)] = job
            self._blocking.submit(self._run_blocking, job, table, n, kind)
            return job
        if self._issue(job, table, n, kind):
            self._watch(job, kind)
        return job

    def _issue(self, job: AclJob, table: UInt64Array, n: int, kind: int) -> bool:
        """Queue the job's copies and record its event; False (the job failed and is stopped) when a call
        failed: what was queued before it is waited for first."""
        result, queued = self._calls.copy(self._stream, kind, table, n)
        if result:
            job.error = self._error("aclrtMemcpyAsync" if kind == ACL_MEMCPY_DEVICE_TO_DEVICE
                                    else "aclrtMemcpyBatchAsync", result)
            if queued:
                self._drain()
            self._stopped(job)
            return False
        event = self._event()
        result = self._calls.record(event, self._stream) if event else 1
        if result:
            if event:
                self._events.append(event)
            self._drain()  # no event: wait for the stream here (rare: the runtime refused the record)
            job.error = self._take_stream_error()
            self._stopped(job)
            return False
        job.event = event
        self._inflight[id(job)] = job
        return True

    def _event(self) -> int:
        if self._events:
            return self._events.pop()
        lib, event = self.device.library, ctypes.c_void_p()
        self.device.bind_thread()
        create = "aclrtCreateEventExWithFlag" if lib.has("aclrtCreateEventExWithFlag") else None
        result = (lib.fn(create)(ctypes.byref(event), ACL_EVENT_SYNC) if create
                  else lib.fn("aclrtCreateEvent")(ctypes.byref(event)))
        if result:
            log.debug("%s", lib.error(create or "aclrtCreateEvent", result))
            return 0
        return event.value or 0

    # -- completion ----------------------------------------------------------------------------------------------
    def _watch(self, job: AclJob, kind: int) -> None:
        expected = job.nbytes / RATES[kind]
        job.until = job.started + expected + POLL_FOR_S
        delay = expected * POLL_AT
        if delay >= TIMER_MIN_S:
            job._loop.call_later(delay, self._poll, job)
        else:
            job._loop.call_soon(self._poll, job)

    def _poll(self, job: AclJob) -> None:
        if job.stopped.is_set():
            return
        result = self._calls.query(job.event, self._stream)
        if result == PENDING:
            if time.perf_counter() < job.until:
                job._loop.call_soon(self._poll, job)
            else:
                job._loop.run_in_executor(None, self._wait_in_thread, job)
            return
        self._finish(job, result)

    def _wait_in_thread(self, job: AclJob) -> None:
        """A copy far past its expected end: wait for its event here (between checks of the stream)."""
        lib = self.device.library
        self.device.bind_thread()
        sync = lib.fn("aclrtSynchronizeEventWithTimeout") if lib.has("aclrtSynchronizeEventWithTimeout") else None
        while not job.stopped.is_set():
            result = self._calls.query(job.event, self._stream)
            if result != PENDING:
                error = self._stream_error(result) if result else None
                job._loop.call_soon_threadsafe(self._finish, job, result, error)
                return
            if sync is not None:
                waited = sync(ctypes.c_void_p(job.event), SYNC_SLICE_MS)
                if waited not in (0, ACL_ERROR_RT_EVENT_SYNC_TIMEOUT):
                    time.sleep(SYNC_SLICE_MS / 1e3)
            else:
                time.sleep(0.001)

    def _run_blocking(self, job: AclJob, table: UInt64Array, n: int, kind: int) -> None:
        """On the worker thread: copies ACL makes synchronous (pageable host memory), then their event."""
        self.device.bind_thread()
        result, _queued = self._calls.copy(self._stream, kind, table, n)
        error: BaseException | None = None
        if result:
            error = self._error("aclrtMemcpyAsync", result)
        event = self._event()
        if event and not self._calls.record(event, self._stream):
            job.event = event
            self._wait_in_thread_then(job, error)
            return
        if event:
            self._events.append(event)
        self._drain()
        job._loop.call_soon_threadsafe(self._finish, job, 0, error or self._take_stream_error())

    def _wait_in_thread_then(self, job: AclJob, error: BaseException | None) -> None:
        if error is None:
            self._wait_in_thread(job)
            return
        while self._calls.query(job.event, self._stream) == PENDING:
            time.sleep(0.001)
        job._loop.call_soon_threadsafe(self._finish, job, 0, error)

    def _finish(self, job: AclJob, result: int, error: BaseException | None = None) -> None:
        """On the job's loop: its event completed (``result`` 0) or its stream failed (ACL's code)."""
        if job.stopped.is_set():
            return
        if result and error is None:
            error = self._stream_error(result)
        if error is not None and job.error is None:
            job.error = error
        if result:
            self._fail_queued_behind(job)
        self._stopped(job)

    def _fail_queued_behind(self, failed: AclJob) -> None:
        """The stream failed and was aborted: every other job still in flight whose event did not complete had
        its copies dropped."""
        lib = self.device.library
        status = ctypes.c_int()
        for job in list(self._inflight.values()):
            if job is failed or job.stopped.is_set() or not job.event:
                continue
            done = not lib.fn("aclrtQueryEventStatus")(ctypes.c_void_p(job.event), ctypes.byref(status)) and \
                status.value == ACL_EVENT_RECORDED_STATUS_COMPLETE
            if not done and job.error is None:
                job.error = AclError(f"a copy on NPU {self.device.ordinal} was dropped: an earlier copy on its stream "
                                     "failed", result=0, function="aclrtStreamAbort")
            self._stopped(job)

    def _stopped(self, job: AclJob) -> None:
        """The NPU no longer touches the job's memory: settle it (on its loop)."""
        self._inflight.pop(id(job), None)
        if job.event:
            self._events.append(job.event)
            job.event = 0
        job.stopped.set()
        if job._loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is job._loop:
            resolve_job(job)
        else:
            job._loop.call_soon_threadsafe(resolve_job, job)

    def _error(self, name: str, result: int) -> AclError:
        return self.device.library.error(name, result)

    def _stream_error(self, result: int) -> AclError:
        message = self.device.library.recent_message()
        detail = f": {message}" if message else ""
        return AclError(f"copy on NPU {self.device.ordinal} failed: {describe(result)}{detail}", result=result,
                        function="aclrtStreamQuery")

    def _take_stream_error(self) -> AclError | None:
        state = ctypes.c_int()
        result = self.device.library.fn("aclrtStreamQuery")(ctypes.c_void_p(self._stream), ctypes.byref(state))
        if not result:
            return None
        error = self._stream_error(result)
        if self.device.library.has("aclrtStreamAbort"):
            self.device.library.fn("aclrtStreamAbort")(ctypes.c_void_p(self._stream))
        return error

    def _drain(self) -> None:
        self.device.bind_thread()
        result = self.device.library.fn("aclrtSynchronizeStream")(ctypes.c_void_p(self._stream))
        if result:
            log.debug("aclrtSynchronizeStream: %s", describe(result))

    def cancel(self, job: Any, error: BaseException | None = None) -> None:
        """A queued copy cannot be stopped: record ``error`` (if given and the job is not done) for the job's
        waiter, which returns only once the NPU finished the job."""
        if error is not None and job.error is None and not job.stopped.is_set():
            job.error = error

    # -- teardown ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for every queued job, then free the events and the stream (blocking: call it off the event loop
        when jobs may still run)."""
        if self._closed:
            return
        self._closed = True
        if self._blocking is not None:
            self._blocking.shutdown(wait=True)
        lib = self.device.library
        self._drain()
        self._take_stream_error()
        for event in self._events:
            lib.fn("aclrtDestroyEvent")(ctypes.c_void_p(event))
        self._events = []
        result = lib.fn("aclrtDestroyStream")(ctypes.c_void_p(self._stream))
        if result:
            log.warning("aclrtDestroyStream: %s", describe(result))


def _address(function: object) -> int:
    """Where a ctypes foreign function's code is."""
    return ctypes.cast(function, ctypes.c_void_p).value or 0  # type: ignore[arg-type]  # (a CFuncPtr)
