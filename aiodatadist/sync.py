"""The blocking API: :class:`LLMDataDist` and :class:`CacheManager` for callers in threads.

The same classes, methods, signatures, return values and exceptions as the asyncio API
(:class:`aiodatadist.LLMDataDist`, :class:`aiodatadist.CacheManager`), but every method blocks the calling thread
until it is done, and any number of threads may call at once.  Each sync instance wraps an asyncio instance, and
every call (bookkeeping methods included) runs as a coroutine on ONE event loop thread that this module owns, so
the asyncio objects are only ever touched from their own loop:

* the loop thread (a daemon thread named ``aiodatadist.sync``) starts on first use, is held by every initialized
  instance and by every call in flight, and stops (and is joined) when the last initialized instance is finalized
  and no call is left;
* at interpreter exit (after the main thread finished, before non-daemon threads are joined) the instances still
  initialized are finalized and the loop thread is stopped; calls made after that raise ``LLM_FAILED``.

Interrupting a blocking call (``KeyboardInterrupt`` in the main thread) cancels its coroutine, and the call
returns (re-raising the interrupt) only once the cancellation has finished: as with the asyncio API, nothing is
written into the destination after the call returned.  ``sync_kv_timeout`` bounds transfers as in the asyncio API.

``cache_manager.submit.pull_blocks(...)`` (and every other coroutine method of ``CacheManager``) starts the call
and returns a :class:`TransferFuture` (a ``concurrent.futures.Future``) at once, for engines that start a transfer
in one hook and collect it in another.  Its done callbacks run on the loop thread: they must not block, nor call
this API (that raises ``LLM_FAILED``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread  # registers its exit hook before ours: ours runs first (they run reversed)
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping
from types import TracebackType
from typing import Any, Self, TypeVar

from ._checks import IndexSequence
from ._settings import Settings
from .cache import Cache
from .cache_manager import CacheManager as AsyncCacheManager
from .datadist import LLMDataDist as AsyncLLMDataDist
from .errors import LLMException, LLMNotInitializedError, LLMStatusCode
from .layer_transfer import CacheTask as AsyncCacheTask
from .memory import HostMemory
from .notifications import Notification
from .stats import StatsSnapshot
from .transfer_configs import LayerSynchronizer, MemInfo, RegisterMemStatus
from .types import BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, LLMClusterInfo, LLMRole

__all__ = ["THREAD_NAME", "CacheManager", "CacheManagerSubmit", "CacheTask", "LLMDataDist", "TransferFuture", "loop_thread",
           "submit"]

log = logging.getLogger("aiodatadist.sync")

T = TypeVar("T")
THREAD_NAME = "aiodatadist.sync"
"""The name of the loop thread."""
EXIT_TIMEOUT_S = 30.0
"""At interpreter exit: how long finalizing the instances left, and then stopping the loop, may take."""

_local = threading.local()  # .loop_thread is True in a loop thread


def _in_loop_thread() -> bool:
    return bool(getattr(_local, "loop_thread", False))


def _not_from_loop_thread() -> None:
    if _in_loop_thread():
        raise LLMException("aiodatadist.sync called from its own event loop thread (a done callback of a "
                           "TransferFuture?); it would wait for itself", status_code=LLMStatusCode.LLM_FAILED)


class _LoopThread:
    """One event loop, run by one daemon thread until :meth:`stop`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.stopping = False  # set on the loop thread: calls that have not started yet fail
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        _local.loop_thread = True
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:  # what asyncio.run does on its way out: no task is left behind, nor an executor thread
                tasks = asyncio.all_tasks(loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    def _stop_on_loop(self) -> None:
        self.stopping = True
        self.loop.stop()

    def stop(self, join: bool, timeout: float | None = None) -> None:
        with contextlib.suppress(RuntimeError):  # already closed
            self.loop.call_soon_threadsafe(self._stop_on_loop)
        if join and threading.current_thread() is not self.thread:
            self.thread.join(timeout)


class _Runner:
    """The process-wide loop thread and who uses it: calls in flight and initialized instances."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: _LoopThread | None = None
        self._uses = 0
        self._held: dict[AsyncLLMDataDist, None] = {}  # initialized instances (an ordered set)
        self._retired: list[_LoopThread] = []  # loop threads that stopped themselves (joined at exit)
        self._exited = False
        self._hooked = False

    @property
    def thread(self) -> threading.Thread | None:
        """The loop thread now running (None when there is none)."""
        current = self._current
        return current.thread if current is not None else None

    def _acquire(self) -> _LoopThread:
        with self._lock:
            if self._exited:
                raise LLMException("aiodatadist.sync: the interpreter is exiting",
                                   status_code=LLMStatusCode.LLM_FAILED)
            if self._current is None:
                self._hook_exit()
                self._current = _LoopThread()
            self._uses += 1
            return self._current

    def _release(self) -> None:
        with self._lock:
            self._uses -= 1
            if self._uses > 0 or self._current is None:
                return
            last, self._current = self._current, None
            self._retired = [r for r in self._retired if r.thread.is_alive()]
            if _in_loop_thread():
                self._retired.append(last)
        # From a caller's thread the loop is joined here; from the loop thread itself (the done callback of a
        # submitted call) it stops on its own.
        last.stop(join=True)

    @contextlib.contextmanager
    def use(self) -> Iterator[_LoopThread]:
        current = self._acquire()
        try:
            yield current
        finally:
            self._release()

    def hold(self, dd: AsyncLLMDataDist) -> None:
        """On the loop thread, inside a call: an initialized instance keeps the loop running."""
        with self._lock:
            if dd not in self._held:
                self._held[dd] = None
                self._uses += 1

    def unhold(self, dd: AsyncLLMDataDist) -> None:
        """On the loop thread, inside a call (which still holds the loop): the instance was finalized."""
        with self._lock:
            if dd not in self._held:
                return
            del self._held[dd]
        self._release()

    def start(self, factory: Callable[[], Coroutine[Any, Any, T]]) -> TransferFuture[T]:
        """Run ``factory()`` on the loop thread; the future holds the loop until the coroutine ended."""
        _not_from_loop_thread()
        current = self._acquire()
        future: TransferFuture[T] = TransferFuture(current)
        try:
            current.loop.call_soon_threadsafe(future._start, factory, self._release)
        except BaseException:
            self._release()
            raise
        return future

    def call(self, factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``factory()`` on the loop thread and wait for it (see :func:`_wait`)."""
        _not_from_loop_thread()
        with self.use():  # so that the last release (and the join of the loop) happens on this thread
            return _wait(self.start(factory))

    # -- interpreter exit ------------------------------------------------------------------------------------
    def _hook_exit(self) -> None:
        """Called with the lock held, when a loop thread starts."""
        if self._hooked:
            return
        self._hooked = True
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("no threading._register_atexit")
            register(self.at_exit)  # runs before the interpreter joins non-daemon threads
        except RuntimeError:  # the interpreter is already shutting down its threads
            atexit.register(self.at_exit)

    def at_exit(self) -> None:
        """Finalize every instance still initialized, then stop the loop thread; later calls raise."""
        with self._lock:
            held = list(self._held)
            running = self._current is not None
        if held and running:
            try:
                self.start(lambda: _finalize_all(held, self)).result(timeout=EXIT_TIMEOUT_S)
            except BaseException as exc:  # noqa: BLE001 - the process is exiting; say why and go on
                log.warning("aiodatadist.sync: finalizing %d instance(s) at exit failed: %r", len(held), exc)
        with self._lock:
            self._exited = True
            last, self._current = self._current, None
            self._uses = 0
            self._held.clear()
            retired, self._retired = self._retired, []
        if last is not None:
            last.stop(join=True, timeout=EXIT_TIMEOUT_S)
        for thread in retired:
            thread.thread.join(EXIT_TIMEOUT_S)


async def _finalize_all(instances: list[AsyncLLMDataDist], runner: _Runner) -> None:
    async def one(dd: AsyncLLMDataDist) -> None:
        try:
            await dd.finalize()
        except Exception as exc:  # noqa: BLE001 - one failure must not keep the others alive
            log.warning("aiodatadist.sync: finalizing cluster %d at exit failed: %r", dd.cluster_id, exc)
        finally:
            if not dd.is_initialized:
                runner.unhold(dd)

    await asyncio.gather(*(one(dd) for dd in instances))


_RUNNER = _Runner()


def loop_thread() -> threading.Thread | None:
    """The loop thread now running, or None when no sync instance is initialized and no call is in flight."""
    return _RUNNER.thread


def submit(factory: Callable[[], Coroutine[Any, Any, T]]) -> TransferFuture[T]:
    """Run the coroutine ``factory()`` on the library's loop thread; returns its future at once.

    For integrations that chain several asyncio calls without a thread waiting between them (link, then pull):
    the coroutine may use the asyncio instances behind sync ones (:attr:`LLMDataDist.aio`).  ``factory`` is
    called on the loop thread.  Cancelling the future (:meth:`TransferFuture.cancel_and_wait`) cancels the
    coroutine; the future holds the loop thread until the coroutine ended."""
    return _RUNNER.start(factory)


class TransferFuture(concurrent.futures.Future[T]):
    """A call started on the loop thread (``CacheManager.submit.<method>(...)``).

    * ``result()``/``exception()``: the coroutine's return value or exception (``LLMException``,
      ``TypeError``, ... exactly as the blocking call raises them).
    * ``cancel()``: the standard ``concurrent.futures`` semantics. It succeeds (``True``) only while the call
      has not started on the loop thread yet, and then the call never starts. Once the call is running it
      returns ``False`` and changes nothing.
    * ``cancel_and_wait()``: cancels the call whatever its state and returns once the coroutine has ended, with
      the guarantee of the asyncio API (nothing is written into the destination after it returned).
      It returns ``True`` if the call was cancelled (then ``result()`` raises
      ``concurrent.futures.CancelledError``), ``False`` if the call had already ended (its result or error
      stands).
    """

    def __init__(self, owner: _LoopThread) -> None:
        super().__init__()
        self._owner = owner
        self._task: asyncio.Task[T] | None = None
        self._ended = threading.Event()  # the coroutine has ended, or will never start

    # -- on the loop thread ----------------------------------------------------------------------------------
    def _start(self, factory: Callable[[], Coroutine[Any, Any, T]], release: Callable[[], None]) -> None:
        if not self.set_running_or_notify_cancel():  # cancelled before it started
            self._ended.set()
            release()
            return
        if self._owner.stopping:
            self._ended.set()
            release()
            self.set_exception(LLMException("aiodatadist.sync: the loop thread stopped (interpreter exit)",
                                            status_code=LLMStatusCode.LLM_FAILED))
            return
        task = self._owner.loop.create_task(factory())
        self._task = task
        task.add_done_callback(lambda t: self._finished(t, release))

    def _finished(self, task: asyncio.Task[T], release: Callable[[], None]) -> None:
        # Release before the result is published: a blocking caller still holds its own use, so this release is
        # never the last one for it, and the caller's (on its own thread) joins the loop thread.
        release()
        self._ended.set()
        if task.cancelled():
            self.set_exception(concurrent.futures.CancelledError("the call was cancelled"))
            return
        exc = task.exception()
        if exc is None:
            self.set_result(task.result())
        else:
            self.set_exception(exc)

    def _cancel_task(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # -- any thread ------------------------------------------------------------------------------------------
    def cancel_and_wait(self) -> bool:
        """Cancel the call and wait until its coroutine ended; ``True`` if it was cancelled (see the class)."""
        if self.cancel():
            return True
        _not_from_loop_thread()
        if not self._ended.is_set():
            with contextlib.suppress(RuntimeError):  # the loop is closed: the task was cancelled on its way out
                self._owner.loop.call_soon_threadsafe(self._cancel_task)
            self._ended.wait()
        try:
            return isinstance(self.exception(), concurrent.futures.CancelledError)
        except concurrent.futures.CancelledError:
            return True


def _wait(future: TransferFuture[T]) -> T:
    """The result of a started call.  If the wait is interrupted (``KeyboardInterrupt``), the call is cancelled
    and the interrupt re-raised only once the coroutine ended (further interrupts meanwhile are ignored)."""
    try:
        return future.result()
    except BaseException:
        if not future._ended.is_set():
            while True:
                try:
                    future.cancel_and_wait()
                    break
                except KeyboardInterrupt:
                    continue
        raise


async def _plain(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return fn(*args, **kwargs)


class LLMDataDist:
    """A blocking :class:`aiodatadist.LLMDataDist`; every method may be called from any thread at once.

    ``with LLMDataDist(role, id) as dd`` finalizes on exit; call ``dd.init(options)`` inside.  Properties are read
    on the calling thread (they only read a field); every method runs on the library's loop thread.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        self._dd = AsyncLLMDataDist(role, cluster_id)
        self._cache_manager: CacheManager | None = None

    # -- properties ------------------------------------------------------------------------------------------
    @property
    def cluster_id(self) -> int:
        return self._dd.cluster_id

    @property
    def aio(self) -> AsyncLLMDataDist:
        """The asyncio instance this one wraps.  Use it only in coroutines run on the library's loop thread
        (:func:`submit`): it belongs to that loop."""
        return self._dd

    @property
    def role(self) -> LLMRole:
        return self._dd.role

    @property
    def is_initialized(self) -> bool:
        return self._dd.is_initialized

    @property
    def settings(self) -> Settings:
        return self._dd.settings

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """As :attr:`aiodatadist.LLMDataDist.listen_address`: ``(ip, port)`` this instance listens on (the port
        actually bound), or None when it is not a server.  Requires ``init``."""
        return self._dd.listen_address

    @property
    def cache_manager(self) -> CacheManager:
        """The blocking :class:`CacheManager` of this instance (requires ``init``)."""
        manager = self._dd.cache_manager
        wrapper = self._cache_manager
        if wrapper is None or wrapper._cm is not manager:
            wrapper = self._cache_manager = CacheManager(manager)  # two racing threads make equivalent wrappers
        return wrapper

    # -- lifetime --------------------------------------------------------------------------------------------
    def init(self, options: dict[str, str]) -> None:
        """As :meth:`aiodatadist.LLMDataDist.init`; the instance then holds the loop thread until finalized."""
        dd = self._dd

        async def init() -> None:
            try:
                await dd.init(options)
            finally:
                if dd.is_initialized:
                    _RUNNER.hold(dd)

        _RUNNER.call(init)

    def finalize(self) -> None:
        """As :meth:`aiodatadist.LLMDataDist.finalize`; the last instance finalized stops the loop thread."""
        dd = self._dd

        async def finalize() -> None:
            try:
                await dd.finalize()
            finally:
                if not dd.is_initialized:
                    _RUNNER.unhold(dd)

        _RUNNER.call(finalize)

    # -- links -----------------------------------------------------------------------------------------------
    def link_clusters(self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
                      timeout: int = 3000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """As :meth:`aiodatadist.LLMDataDist.link_clusters`."""
        dd = self._dd
        return _RUNNER.call(lambda: dd.link_clusters(clusters, timeout))

    def unlink_clusters(self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
                        timeout: int = 3000, force: bool = False) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """As :meth:`aiodatadist.LLMDataDist.unlink_clusters`."""
        dd = self._dd
        return _RUNNER.call(lambda: dd.unlink_clusters(clusters, timeout, force))

    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        """As :meth:`aiodatadist.LLMDataDist.switch_role`."""
        dd = self._dd
        _RUNNER.call(lambda: dd.switch_role(role, switch_options))

    def check_link_status(self, remote_cluster_id: int) -> None:
        """As :meth:`aiodatadist.LLMDataDist.check_link_status`."""
        dd = self._dd
        _RUNNER.call(lambda: dd.check_link_status(remote_cluster_id))

    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """As :meth:`aiodatadist.LLMDataDist.link`: starts the two-sided link, returns its ``comm_id`` at once."""
        dd = self._dd
        return _RUNNER.call(lambda: _plain(dd.link, comm_name, cluster_rank_info, rank_table))

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """As :meth:`aiodatadist.LLMDataDist.query_register_mem_status`."""
        dd = self._dd
        return _RUNNER.call(lambda: _plain(dd.query_register_mem_status, comm_id))

    def unlink(self, comm_id: int) -> None:
        """As :meth:`aiodatadist.LLMDataDist.unlink`."""
        dd = self._dd
        _RUNNER.call(lambda: dd.unlink(comm_id))

    def links(self) -> list[dict[str, object]]:
        """As :meth:`aiodatadist.LLMDataDist.links`."""
        return _RUNNER.call(lambda: _plain(self._dd.links))

    def stats(self) -> StatsSnapshot:
        """As :meth:`aiodatadist.LLMDataDist.stats`."""
        return _RUNNER.call(lambda: _plain(self._dd.stats))

    # -- notifications ---------------------------------------------------------------------------------------
    def notify(self, cluster_id: int, message: bytes) -> None:
        """As :meth:`aiodatadist.LLMDataDist.notify`."""
        dd = self._dd
        _RUNNER.call(lambda: dd.notify(cluster_id, message))

    def get_notification(self, timeout: float | None = None) -> Notification | None:
        """As :meth:`aiodatadist.LLMDataDist.get_notification`: the next notification, waiting at most ``timeout``
        seconds (None: until one arrives or the instance is finalized); None if none came."""
        dd = self._dd
        return _RUNNER.call(lambda: dd.get_notification(timeout))

    def notifications(self, timeout: float | None = None) -> Iterator[Notification]:
        """A blocking iterator over the notifications of :meth:`aiodatadist.LLMDataDist.notifications`: it ends
        when the instance is finalized, or when none arrived within ``timeout`` seconds (None: it waits until
        one does).  Requires ``init``; several threads may iterate at once (each notification goes to one)."""
        if not self._dd.is_initialized:
            raise LLMNotInitializedError()
        return self._iterate(timeout)

    def _iterate(self, timeout: float | None) -> Iterator[Notification]:
        while True:
            try:
                notification = self.get_notification(timeout)
            except LLMNotInitializedError:  # finalized between two notifications
                return
            if notification is None:
                return
            yield notification

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.finalize()

    def __repr__(self) -> str:
        return "sync." + repr(self._dd)


class CacheManager:
    """The blocking :class:`aiodatadist.CacheManager` of a sync :class:`LLMDataDist` (``dd.cache_manager``).

    Every method runs on the library's loop thread and may be called from any thread at once; ``submit`` has
    the coroutine methods in a form that returns a :class:`TransferFuture` at once.
    """

    def __init__(self, manager: AsyncCacheManager) -> None:
        self._cm = manager
        self.submit = CacheManagerSubmit(manager)

    @property
    def device_id(self) -> int:
        """The CUDA ordinal of ``Placement.DEVICE`` caches (a setting: read on the caller's thread)."""
        return self._cm.device_id

    # -- allocation and registration -------------------------------------------------------------------------
    def allocate_cache(self, cache_desc: CacheDesc,
                       cache_keys: tuple[CacheKey, ...] | list[CacheKey] = ()) -> Cache:
        return _RUNNER.call(lambda: _plain(self._cm.allocate_cache, cache_desc, cache_keys))

    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        return _RUNNER.call(lambda: _plain(self._cm.allocate_blocks_cache, cache_desc, blocks_cache_key))

    def allocate_host_memory(self, nbytes: int) -> HostMemory:
        return _RUNNER.call(lambda: _plain(self._cm.allocate_host_memory, nbytes))

    def register_cache(self, cache_desc: CacheDesc, addrs: list[int],
                       cache_keys: tuple[CacheKey, ...] | list[CacheKey] = (),
                       remote_accessible: bool | None = None) -> Cache:
        return _RUNNER.call(lambda: _plain(self._cm.register_cache, cache_desc, addrs, cache_keys,
                                           remote_accessible))

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: list[int],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache:
        return _RUNNER.call(lambda: _plain(self._cm.register_blocks_cache, cache_desc, addrs, blocks_cache_key,
                                           remote_accessible))

    # -- release ---------------------------------------------------------------------------------------------
    def unregister_cache(self, cache_id: int) -> None:
        """Forget a cache by id; returns once no peer can write into caller-owned memory any more (see
        :meth:`aiodatadist.cache_manager.CacheManager.unregister_cache_and_wait`)."""
        cm = self._cm
        _RUNNER.call(lambda: cm.unregister_cache_and_wait(cache_id))

    def unregister_cache_and_wait(self, cache_id: int, timeout: float = 5.0) -> None:
        """:meth:`unregister_cache` with its bound: ``LLMTimeoutError`` when a peer did not stop within
        ``timeout`` seconds (its link was dropped)."""
        cm = self._cm
        _RUNNER.call(lambda: cm.unregister_cache_and_wait(cache_id, timeout))

    def deallocate_cache(self, cache: Cache) -> None:
        _RUNNER.call(lambda: _plain(self._cm.deallocate_cache, cache))

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        _RUNNER.call(lambda: _plain(self._cm.deallocate_blocks_cache, cache))

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        _RUNNER.call(lambda: _plain(self._cm.remove_cache_key, cache_key))

    # -- local copies ----------------------------------------------------------------------------------------
    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: int | None = None) -> None:
        cm = self._cm
        _RUNNER.call(lambda: cm.copy_cache(dst, src, dst_batch_index, src_batch_index, offset, size, req_id))

    def copy_blocks(self, cache: Cache, copy_block_info: Mapping[int, IndexSequence]) -> None:
        cm = self._cm
        _RUNNER.call(lambda: cm.copy_blocks(cache, copy_block_info))

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: Mapping[int, int]) -> None:
        cm = self._cm
        _RUNNER.call(lambda: cm.swap_blocks(src_cache, dst_cache, src_to_dst))

    # -- pulls and pushes ------------------------------------------------------------------------------------
    def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, cache: Cache, batch_index: int = 0,
                   size: int = -1, *, notify: bytes | None = None, **kwargs: Any) -> None:
        cm = self._cm
        _RUNNER.call(lambda: cm.pull_cache(cache_key, cache, batch_index, size, notify=notify, **kwargs))

    def pull_blocks(self, src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, dst_cache: Cache,
                    src_blocks: IndexSequence | None = (),
                    dst_blocks: IndexSequence = (), *, notify: bytes | None = None,
                    **kwargs: Any) -> None:
        cm = self._cm
        _RUNNER.call(lambda: cm.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, notify=notify,
                                               **kwargs))

    def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None,
                   size: int = -1, tensor_num_per_layer: int = 2, *, notify: bytes | None = None) -> None:
        cm = self._cm
        _RUNNER.call(lambda: cm.push_cache(dst_cache_key, src_cache, src_batch_index, src_layer_range,
                                           dst_layer_range, size, tensor_num_per_layer, notify=notify))

    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache,
                    src_blocks: IndexSequence | None = (),
                    dst_blocks: IndexSequence = (), src_layer_range: range | None = None,
                    dst_layer_range: range | None = None, tensor_num_per_layer: int = 2, *,
                    notify: bytes | None = None) -> None:
        cm = self._cm
        _RUNNER.call(lambda: cm.push_blocks(dst_cache_key, src_cache, src_blocks, dst_blocks, src_layer_range,
                                            dst_layer_range, tensor_num_per_layer, notify=notify))

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """As :meth:`aiodatadist.CacheManager.remap_registered_memory` (checked, then ``LLM_FEATURE_NOT_ENABLED``)."""
        _RUNNER.call(lambda: _plain(self._cm.remap_registered_memory, mem_infos))

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: list[Any] | tuple[Any, ...],
                             src_block_indices: IndexSequence | None = None,
                             dst_block_indices: IndexSequence | None = None,
                             dst_block_memory_size: int | None = None) -> CacheTask:
        """As :meth:`aiodatadist.CacheManager.transfer_cache_async`; returns a blocking :class:`CacheTask` at once
        (the synchronizer is called in a worker thread, never on the loop thread)."""
        cm = self._cm

        async def start() -> AsyncCacheTask:
            return cm.transfer_cache_async(src_cache, layer_synchronizer, transfer_configs, src_block_indices,
                                           dst_block_indices, dst_block_memory_size)

        return CacheTask(_RUNNER.call(start))

    def __repr__(self) -> str:
        return "sync." + repr(self._cm)


