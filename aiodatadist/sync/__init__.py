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

The loop thread, its lifecycle and :class:`TransferFuture` live in :mod:`aiodatadist.sync.runner`; this module
holds the wrappers.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

from .._checks import IndexSequence
from ..cache import Cache
from ..cache_manager import CacheManager as AsyncCacheManager
from ..datadist import LLMDataDist as AsyncLLMDataDist
from ..errors import LLMNotInitializedError, LLMStatusCode
from ..layer_transfer import CacheTask as AsyncCacheTask
from ..memory import HostMemory
from ..notifications import Notification
from ..settings.options import Settings
from ..stats import StatsSnapshot
from ..transfer_configs import LayerSynchronizer, MemInfo, RegisterMemStatus
from ..types import BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, LLMClusterInfo, LLMRole
from .runner import RUNNER as _RUNNER
from .runner import THREAD_NAME, TransferFuture, loop_thread, submit

__all__ = ["THREAD_NAME", "CacheManager", "CacheManagerSubmit", "CacheTask", "LLMDataDist", "TransferFuture", "loop_thread",
           "submit"]

T = TypeVar("T")


async def _plain(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """A plain (not async) method of an asyncio instance as a coroutine, so that it runs on the loop thread."""
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

    def share_host_memory(self, ranges: Sequence[tuple[int, int]]) -> HostMemory:
        return _RUNNER.call(lambda: _plain(self._cm.share_host_memory, ranges))

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
