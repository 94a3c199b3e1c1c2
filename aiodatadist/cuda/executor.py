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
:meth:`ExecutorBase.wait <aiodatadist.copy.base.ExecutorBase.wait>` of a cancelled caller still waits until the
GPU has finished, so once it returns or raises nothing of the job is queued or running.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final, Self

import numpy as np

from ..errors import LLMException, LLMStatusCode
from ..jobs.base import ExecutorBase, ExecutorJob, resolve_job
from ..jobs.chunks import as_u64
from ..layout.plans import CopyPlan, PlanCache, Spans, plan_to_spans
from ..native import native_extension
from .copy_calls import CTX_FAILED, STAGE_FAILED, CopyCalls
from .driver import CU_EVENT_DISABLE_TIMING, CU_STREAM_NON_BLOCKING, STREAM_CALLBACK, CudaError, Device
from .kernels import KERNEL_NAME, choose_piece, launch_geometry, ptx_text, split_long_spans

__all__ = ["CudaExecutor", "CudaJob"]

log = logging.getLogger("aiodatadist.cuda")

_grid_table: Callable[..., tuple[int, int, int]] | None = getattr(native_extension(), "grid_table", None)

MIN_DESCRIPTORS: Final = 256  # spans a descriptor buffer holds at least (6 KiB device + pinned host: small, as
# a kept launch keeps its buffer, and 64 kept launches of small transfers must leave RESIDENT_SPANS room for large ones)
MAX_SPANS: Final = 2**32 - 1  # the kernel's span count is an unsigned int
CUDA_ERROR_NOT_READY: Final = 600
POLL_AT: Final = 0.8  # a job's event is first queried after this share of its expected duration
POLL_FOR_S: Final = 0.002  # then queried every loop iteration until this long past the expected end
TIMER_MIN_S: Final = 0.002  # shorter waits poll from the next iteration: the loop's timers round up to 1 ms
TIMER_SLACK_S: Final = 0.001  # (epoll's timeout is in milliseconds, rounded up)
FIRST_RATES: Final = (1e12, 20e9)  # bytes/s expected, by kind (DEVICE_ONLY, OVER_THE_BUS), before a copy ended
RATE_MIN_S: Final = 200e-6  # copies that end sooner say more about the launch's latency than about the rate
DEVICE_ONLY: Final = 0  # a copy's kind: both ends in device memory
OVER_THE_BUS: Final = 1  # either end in page-locked host memory (its bus is 10-50x slower than device memory)
KINDS_KEPT: Final = 4096  # address pairs whose kind an executor remembers (forgotten all at once past that)
MAX_RATE: Final = 5e12  # bytes/s: no copy is expected to be faster
LAUNCH_CACHE: Final = 64  # prepared launches kept per executor (least recently used first out)
LAUNCH_CACHE_MAX_SPANS: Final = 16384  # plans with more spans are prepared at every call
RESIDENT_SPANS: Final = 1 << 18  # descriptors the cached launches keep on the device, in all (6 MiB)


class _Launch:
    """A copy ready to enqueue: one span (``single``: dst, src, bytes) or the kernel's descriptor table (``table``:
    the pieces' sources, then destinations, then lengths) and launch geometry; nothing to copy when neither.

    A launch kept in the executor's cache (``cached``) keeps its table on the device after its first use
    (``resident``: the descriptor buffer holding it, and the kernel's parameters): a repeated copy is then one
    ``cuLaunchKernel``.  ``last_seq``: the latest job that launched with it (its buffer is reused only once the
    stream is past that job)."""

    __slots__ = ("block", "cached", "grid", "kind", "last_seq", "n", "nbytes", "resident", "single", "table")

    def __init__(self, nbytes: int, single: tuple[int, int, int] | None = None, table: np.ndarray | None = None,
                 grid: int = 0, block: int = 0) -> None:
        self.nbytes = nbytes
        self.kind = DEVICE_ONLY  # what its copy's duration is expected from (see CudaExecutor._rates)
        self.single = single
        self.table = table
        self.n = 0 if table is None else len(table) // 3
        self.grid, self.block = grid, block
        self.cached = False
        self.resident: _Descriptors | None = None
        self.last_seq = 0


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


