"""Span copies on a GPU, completed asynchronously: :class:`CudaExecutor`.

A job is enqueued on the executor's stream without blocking: one ``cuMemcpyAsync`` for a single span, else
one launch of the pointer-list kernel (``adt_copy_spans``) for all spans, its descriptors copied to the device
on the same stream.  A plan's launch (:meth:`CudaExecutor.start_plan`) is prepared by the native helper in one pass over the plan's
grid; seen a second time for the same pair of tensor address lists, it is kept, its descriptor table on the
device after its next copy: from then on a repeated transfer is one ``cuLaunchKernel``.  One-off launches (a
serving engine's new blocks at every call) are never kept: their tables are staged in pooled buffers.

How the event loop learns that the GPU is done: an event recorded after the copy, which the loop itself queries
(``cuEventQuery``, well under a microsecond).  A copy expected to take 2.5 ms or more (its bytes at the rate this
executor has seen for copies of its kind: within device memory, or over the bus to page-locked host memory) first
sleeps on a loop timer for most of that time (:data:`POLL_AT`; the loop's timers round
up to a millisecond, so shorter copies never use one); then the loop queries the event once per iteration,
yielding to every other task, and a copy still running :data:`POLL_FOR_S` past its expected end is waited for in
a thread (``cuEventSynchronize``).  A copy found complete at the first query after a timer may have ended long
before, so it only raises the expected rate (doubling it), never lowers it.  The driver's callback thread and the cross-thread wake-up cost 80-130 us per copy on an
H100; a polled event costs nothing measurable.  Blocking waits (:meth:`CudaExecutor.run_sync`) and a job whose
event cannot be recorded use a stream callback instead.

A launched copy cannot be aborted.  :meth:`CudaExecutor.cancel` only records an error;
:meth:`ExecutorBase.wait <aiodatadist.jobs.base.ExecutorBase.wait>` of a cancelled caller still waits until the
GPU has finished, so once it returns or raises nothing of the job is queued or running.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
import time
from typing import Any, Final, Self

import numpy as np

from ..errors import LLMException, LLMStatusCode
from ..jobs.base import ExecutorBase, ExecutorJob
from ..jobs.chunks import as_u64
from ..layout.plans import CopyPlan, PlanCache, Spans
from .completion import STREAM_DONE, CudaJob, EventWatch, Work, await_callback, forget_callback
from .copy_calls import CTX_FAILED, STAGE_FAILED, CopyCalls
from .driver import CU_EVENT_DISABLE_TIMING, CU_STREAM_NON_BLOCKING, CudaError, Device
from .kernels import KERNEL_NAME, ptx_text
from .launches import DEVICE_ONLY, Descriptors, Launch, LaunchPreparer

__all__ = ["CudaExecutor", "CudaJob"]

log = logging.getLogger("aiodatadist.cuda")

MIN_DESCRIPTORS: Final = 256  # spans a descriptor buffer holds at least (6 KiB device + pinned host: small, as
# a kept launch keeps its buffer, and 64 kept launches of small transfers must leave RESIDENT_SPANS room for large ones)
FIRST_RATES: Final = (1e12, 20e9)  # bytes/s expected, by kind (DEVICE_ONLY, OVER_THE_BUS), before a copy ended
RATE_MIN_S: Final = 200e-6  # copies that end sooner say more about the launch's latency than about the rate
MAX_RATE: Final = 5e12  # bytes/s: no copy is expected to be faster
LAUNCH_CACHE: Final = 64  # prepared launches kept per executor (least recently used first out)
LAUNCH_CACHE_MAX_SPANS: Final = 16384  # plans with more spans are prepared at every call
RESIDENT_SPANS: Final = 1 << 18  # descriptors the cached launches keep on the device, in all (6 MiB)


class CudaExecutor(ExecutorBase):
    """Copies :class:`~aiodatadist.layout.Spans` with one GPU, asynchronously, in submission order.

    Span addresses must be usable by the device: device pointers (of this GPU or, with peer access, another),
    IPC-opened pointers, or device pointers of registered/pinned host memory.  Spans must not overlap.
    ``start`` and ``run`` belong on the event loop thread; ``close`` when no job is awaited any more.
    """

    workers = 1

    def __init__(self, device: Device, *, piece_bytes: int | None = None) -> None:
        self.device = device
        self.launches = LaunchPreparer(device, piece_bytes)
        """Prepares the launches this executor enqueues."""
        self._lock = threading.Lock()
        self._free: list[Descriptors] = []
        self._all: list[Descriptors] = []
        self._closed = False
        self._events: list[ctypes.c_void_p] = []  # recorded after a job's copy, reused once it completed
        self._timed_events: list[ctypes.c_void_p] = []  # the same with timing, for time_copies
        self.time_copies = False
        """Time each awaited copy on the GPU (events with timing around it: ``CudaJob.gpu_seconds``), for
        ``bench --device``: the time from the GPU's end to the loop seeing it is then known."""
        self._launches: PlanCache[Launch] = PlanCache(LAUNCH_CACHE, self._evicted)  # see start_plan
        self._seq = 0  # jobs enqueued on the stream so far
        self._done_seq = 0  # the stream is past every job up to this one
        self._retired: list[tuple[Descriptors, int]] = []  # tables of evicted launches, until the stream is past
        self._resident_spans = 0  # descriptor capacity held by resident tables (at most RESIDENT_SPANS)
        # bytes/s: how fast this executor's copies of each kind have ended (moving averages); kept apart, as a
        # copy over the bus expected at device speed would be polled for long, and the reverse would sleep on a
        # timer for many times its duration
        self._rates = list(FIRST_RATES)
        self.last_job: CudaJob | None = None  # the latest awaitable copy (its timestamps, for `bench --device`)
        drv = device.driver
        device.make_current()
        stream = ctypes.c_void_p()
        drv.call("cuStreamCreate", ctypes.byref(stream), CU_STREAM_NON_BLOCKING)
        self._stream = ctypes.c_void_p(stream.value)
        try:
            module = ctypes.c_void_p()
            drv.call("cuModuleLoadData", ctypes.byref(module), ptx_text())
            self._module = ctypes.c_void_p(module.value)
            function = ctypes.c_void_p()
            try:
                drv.call("cuModuleGetFunction", ctypes.byref(function), self._module, KERNEL_NAME.encode())
            except BaseException:
                drv.fn("cuModuleUnload")(self._module)
                raise
        except BaseException:
            drv.fn("cuStreamDestroy_v2")(self._stream)
            raise
        self._function = ctypes.c_void_p(function.value)
        self._calls = CopyCalls(device)  # the launch, its event's record and queries, as plain ints
        self._stream_at = stream.value or 0
        self._function_at = function.value or 0

    @property
    def kernel(self) -> int:
        """The pointer-list copy kernel, loaded for this device (its ``CUfunction``)."""
        return self._function_at

    @property
    def device_table(self) -> object | None:
        """The native device-runtime table of this executor's driver functions (a capsule), or None."""
        return self._calls.table

    # -- jobs ---------------------------------------------------------------------------------------------

    def start(self, spans: Spans, copier: object = None, *, chunk_bytes: int | None = None) -> CudaJob:
        """Enqueue the copy of ``spans`` (call on the event loop thread; never blocks on the GPU); await it with
        :meth:`wait`.  ``copier`` and ``chunk_bytes`` exist for the executor interface and are ignored.

        Driver errors while enqueueing do not raise here: the job fails with a :class:`CudaError`
        (``LLM_DEVICE_MEM_ERROR``, or ``LLM_DEVICE_OUT_OF_MEMORY``).
        """
        job = CudaJob(asyncio.get_running_loop())
        launch = self.launches.for_spans(spans)
        if len(spans.src):
            launch.kind = self.launches.kind(int(spans.src[0]), int(spans.dst[0]))
        self._submit(launch, job)
        return job

    def start_plan(self, plan: CopyPlan, src_addrs: np.ndarray, dst_addrs: np.ndarray, copier: object = None, *,
                   chunk_bytes: int | None = None) -> CudaJob:
        """:meth:`start` for a plan between tensors at ``src_addrs`` and ``dst_addrs``: its launch (spans, pieces,
        descriptor table, geometry) is prepared per plan and pair of tensor address lists, kept from its second
        sight on."""
        job = CudaJob(asyncio.get_running_loop())
        self._submit(self._prepared(plan, src_addrs, dst_addrs), job)
        return job

    def _prepared(self, plan: CopyPlan, src_addrs: np.ndarray, dst_addrs: np.ndarray) -> Launch:
        src_addrs, dst_addrs = as_u64(src_addrs), as_u64(dst_addrs)

        def prepare() -> Launch:
            launch = self.launches.for_plan(plan, src_addrs, dst_addrs)
            if len(src_addrs) and len(dst_addrs):
                launch.kind = self.launches.kind(int(src_addrs[0]), int(dst_addrs[0]))
            return launch

        if plan.num_spans > LAUNCH_CACHE_MAX_SPANS:
            return prepare()

        def prepare_cached(kept: bool) -> Launch:
            launch = prepare()
            launch.cached = kept
            return launch

        return self._launches.get_or_make(plan, (src_addrs.tobytes(), dst_addrs.tobytes()), prepare_cached)

    async def run(self, spans: Spans, copier: object = None, *, chunk_bytes: int | None = None) -> None:
        """Copy ``spans``; if the caller is cancelled, return (raise) only once the GPU finished the copy, so
        nothing writes into the destination afterwards.  The copy itself always runs to its end."""
        await self.wait(self.start(spans, copier, chunk_bytes=chunk_bytes))

    def cancel(self, job: ExecutorJob, error: BaseException | None = None) -> None:
        """A copy on the GPU cannot be stopped: record ``error`` (if given and the job is not done) for the
        job's waiter and return.  The waiter (:meth:`wait` of a cancelled caller) returns only after the GPU
        finished the job, so nothing writes into the destination afterwards."""
        if error is not None and job.error is None and not job.stopped.is_set():
            job.error = error

    def run_sync(self, spans: Spans) -> None:
        """Copy ``spans`` and block until the GPU is done (for tests and tools; not on an event loop)."""
        work = Work()
        self._submit(self.launches.for_spans(spans), work)
        work.stopped.wait()
        work._take_status()
        if work.error is not None:
            raise work.error

    def _submit(self, launch: Launch, work: Work) -> None:
        work._executor = self
        if self._closed:
            work.error = LLMException("the CUDA executor is closed", status_code=LLMStatusCode.LLM_FAILED)
            work._gpu_done(0)
            return
        if launch.single is None and launch.table is None:
            work._gpu_done(0)
            return
        self._seq += 1
        work._seq = self._seq
        start: ctypes.c_void_p | None = None
        if isinstance(work, CudaJob):
            work.launch_at = time.perf_counter()
            if self.time_copies:
                start = self._record_event(timed=True)
        staged = self._enqueue(launch, work)
        if isinstance(work, CudaJob):
            work.enqueued_at = time.perf_counter()
            self.last_job = work
            if self._watch(work, launch, start):
                return
        if start is not None:
            self._timed_events.append(start)
        self._complete_by_callback(work, staged)

    def _enqueue(self, launch: Launch, work: Work) -> bool:
        """Enqueue ``launch``'s copy for ``work``; whether the stream may still read a staging buffer.  A driver
        error becomes the job's error: the job still completes through the stream, after whatever was enqueued."""
        staged = False
        try:
            if launch.single is not None:
                self.device.make_current()
                self.device.driver.call("cuMemcpyAsync", *launch.single, self._stream)
                return staged
            desc = launch.resident
            stage: tuple[Any, ...] = ()
            if desc is None:  # its table goes to a descriptor buffer first, in the same call
                desc = work._desc = self._acquire(launch.n)
                stage = (launch.table, 24 * launch.n, desc.host, desc.dev)
            launch.last_seq = self._seq
            result = self._calls.launch(self._function_at, launch.grid, launch.block, self._stream_at,
                                        desc.params(launch.n), *stage)
            if stage and not result & (CTX_FAILED | STAGE_FAILED):
                staged = True
                if self._keep_resident(launch, desc):  # the launch's from now on, not the job's
                    launch.resident, work._desc = desc, None
            if result:
                raise self._calls.error("cuLaunchKernel", result)
        except CudaError as exc:
            work.error = exc
        return staged

    def _complete_by_callback(self, work: Work, staged: bool) -> None:
        """Have the driver's callback thread complete ``work`` (no event could be recorded, or a blocking wait);
        if even that fails, drain the stream and complete it here."""
        key = await_callback(work)
        try:
            self.device.driver.call("cuStreamAddCallback", self._stream, STREAM_DONE, ctypes.c_void_p(key), 0)
        except CudaError as exc:
            forget_callback(key)
            if work.error is None:
                work.error = exc
            if staged:  # the descriptors may still be read: reuse them only after the stream drained
                self._drain_quietly()
            work._gpu_done(0)

    # -- completion by event -------------------------------------------------------------------------------

    def _record_event(self, *, timed: bool = False) -> ctypes.c_void_p | None:
        """An event (from the pool; ``timed``: with timing) recorded on the stream now; None if that failed."""
        pool = self._timed_events if timed else self._events
        drv = self.device.driver
        event = pool.pop() if pool else None
        try:
            if event is None:
                self.device.make_current()
                event = ctypes.c_void_p()
                drv.call("cuEventCreate", ctypes.byref(event), 0 if timed else CU_EVENT_DISABLE_TIMING)
            result = self._calls.record(event.value or 0, self._stream_at)
            if result:
                raise self._calls.error("cuEventRecord", result)
        except CudaError as exc:
            log.debug("cannot record an event (%s)", exc)
            if event is not None and event.value:
                pool.append(event)
            return None
        return event

    def _watch(self, job: CudaJob, launch: Launch, start: ctypes.c_void_p | None = None) -> bool:
        """Record an event after ``job``'s copy and have its loop poll it (see the module's docstring); False
        if the event cannot be recorded (the caller adds a stream callback instead).  ``start``: a timed event
        recorded before the copy (the one after it is timed too)."""
        event = self._record_event(timed=start is not None)
        if event is None:
            log.debug("no event after a copy: a stream callback completes it")
            return False
        job.watch = EventWatch(self, job, event, launch.nbytes, launch.kind, start)
        return True

    async def _ended(self, job: Any) -> None:
        """While the job's event is queried every loop iteration, the waiting task queries it too, between yields:
        the call then goes on in the iteration that saw the end, not in the next one, as it would once woken by
        the job's future (the loop's own query goes on too: it completes the job if the task is not there to)."""
        watch: EventWatch | None = getattr(job, "watch", None)
        if watch is not None:
            while watch.polled_each_iteration() and not watch.query():
                await asyncio.sleep(0)
        await job.future

    def _event_done(self, event: ctypes.c_void_p, nbytes: int, took: float, at_first_query: bool,
                    timed: bool = False, kind: int = DEVICE_ONLY) -> None:
        """``took``: from the enqueue to the query that saw the event complete.  Done at the first query after a
        timer, the copy may have ended long before: its rate is only a lower bound, so the expectation is halved
        (the next timer is shorter), never lowered by it.  Copies of less than 1 MiB or :data:`RATE_MIN_S`
        teach nothing: their time is mostly the launch's latency (2 MiB between device buffers take ~1 us of
        the ~20 us to the loop seeing them), and counting them would make large copies sleep on timers."""
        (self._timed_events if timed else self._events).append(event)
        if nbytes < 1 << 20 or took <= 0 or (took < RATE_MIN_S and not at_first_query):
            return
        rates = self._rates
        if at_first_query:
            rates[kind] = min(MAX_RATE, max(rates[kind] * 2, nbytes / took))
        else:
            rates[kind] = min(MAX_RATE, 0.8 * rates[kind] + 0.2 * (nbytes / took))

    # -- descriptor buffers -------------------------------------------------------------------------------

    def _acquire(self, n: int) -> Descriptors:
        with self._lock:
            fits = [d for d in self._free if d.capacity >= n]
            if fits:
                best = min(fits, key=lambda d: d.capacity)
                self._free.remove(best)
                return best
        capacity = max(MIN_DESCRIPTORS, 1 << (n - 1).bit_length())
        desc = Descriptors(self.device, capacity)
        with self._lock:
            self._all.append(desc)
        return desc

    def _job_stopped(self, desc: Descriptors | None, seq: int) -> None:
        """A job is done (on the loop, or the driver's callback thread): its staging buffer back into the pool,
        and, once the stream is past job ``seq`` (0: not known), the tables of launches evicted before it."""
        with self._lock:
            if desc is not None:
                self._free.append(desc)
            if seq > self._done_seq:
                self._done_seq = seq
                if self._retired:
                    still = [(d, last) for d, last in self._retired if last > seq]
                    self._free.extend(d for d, last in self._retired if last <= seq)
                    self._retired = still

    def _keep_resident(self, launch: Launch, desc: Descriptors) -> bool:
        """Whether ``launch`` keeps ``desc`` as its table on the device (a cached launch, within the budget)."""
        with self._lock:
            if not launch.cached or self._resident_spans + desc.capacity > RESIDENT_SPANS:
                return False
            self._resident_spans += desc.capacity
            return True

    def _evicted(self, launch: Launch) -> None:
        """Out of the launch cache: its table's buffer returns to the pool once the stream is past its last job."""
        launch.cached = False
        desc, launch.resident = launch.resident, None
        if desc is not None:
            with self._lock:
                self._resident_spans -= desc.capacity
                if launch.last_seq <= self._done_seq:
                    self._free.append(desc)
                else:
                    self._retired.append((desc, launch.last_seq))

    def _drain_quietly(self) -> None:
        result = self.device.driver.fn("cuStreamSynchronize")(self._stream)
        if result:
            log.warning("cuStreamSynchronize after a failed enqueue: %s", self.device.driver.describe(result))

    # -- teardown -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for every enqueued job, then free the descriptor buffers, the module and the stream (blocking:
        call it off the event loop when jobs may still run)."""
        if self._closed:
            return
        self._closed = True
        drv = self.device.driver
        self.device.make_current()
        self._drain_quietly()
        self._launches.clear()  # their resident tables are among the buffers freed below
        with self._lock:
            buffers, self._all, self._free, self._retired = self._all, [], [], []
        for desc in buffers:
            try:
                desc.free(self.device)
            except CudaError as exc:
                log.warning("freeing CUDA descriptor buffers: %s", exc)
        events, self._events, self._timed_events = self._events + self._timed_events, [], []
        for event in events:
            drv.fn("cuEventDestroy_v2")(event)
        for name, handle in (("cuModuleUnload", self._module), ("cuStreamDestroy_v2", self._stream)):
            result = drv.fn(name)(handle)
            if result:
                log.warning("%s: %s", name, drv.describe(result))

    def shutdown(self) -> None:
        """Same as :meth:`close` (the name :class:`~aiodatadist.copy.python_pool.CopyExecutor` uses)."""
        self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