class CacheTask:
    """A running ``transfer_cache_async`` job for threads: the blocking form of :class:`aiodatadist.CacheTask`."""

    def __init__(self, task: AsyncCacheTask) -> None:
        self._task = task

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait (None: for ever) and return the job's first failure code, else ``LLM_SUCCESS``; ``LLM_TIMEOUT``
        if it still runs after ``timeout_in_millis`` ms (it goes on)."""
        task = self._task
        return _RUNNER.call(lambda: task.synchronize(timeout_in_millis))

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """Per transfer config: its status, None if never attempted; all ``LLM_TIMEOUT`` on timeout."""
        task = self._task
        return _RUNNER.call(lambda: task.get_results(timeout_in_millis))

    def cancel(self) -> bool:
        """Stop the job; returns once no push of it writes any more (False if it had already ended)."""
        task = self._task
        return _RUNNER.call(task.cancel)

    def done(self) -> bool:
        return self._task.done()

    def __repr__(self) -> str:
        return "sync." + repr(self._task)


class CacheManagerSubmit:
    """``cache_manager.submit``: each coroutine method of :class:`aiodatadist.CacheManager`, started on the loop
    thread, returning a :class:`TransferFuture` at once (arguments are checked when it runs: a bad argument is
    the future's exception)."""

    def __init__(self, manager: AsyncCacheManager) -> None:
        self._cm = manager

    def _run(self, factory: Callable[[], Coroutine[Any, Any, T]]) -> TransferFuture[T]:
        with _RUNNER.use():  # the last release, if this is it, joins the loop thread here rather than on it
            return _RUNNER.start(factory)

    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: int | None = None) -> TransferFuture[None]:
        cm = self._cm
        return self._run(lambda: cm.copy_cache(dst, src, dst_batch_index, src_batch_index, offset, size, req_id))

    def copy_blocks(self, cache: Cache, copy_block_info: Mapping[int, IndexSequence]) -> TransferFuture[None]:
        cm = self._cm
        return self._run(lambda: cm.copy_blocks(cache, copy_block_info))

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: Mapping[int, int]) -> TransferFuture[None]:
        cm = self._cm
        return self._run(lambda: cm.swap_blocks(src_cache, dst_cache, src_to_dst))

    def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, cache: Cache, batch_index: int = 0,
                   size: int = -1, *, notify: bytes | None = None, **kwargs: Any) -> TransferFuture[None]:
        cm = self._cm
        return self._run(lambda: cm.pull_cache(cache_key, cache, batch_index, size, notify=notify, **kwargs))

    def pull_blocks(self, src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, dst_cache: Cache,
                    src_blocks: IndexSequence | None = (),
                    dst_blocks: IndexSequence = (), *, notify: bytes | None = None,
                    **kwargs: Any) -> TransferFuture[None]:
        cm = self._cm
        return self._run(lambda: cm.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, notify=notify,
                                               **kwargs))

    def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None,
                   size: int = -1, tensor_num_per_layer: int = 2, *,
                   notify: bytes | None = None) -> TransferFuture[None]:
        cm = self._cm
        return self._run(lambda: cm.push_cache(dst_cache_key, src_cache, src_batch_index, src_layer_range,
                                               dst_layer_range, size, tensor_num_per_layer, notify=notify))

    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache,
                    src_blocks: IndexSequence | None = (),
                    dst_blocks: IndexSequence = (), src_layer_range: range | None = None,
                    dst_layer_range: range | None = None, tensor_num_per_layer: int = 2, *,
                    notify: bytes | None = None) -> TransferFuture[None]:
        cm = self._cm
        return self._run(lambda: cm.push_blocks(dst_cache_key, src_cache, src_blocks, dst_blocks, src_layer_range,
                                                dst_layer_range, tensor_num_per_layer, notify=notify))