class _Work:
    """What the stream callback completes: a copy enqueued on a :class:`CudaExecutor`'s stream."""

    def __init__(self) -> None:
        self.stopped = _StopFlag()
        self.error: BaseException | None = None
        self._status = 0  # CUresult the stream callback reported
        self._executor: CudaExecutor | None = None
        self._desc: _Descriptors | None = None
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


class CudaJob(_Work):
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
        self.watch: _EventWatch | None = None  # the loop's side of its completion event, if it has one

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
_pending: dict[int, _Work] = {}
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
_STREAM_DONE = STREAM_CALLBACK(_on_stream_done)


class _Descriptors:
    """A job's span descriptors: page-locked staging memory and the device copy the kernel reads."""

    __slots__ = ("_args", "_params", "_params_at", "capacity", "dev", "host")

    def __init__(self, device: Device, capacity: int) -> None:
        self.capacity = capacity
        self._args: tuple[ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32] | None = None
        self._params: ctypes.Array[ctypes.c_void_p] | None = None
        self._params_at = 0
        self.host = device.alloc_pinned(24 * capacity)
        try:
            self.dev = device.alloc(24 * capacity)
        except BaseException:
            device.free_pinned(self.host)
            raise

    def params(self, n: int) -> int:
        """The address of the kernel's parameters for a table of ``n`` spans in this buffer (the last ones built
        are kept: the driver copies parameters at the launch, so one array serves every launch)."""
        args = self._args
        if args is None or args[3].value != n:
            args = self._args = (ctypes.c_uint64(self.dev), ctypes.c_uint64(self.dev + 8 * n),
                                 ctypes.c_uint64(self.dev + 16 * n), ctypes.c_uint32(n))
            self._params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
            self._params_at = ctypes.addressof(self._params)
        return self._params_at

    def free(self, device: Device) -> None:
        device.free(self.dev)
        device.free_pinned(self.host)


class CudaExecutor(ExecutorBase):
    """Copies :class:`~aiodatadist.layout.Spans` with one GPU, asynchronously, in submission order.

    Span addresses must be usable by the device: device pointers (of this GPU or, with peer access, another),
    IPC-opened pointers, or device pointers of registered/pinned host memory.  Spans must not overlap.
    ``start`` and ``run`` belong on the event loop thread; ``close`` when no job is awaited any more.
    """

    workers = 1

    def __init__(self, device: Device, *, piece_bytes: int | None = None) -> None:
        self.device = device
        self._piece_bytes = piece_bytes
        self._lock = threading.Lock()
        self._free: list[_Descriptors] = []
        self._all: list[_Descriptors] = []
        self._closed = False
        self._events: list[ctypes.c_void_p] = []  # recorded after a job's copy, reused once it completed
        self._timed_events: list[ctypes.c_void_p] = []  # the same with timing, for time_copies
        self.time_copies = False
        """Time each awaited copy on the GPU (events with timing around it: ``CudaJob.gpu_seconds``), for
        ``bench --device``: the time from the GPU's end to the loop seeing it is then known."""
        self._launches: PlanCache[_Launch] = PlanCache(LAUNCH_CACHE, self._evicted)  # see start_plan
        self._seq = 0  # jobs enqueued on the stream so far
        self._done_seq = 0  # the stream is past every job up to this one
        self._retired: list[tuple[_Descriptors, int]] = []  # tables of evicted launches, until the stream is past
        self._resident_spans = 0  # descriptor capacity held by resident tables (at most RESIDENT_SPANS)
        # bytes/s: how fast this executor's copies of each kind have ended (moving averages); kept apart, as a
        # copy over the bus expected at device speed would be polled for long, and the reverse would sleep on a
        # timer for many times its duration
        self._rates = list(FIRST_RATES)
        self._kinds: dict[tuple[int, int], int] = {}  # (first source, first destination address) -> kind
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

    # -- jobs ---------------------------------------------------------------------------------------------

    def start(self, spans: Spans, copier: object = None, *, chunk_bytes: int | None = None) -> CudaJob:
        """Enqueue the copy of ``spans`` (call on the event loop thread; never blocks on the GPU); await it with
        :meth:`wait`.  ``copier`` and ``chunk_bytes`` exist for the executor interface and are ignored.

        Driver errors while enqueueing do not raise here: the job fails with a :class:`CudaError`
        (``LLM_DEVICE_MEM_ERROR``, or ``LLM_DEVICE_OUT_OF_MEMORY``).
        """
        job = CudaJob(asyncio.get_running_loop())
        launch = self._prepare(spans)
        if len(spans.src):
            launch.kind = self._kind(int(spans.src[0]), int(spans.dst[0]))
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

    def _prepared(self, plan: CopyPlan, src_addrs: np.ndarray, dst_addrs: np.ndarray) -> _Launch:
        src_addrs, dst_addrs = as_u64(src_addrs), as_u64(dst_addrs)

        def prepare() -> _Launch:
            launch = self._prepare_plan(plan, src_addrs, dst_addrs)
            if len(src_addrs) and len(dst_addrs):
                launch.kind = self._kind(int(src_addrs[0]), int(dst_addrs[0]))
            return launch

        if plan.num_spans > LAUNCH_CACHE_MAX_SPANS:
            return prepare()

        def prepare_cached(kept: bool) -> _Launch:
            launch = prepare()
            launch.cached = kept
            return launch

        return self._launches.get_or_make(plan, (src_addrs.tobytes(), dst_addrs.tobytes()), prepare_cached)

    def _kind(self, src: int, dst: int) -> int:
        """Whether a copy from ``src`` to ``dst`` (a tensor's address at each end) stays in device memory or
        crosses the bus, remembered per pair (an address freed and reused for the other kind only misleads the
        expected duration of its copies for a while, never what they copy)."""
        kind = self._kinds.get((src, dst))
        if kind is None:
            device = self.device.is_device_pointer(src) and self.device.is_device_pointer(dst)
            kind = DEVICE_ONLY if device else OVER_THE_BUS
            if len(self._kinds) >= KINDS_KEPT:
                self._kinds.clear()
            self._kinds[(src, dst)] = kind
        return kind

    def _prepare_plan(self, plan: CopyPlan, src_addrs: np.ndarray, dst_addrs: np.ndarray) -> _Launch:
        """:meth:`_prepare` of a plan's spans: the native helper walks the plan's grid into the descriptor table
        in one pass (the same spans, merged and cut alike); without it, through span arrays."""
        if _grid_table is None:
            return self._prepare(plan_to_spans(plan, src_addrs, dst_addrs))
        nbytes = plan.total_bytes
        piece = self._piece_bytes or choose_piece(nbytes, sm_count=self.device.sm_count)
        runs = plan.runs
        arrays = (src_addrs, dst_addrs, plan.src_tensor, plan.dst_tensor, runs.src_offset, runs.dst_offset,
                  runs.length)
        out = np.empty(3 * (plan.num_spans + nbytes // piece + 1), dtype=np.uint64)  # room for every piece
        n, merged, longest = _grid_table(*arrays, piece, out)
        if 3 * n > len(out):  # (cannot happen: a span of L bytes makes at most L // piece + 1 pieces)
            return self._prepare(plan_to_spans(plan, src_addrs, dst_addrs))
        if merged <= 1:
            return _Launch(nbytes, (int(out[n]), int(out[0]), nbytes) if merged else None)
        return self._table_launch(nbytes, out[:3 * n], n, longest)

    def _prepare(self, spans: Spans) -> _Launch:
        """The launch that copies ``spans``: raises ``LLMException`` if one launch cannot take them."""
        length = np.asarray(spans.length, dtype=np.uint64)
        src = np.asarray(spans.src, dtype=np.uint64)
        dst = np.asarray(spans.dst, dtype=np.uint64)
        if len(length) and not length.all():  # zero-length spans copy nothing
            keep = length != 0
            src, dst, length = src[keep], dst[keep], length[keep]
        nbytes = int(length.sum())
        if len(length) <= 1:
            return _Launch(nbytes, (int(dst[0]), int(src[0]), nbytes) if len(length) else None)
        piece = self._piece_bytes or choose_piece(nbytes, sm_count=self.device.sm_count)
        pieces = split_long_spans(src, dst, length, piece)
        table = np.concatenate((pieces.src, pieces.dst, pieces.length)).astype(np.uint64, copy=False)
        return self._table_launch(nbytes, table, len(pieces), int(pieces.length.max()))

    def _table_launch(self, nbytes: int, table: np.ndarray, n: int, longest: int) -> _Launch:
        """The kernel's launch for a descriptor table of ``n`` pieces (sources, destinations, lengths)."""
        if n > MAX_SPANS:
            raise LLMException(f"{n} spans are more than one kernel launch takes ({MAX_SPANS})",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        grid, block = launch_geometry(n, longest, sm_count=self.device.sm_count)
        table.flags.writeable = False
        return _Launch(nbytes, table=table, grid=grid, block=block)

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
        work = _Work()
        self._submit(self._prepare(spans), work)
        work.stopped.wait()
        work._take_status()
        if work.error is not None:
            raise work.error

    def _submit(self, launch: _Launch, work: _Work) -> None:
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

    def _enqueue(self, launch: _Launch, work: _Work) -> bool:
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

    def _complete_by_callback(self, work: _Work, staged: bool) -> None:
        """Have the driver's callback thread complete ``work`` (no event could be recorded, or a blocking wait);
        if even that fails, drain the stream and complete it here."""
        key = next(_ids)
        with _pending_lock:
            _pending[key] = work
        try:
            self.device.driver.call("cuStreamAddCallback", self._stream, _STREAM_DONE, ctypes.c_void_p(key), 0)
        except CudaError as exc:
            with _pending_lock:
                _pending.pop(key, None)
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

    def _watch(self, job: CudaJob, launch: _Launch, start: ctypes.c_void_p | None = None) -> bool:
        """Record an event after ``job``'s copy and have its loop poll it (see the module's docstring); False
        if the event cannot be recorded (the caller adds a stream callback instead).  ``start``: a timed event
        recorded before the copy (the one after it is timed too)."""
        event = self._record_event(timed=start is not None)
        if event is None:
            log.debug("no event after a copy: a stream callback completes it")
            return False
        job.watch = _EventWatch(self, job, event, launch.nbytes, launch.kind, start)
        return True

    async def _ended(self, job: Any) -> None:
        """While the job's event is queried every loop iteration, the waiting task queries it too, between yields:
        the call then goes on in the iteration that saw the end, not in the next one, as it would once woken by
        the job's future (the loop's own query goes on too: it completes the job if the task is not there to)."""
        watch: _EventWatch | None = getattr(job, "watch", None)
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

    def _acquire(self, n: int) -> _Descriptors:
        with self._lock:
            fits = [d for d in self._free if d.capacity >= n]
            if fits:
                best = min(fits, key=lambda d: d.capacity)
                self._free.remove(best)
                return best
        capacity = max(MIN_DESCRIPTORS, 1 << (n - 1).bit_length())
        desc = _Descriptors(self.device, capacity)
        with self._lock:
            self._all.append(desc)
        return desc

    def _job_stopped(self, desc: _Descriptors | None, seq: int) -> None:
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

    def _keep_resident(self, launch: _Launch, desc: _Descriptors) -> bool:
        """Whether ``launch`` keeps ``desc`` as its table on the device (a cached launch, within the budget)."""
        with self._lock:
            if not launch.cached or self._resident_spans + desc.capacity > RESIDENT_SPANS:
                return False
            self._resident_spans += desc.capacity
            return True

    def _evicted(self, launch: _Launch) -> None:
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


class _EventWatch:
    """The loop's side of a job's completion event: a timer for most of the expected duration, then a query per
    loop iteration, then (a copy far past its expected end) a thread blocked in ``cuEventSynchronize``."""

    __slots__ = ("_query", "done", "event", "event_at", "executor", "job", "kind", "nbytes", "queries", "slept",
                 "start", "started", "until")

    def __init__(self, executor: CudaExecutor, job: CudaJob, event: ctypes.c_void_p, nbytes: int, kind: int,
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
