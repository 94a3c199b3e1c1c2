"""``CacheManager``: allocate/register caches and move their bytes (local copies here; pulls and pushes
through the linked peer, see :mod:`aiodatadist.transfer`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._checks import (
    IndexSequence,
    check_bool,
    check_event_loop,
    check_index_list,
    check_int,
    check_int_list,
    check_isinstance,
    require,
)
from .cache import Cache
from .copy.device import DeviceSupport
from .copy.engine import CopyEngine
from .errors import LLMException, LLMNotInitializedError, LLMStatusCode, LLMTimeoutError
from .layer_transfer import CacheTask, run_layers
from .layout.plans import (
    CacheGeometry,
    CopyPlan,
    all_tensor_indices,
    copy_blocks_runs,
    copy_cache_run,
    make_plan,
    swap_blocks_runs,
)
from .memory import HostMemory, cache_segment
from .native import int_bounds
from .notifications import check_notification
from .registry.caches import CacheEntry, CacheRegistry, geometry_of
from .settings.options import Settings
from .transfer import validate
from .transfer.service import TransferService
from .transfer_configs import LayerSynchronizer, MemInfo, Memtype, TransferWithCacheKeyConfig
from .types import BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, Placement

__all__ = ["CacheManager"]

log = logging.getLogger("aiodatadist.cache")

PLACEMENT_HINT = ("a CacheDesc without placement is a DEVICE cache, as in LLM-DataDist: "
                  "pass placement=Placement.HOST for host memory")
MAX_SHAPE_RANK = 32


def _check_desc(cache_desc: Any) -> CacheDesc:
    check_isinstance("cache_desc", cache_desc, CacheDesc)
    desc: CacheDesc = cache_desc
    require(desc.num_tensors > 0, "cache_desc.num_tensors must be > 0.")
    require(1 <= len(desc.shape) < MAX_SHAPE_RANK, f"cache_desc.shape must have 1 to {MAX_SHAPE_RANK - 1} dims.")
    require(all(int(d) > 0 for d in desc.shape), f"cache_desc.shape {list(desc.shape)} must be all > 0.")
    desc.data_type.np_dtype  # noqa: B018 - raises LLM_PARAM_INVALID for DT_STRING
    return desc


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # built outside a coroutine (tests): bound to no loop
        return None


def _check_cache_keys(cache_keys: Any) -> list[CacheKey]:
    check_isinstance("cache_keys", cache_keys, (list, tuple))
    for key in cache_keys:
        if not isinstance(key, CacheKey):
            raise TypeError(f"cache_keys inner type only support ['CacheKey'], but got {type(key)}.")
    return list(cache_keys)


class CacheManager:
    """Caches of one :class:`LLMDataDist` instance and the operations on them.

    Bookkeeping methods are plain (they never block on I/O); copies and transfers are coroutines.
    """

    def __init__(self, cluster_id: int, settings: Settings, registry: CacheRegistry, engine: CopyEngine,
                 transfers: TransferService) -> None:
        self._cluster_id = cluster_id
        self._settings = settings
        self._registry = registry
        self._engine = engine
        self._transfers = transfers
        self._closed = False
        self._host_memories: list[HostMemory] = []  # from allocate_host_memory, closed by finalize
        self._loop = _running_loop()  # the loop of LLMDataDist.init: every coroutine method must run on it
        self._layer_jobs: set[asyncio.Task[None]] = set()  # transfer_cache_async jobs, cancelled by close

    # -- helpers ---------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise LLMNotInitializedError()

    def _check_open_on_loop(self) -> None:
        """At the entry of every coroutine method: open, and called on the loop the instance was made on."""
        if self._closed:
            raise LLMNotInitializedError()
        check_event_loop(self._loop)

    def _entry(self, name: str, cache: Any) -> CacheEntry:
        check_isinstance(name, cache, Cache)
        return self._registry.entry_of(cache, cache.cache_id)

    @property
    def device_id(self) -> int:
        """The CUDA ordinal of ``Placement.DEVICE`` caches (``LLMConfig.device_id``); CUDA is not touched."""
        return self._settings.device_id

    def _device(self) -> DeviceSupport:
        """This instance's GPU (``device_id``), set up on first use; raises ``LLM_FEATURE_NOT_ENABLED`` saying
        why when CUDA cannot be used."""
        return self._engine.device()

    def _device_for_cache(self) -> DeviceSupport:
        """:meth:`_device` for a DEVICE cache being allocated or registered: when CUDA cannot be used, the error
        also says that DEVICE is the default placement (a forgotten ``Placement.HOST``)."""
        try:
            return self._device()
        except LLMException as exc:
            if exc.status_code != LLMStatusCode.LLM_FEATURE_NOT_ENABLED:
                raise
            raise type(exc)(f"{exc} ({PLACEMENT_HINT})", status_code=exc.status_code) from exc

    async def _run_copy(self, plan: CopyPlan, src: CacheEntry, dst: CacheEntry) -> None:
        """Copy a plan between two local caches while holding leases on them; cancellable at chunk boundaries
        (a GPU copy, when either cache is on the device, is waited for)."""
        self._check_open_on_loop()
        entries = (dst,) if src is dst else (dst, src)
        engine = self._engine
        with self._registry.lease(*entries):
            if src.on_device or dst.on_device:
                job = engine.start_job(plan, engine.device_addrs(src), engine.device_addrs(dst), None, entries,
                                       on_device=True)
            elif engine.copy_now(plan, src.addrs, dst.addrs, None):
                return
            else:
                job = engine.start_job(plan, src.addrs, dst.addrs, None, entries)
            await engine.wait_job(job, entries)

    def _handle(self, entry: CacheEntry) -> Cache:
        """The user's handle of a new entry."""
        cache = Cache(entry.cache_id, entry.desc, entry.addrs.tolist(), entry.is_blocks, segment=entry.segment,
                      owner=self)
        entry.handle = cache
        return cache

    # -- allocation ------------------------------------------------------------------------------------------
    def _allocate(self, desc: CacheDesc, *, is_blocks: bool, keys: list[CacheKey],
                  blocks_key: BlocksCacheKey | None) -> Cache:
        geometry = geometry_of(desc, is_blocks)
        bound = self._registry.check_keys(keys, geometry.slots) if keys else []
        if desc.placement == Placement.DEVICE:
            memory, addrs = self._device_for_cache().allocate(desc.size, desc.num_tensors)
            cache = self._handle(self._registry.add(
                desc.copy(), addrs, is_blocks=is_blocks, remote_accessible=True, segment=None, device_memory=memory,
                keys=bound, blocks_key=blocks_key))
            log.debug("allocated device cache %d (%d x %d bytes)", cache.cache_id, desc.num_tensors, desc.size)
            return cache
        segment = cache_segment(desc.size * desc.num_tensors, f"aiodatadist-{self._cluster_id}")
        addrs = [segment.address + i * desc.size for i in range(desc.num_tensors)]
        cache = self._handle(self._registry.add(desc.copy(), addrs, is_blocks=is_blocks, remote_accessible=True,
                                                segment=segment, keys=bound, blocks_key=blocks_key))
        log.debug("allocated cache %d (%d x %d bytes)", cache.cache_id, desc.num_tensors, desc.size)
        return cache

    def allocate_cache(self, cache_desc: CacheDesc,
                       cache_keys: tuple[CacheKey, ...] | list[CacheKey] = ()) -> Cache:
        """Allocate a contiguous cache (host: shared memory; ``Placement.DEVICE``: CUDA device memory of
        ``device_id``); key ``i`` binds batch slot ``i``."""
        self._check_open()
        desc = _check_desc(cache_desc)
        keys = _check_cache_keys(cache_keys)
        return self._allocate(desc, is_blocks=False, keys=keys, blocks_key=None)

    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        """Allocate a paged cache (``shape[0]`` blocks; host: shared memory, ``Placement.DEVICE``: CUDA device
        memory), indexed by ``model_id``."""
        self._check_open()
        desc = _check_desc(cache_desc)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey, allow_none=True)
        return self._allocate(desc, is_blocks=True, keys=[], blocks_key=blocks_cache_key)

    # -- shareable host memory for engines -------------------------------------------------------------------
    def allocate_host_memory(self, nbytes: int) -> HostMemory:
        """Shareable host memory (``memfd`` shared memory, huge pages advised, pre-faulted, zero-filled) of at
        least ``nbytes`` bytes, for an engine's own KV tensors.

        Caches registered (``register_cache``/``register_blocks_cache``) with every tensor inside one such block
        take the mapped path: same-host peers map it and copy with their own threads, as for allocated caches.
        ``HostMemory.close()`` raises ``LLM_PARAM_INVALID`` while caches are registered in it; ``finalize``
        closes it.
        """
        self._check_open()
        size = check_int("nbytes", nbytes, "int64")
        require(size > 0, f"nbytes must be > 0, got {size}.")
        memory = HostMemory(size, name=f"aiodatadist-{self._cluster_id}-host")
        self._host_memories = [m for m in self._host_memories if not m.closed]
        self._host_memories.append(memory)
        log.debug("allocated %d bytes of shareable host memory at %#x", memory.size, memory.address)
        return memory

    def share_host_memory(self, ranges: Sequence[tuple[int, int]]) -> HostMemory:
        """Make host memory this process already allocated (an engine's KV tensors: ``(address, size)`` ranges)
        shareable where it lies, and return it as a :class:`HostMemory`: caches registered afterwards with every
        tensor inside one of the ranges take the mapped path, as inside :meth:`allocate_host_memory` memory.

        Each range's whole pages are moved into shared memory in place (same addresses, same content); the
        partial pages at its ends stay private, and the few bytes of a tensor there are copied the unshared way.
        Call it before the memory is in use: a write to it by another thread during the call may be lost.
        Ranges must not overlap; ranges scattered across the address space (holes larger than eight times the memory
        shared, and 64 MiB) and ranges without a whole page raise ``LLM_PARAM_INVALID``.  ``HostMemory.close()``
        (or ``finalize``) stops sharing it; the memory stays the caller's, and its pages stay shared file pages: a
        ``fork`` shares them with the child, so never hand such memory back to ``malloc`` (share memory kept for
        the process's life, or of its own ``mmap``).
        """
        self._check_open()
        check_isinstance("ranges", ranges, (list, tuple))
        checked = []
        for item in ranges:
            if not (isinstance(item, (list, tuple)) and len(item) == 2):
                raise TypeError(f"ranges must hold (address, size) pairs, got {item!r}.")
            checked.append((check_int("address", item[0], "uint64"), check_int("size", item[1], "int64")))
        require(all(size > 0 for _, size in checked), "every range's size must be > 0.")
        memory = HostMemory.in_place(checked, name=f"aiodatadist-{self._cluster_id}-in-place")
        self._host_memories = [m for m in self._host_memories if not m.closed]
        self._host_memories.append(memory)
        log.debug("shared %d range(s) of host memory in place (%d bytes from %#x)", len(checked), memory.size,
                  memory.address)
        return memory

    def _host_memory_of(self, addrs: list[int], tensor_size: int) -> HostMemory | None:
        """The open HostMemory of this instance that holds every tensor, if any."""
        for memory in self._host_memories:
            if memory.contains(addrs, tensor_size):
                return memory
        return None

    # -- registration of caller-owned memory -----------------------------------------------------------------
    def _check_addrs(self, desc: CacheDesc, addrs: Any) -> list[int]:
        check_isinstance("addrs", addrs, list)
        values = check_int_list("addrs", addrs, "uint64", container=(list,))
        require(len(values) > 0, "addrs must not be empty.")
        require(len(values) == desc.num_tensors,
                f"len(addrs) {len(values)} != cache_desc.num_tensors {desc.num_tensors}.")
        require(all(a != 0 for a in values), "addrs must not contain 0.")
        return values

    def _register(self, cache_desc: Any, addrs: Any, remote_accessible: Any, *, is_blocks: bool,
                  keys: list[CacheKey], blocks_key: BlocksCacheKey | None) -> Cache:
        self._check_open()
        desc = _check_desc(cache_desc)
        values = self._check_addrs(desc, addrs)
        accessible = True if remote_accessible is None else check_bool("remote_accessible", remote_accessible)
        geometry = geometry_of(desc, is_blocks)
        bound = self._registry.check_keys(keys, geometry.slots) if keys else []
        self._registry.check_registered_addrs(len(values))
        host_memory = None
        if desc.placement == Placement.DEVICE:
            self._device_for_cache().check_registered(values, desc.size)
        else:
            host_memory = self._host_memory_of(values, desc.size)
        return self._handle(self._registry.add(desc.copy(), values, is_blocks=is_blocks,
                                               remote_accessible=accessible, segment=None, keys=bound,
                                               blocks_key=blocks_key, host_memory=host_memory))

    def register_cache(self, cache_desc: CacheDesc, addrs: list[int],
                       cache_keys: tuple[CacheKey, ...] | list[CacheKey] = (),
                       remote_accessible: bool | None = None) -> Cache:
        """Register caller-owned contiguous memory (one address per tensor); key ``i`` binds slot ``i``.

        The memory must stay valid until ``unregister_cache``; peers may access it unless
        ``remote_accessible=False``.  Inside memory from :meth:`allocate_host_memory`, same-host peers map it.
        """
        keys = _check_cache_keys(cache_keys)
        return self._register(cache_desc, addrs, remote_accessible, is_blocks=False, keys=keys, blocks_key=None)

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: list[int],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache:
        """Register caller-owned paged memory (one address per tensor, ``shape[0]`` blocks each); inside memory
        from :meth:`allocate_host_memory`, same-host peers map it."""
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey, allow_none=True)
        return self._register(cache_desc, addrs, remote_accessible, is_blocks=True, keys=[],
                              blocks_key=blocks_cache_key)

    # -- release ---------------------------------------------------------------------------------------------
    def _release(self, entry: CacheEntry) -> None:
        if not entry.owned:  # caller-owned memory: peers reading or writing it directly must stop too
            self._transfers.abort_remote(entry)
        jobs = self._registry.release(entry)
        if jobs:
            self._engine.abort_jobs(jobs, f"cache {entry.cache_id} was unregistered during the transfer")
        if not entry.owned:
            self._registry.free_now(entry)  # unpin caller-owned host memory the GPU used

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a cache by id (unknown ids are ignored).  Transfers on caller-owned memory are aborted
        first, so the memory may be freed as soon as this returns."""
        self._check_open()
        cid = check_int("cache_id", cache_id, "int64")
        try:
            entry = self._registry.by_id(cid)
        except LLMException:
            return
        self._release(entry)

    async def unregister_cache_and_wait(self, cache_id: int, timeout: float = 5.0) -> None:
        """:meth:`unregister_cache`, returning only once no peer can write into the memory any more.

        ``unregister_cache`` asks peers to stop their transfers on the cache and returns: a same-host peer may be
        in the middle of writing one piece into it with ``process_vm_writev`` when it does.  This waits until
        every peer transfer that used the cache has ended (the peer ends it only after its copy stopped) or its
        link closed, at most ``timeout`` seconds; then the caller may free the memory.  Past ``timeout`` the
        links of the peers that did not answer are dropped and ``LLMTimeoutError`` is raised: the memory may
        still be written by them.  The blocking API's ``unregister_cache`` is this call."""
        self._check_open()
        cid = check_int("cache_id", cache_id, "int64")
        require(isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0,
                f"timeout must be a number > 0, but got {timeout!r}.")
        try:
            entry = self._registry.by_id(cid)
        except LLMException:
            return
        idle: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def ended() -> None:
            if not idle.done():
                idle.set_result(None)

        entry.on_idle.append(ended)
        self._release(entry)
        if entry.leases == 0:
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(idle)
        except TimeoutError:
            holders = await self._transfers.drop_links_using(entry, f"cache {cid} was unregistered and the peer "
                                                                    f"did not end its transfer within {timeout:g} s")
            raise LLMTimeoutError(f"unregister_cache({cid}): peers {holders} did not end their transfers within "
                                  f"{timeout:g} s; their links were dropped") from None

    def _deallocate(self, name: str, cache: Any, *, blocks: bool) -> None:
        self._check_open()
        check_isinstance(name, cache, Cache)
        try:
            entry = self._registry.entry_of(cache, cache.cache_id)
        except LLMException:
            return
        require(entry.is_blocks == blocks,
                f"{'deallocate_blocks_cache' if blocks else 'deallocate_cache'} got a "
                f"{'contiguous' if blocks else 'blocks'} cache.")
        self._release(entry)

    def deallocate_cache(self, cache: Cache) -> None:
        """Release a contiguous cache; its memory lives on while bound keys or running transfers need it."""
        self._deallocate("cache", cache, blocks=False)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Release a blocks cache; its memory lives on while running transfers need it."""
        self._deallocate("cache", cache, blocks=True)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbind a ``CacheKey`` (unknown keys are ignored); frees a deallocated cache's last reference."""
        self._check_open()
        check_isinstance("cache_key", cache_key, CacheKey)
        self._registry.remove_key(cache_key)

    # -- local copies ----------------------------------------------------------------------------------------
    async def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
                         offset: int = 0, size: int = -1, req_id: int | None = None) -> None:
        """Copy ``size`` bytes at ``offset`` of a batch slot of every tensor from ``src`` to ``dst``."""
        self._check_open_on_loop()
        dst_entry, src_entry = self._entry("dst", dst), self._entry("src", src)
        dst_slot = check_int("dst_batch_index", dst_batch_index, "uint32")
        src_slot = check_int("src_batch_index", src_batch_index, "uint32")
        off = check_int("offset", offset, "uint64")
        nbytes = check_int("size", size, "int64")
        if req_id is not None:
            check_int("req_id", req_id, "uint64")
        require(not dst_entry.is_blocks and not src_entry.is_blocks, "copy_cache needs two contiguous caches.")
        require(dst_entry.desc == src_entry.desc and dst_entry.desc.data_type == src_entry.desc.data_type,
                "copy_cache needs caches with the same CacheDesc.")
        runs = copy_cache_run(dst_entry.geometry, dst_slot, src_slot, off, nbytes)
        await self._run_copy(make_plan(*all_tensor_indices(src_entry.geometry, dst_entry.geometry), runs),
                            src_entry, dst_entry)

    async def copy_blocks(self, cache: Cache, copy_block_info: Mapping[int, IndexSequence]) -> None:
        """Within one blocks cache, copy each source block to each of its destination blocks."""
        self._check_open_on_loop()
        entry = self._entry("cache", cache)
        check_isinstance("copy_block_info", copy_block_info, dict)
        info: dict[int, list[int]] = {}
        for src_block, dst_blocks in copy_block_info.items():
            key = check_int("copy_block_info key", src_block, "uint64")
            info[key] = check_index_list("copy_block_info value", dst_blocks, "uint64")
        require(entry.is_blocks, "copy_blocks needs a blocks cache.")
        geometry: CacheGeometry = entry.geometry
        runs = copy_blocks_runs(info, geometry)
        await self._run_copy(make_plan(*all_tensor_indices(geometry, geometry), runs), entry, entry)

    async def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: Mapping[int, int]) -> None:
        """Copy block ``k`` of ``src_cache`` to block ``src_to_dst[k]`` of ``dst_cache`` (equal block sizes).

        Either cache may be a ``Cache.create_cpu_cache`` handle over caller-owned host memory.
        """
        self._check_open_on_loop()
        src_entry = self._swap_entry("src_cache", src_cache)
        dst_entry = self._swap_entry("dst_cache", dst_cache)
        check_isinstance("src_to_dst", src_to_dst, dict)
        keys, values = int_bounds(list(src_to_dst)), int_bounds(list(src_to_dst.values()))
        if keys is not None and values is not None and keys[0] >= 0 and values[0] >= 0:  # plain ints: one C pass
            mapping = src_to_dst
        else:
            mapping = {check_int("src_to_dst key", k, "uint64"): check_int("src_to_dst value", v, "uint64")
                       for k, v in src_to_dst.items()}
        require(src_entry.is_blocks and dst_entry.is_blocks, "swap_blocks needs two blocks caches.")
        if src_entry is dst_entry or np.array_equal(src_entry.addrs, dst_entry.addrs):
            # within one cache (or two handles of the same memory) the result must not depend on copy order
            require(not set(mapping.values()) & set(mapping.keys()),
                    "a destination block is also a source block of the same swap.")
        runs = swap_blocks_runs(mapping, src_entry.geometry, dst_entry.geometry)
        try:
            await self._run_copy(make_plan(*all_tensor_indices(src_entry.geometry, dst_entry.geometry), runs),
                                src_entry, dst_entry)
        finally:
            for entry in {src_entry, dst_entry}:
                if entry.cache_id == -1:  # a create_cpu_cache handle: pinned (if at all) for this call only
                    self._registry.free_now(entry)

    def _swap_entry(self, name: str, cache: Any) -> CacheEntry:
        check_isinstance(name, cache, Cache)
        if cache.cache_id == -1 and cache.tensor_addrs:  # Cache.create_cpu_cache: caller-owned, unregistered
            return CacheEntry(-1, cache.cache_desc, np.asarray(cache.tensor_addrs, dtype=np.uint64), True, False)
        return self._registry.entry_of(cache, cache.cache_id)

    # -- pulls and pushes (requester side: checks here, the conversation in aiodatadist.transfer) ------------
    async def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, cache: Cache, batch_index: int = 0,
                         size: int = -1, *, notify: bytes | None = None, **kwargs: Any) -> None:
        """Pull one batch slot of a remote contiguous cache into slot ``batch_index`` of ``cache``.

        Bounded by ``sync_kv_timeout`` (``LLMTimeoutError``); cancelling behaves the same.  After a timeout or
        cancellation the destination slot holds an unspecified mix of old and new bytes, and nothing is
        written into it after the call has returned.  A successful pull by ``CacheKey`` releases that key on
        the owner.  ``notify``: a notification (``bytes``, at most 4 KiB) the owner receives once the pull
        succeeded (never for a failed, cancelled or timed-out one; see ``LLMDataDist.notifications``).
        """
        self._check_open_on_loop()
        local, params = validate.pull_cache(self._entry, self._remote_accessible(), cache_key, cache, batch_index,
                                            size, kwargs)
        note = check_notification("notify", notify)
        await self._transfers.run(cache_key, local, params, note)

    async def pull_blocks(self, src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, dst_cache: Cache,
                          src_blocks: IndexSequence | None = (),
                          dst_blocks: IndexSequence = (), *, notify: bytes | None = None,
                          **kwargs: Any) -> None:
        """Pull remote blocks (``BlocksCacheKey``: B2B) or a remote contiguous slot cut into blocks (C2B) into
        ``dst_blocks`` of ``dst_cache``; block ``src_blocks[i]`` lands in ``dst_blocks[i]``.

        Timeouts and cancellation as :meth:`pull_cache`: the listed destination blocks are unspecified
        afterwards and never written once the call has returned.  ``notify`` as :meth:`pull_cache`.
        """
        self._check_open_on_loop()
        local, params = validate.pull_blocks(self._entry, src_cache_key, dst_cache, src_blocks, dst_blocks, kwargs)
        note = check_notification("notify", notify)
        await self._transfers.run(src_cache_key, local, params, note)

    async def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                         src_layer_range: range | None = None, dst_layer_range: range | None = None,
                         size: int = -1, tensor_num_per_layer: int = 2, *, notify: bytes | None = None) -> None:
        """Push slot ``src_batch_index`` of a local contiguous cache into a remote cache's slot.

        Every layer is validated before any byte moves.  Timeouts and cancellation as :meth:`pull_cache`
        (here the remote slot is left unspecified, and never written after the call has returned).
        ``notify``: a notification the owner receives once the pushed bytes are in place (as :meth:`pull_cache`).
        """
        self._check_open_on_loop()
        layers = {"src_layer_range": src_layer_range, "dst_layer_range": dst_layer_range,
                  "tensor_num_per_layer": tensor_num_per_layer}
        local, params = validate.push_cache(self._entry, self._remote_accessible(), dst_cache_key, src_cache,
                                            src_batch_index, layers, size)
        note = check_notification("notify", notify)
        await self._transfers.run(dst_cache_key, local, params, note)

    async def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache,
                          src_blocks: IndexSequence | None = (),
                          dst_blocks: IndexSequence = (), src_layer_range: range | None = None,
                          dst_layer_range: range | None = None, tensor_num_per_layer: int = 2, *,
                          notify: bytes | None = None) -> None:
        """Push local blocks ``src_blocks[i]`` into remote blocks ``dst_blocks[i]`` (B2B).

        Timeouts and cancellation as :meth:`push_cache`; ``notify`` as :meth:`push_cache`.
        """
        self._check_open_on_loop()
        layers = {"src_layer_range": src_layer_range, "dst_layer_range": dst_layer_range,
                  "tensor_num_per_layer": tensor_num_per_layer}
        local, params = validate.push_blocks(self._entry, self._remote_accessible(), dst_cache_key, src_cache,
                                             src_blocks, dst_blocks, layers)
        note = check_notification("notify", notify)
        await self._transfers.run(dst_cache_key, local, params, note)

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: list[Any] | tuple[Any, ...],
                             src_block_indices: IndexSequence | None = None,
                             dst_block_indices: IndexSequence | None = None,
                             dst_block_memory_size: int | None = None) -> CacheTask:
        """Send ``src_cache`` layer by layer, each as soon as ``layer_synchronizer`` says it is computed, to every
        destination of ``transfer_configs`` (all :class:`TransferWithCacheKeyConfig`, or all raw-address
        :class:`TransferConfig`, which the owners resolve to their registered caches first); returns the running
        :class:`CacheTask` at once (await it, or its ``synchronize`` / ``get_results``).

        Call it on the instance's event loop (it starts a task there).  The cache holds 2 tensors per layer (K and
        V).  ``src_block_indices`` / ``dst_block_indices`` (equal length) pick the blocks of a blocks source and
        destination; a contiguous source sends slot ``src_batch_index`` of each config.  HOST and DEVICE sources
        both work (the reference refuses HOST).  Arguments are checked here, before any layer is waited for;
        each layer's push is checked like :meth:`push_blocks` / :meth:`push_cache`."""
        self._check_open_on_loop()
        checked = validate.layer_transfer(self._entry, src_cache, layer_synchronizer, transfer_configs,
                                          src_block_indices, dst_block_indices, dst_block_memory_size)
        configs, src_blocks, dst_blocks = checked.configs, checked.src_blocks, checked.dst_blocks

        async def push(config: TransferWithCacheKeyConfig, layer: int) -> None:
            dst_layer = config.dst_layer_of(layer)
            if isinstance(config.cache_key, BlocksCacheKey):
                await self.push_blocks(config.cache_key, src_cache, src_blocks, dst_blocks or (),
                                       range(layer, layer + 1), range(dst_layer, dst_layer + 1))
            else:
                await self.push_cache(config.cache_key, src_cache, config.src_batch_index,
                                      range(layer, layer + 1), range(dst_layer, dst_layer + 1))

        results: list[LLMStatusCode | None] = [None] * len(configs)
        task = asyncio.ensure_future(run_layers(checked.num_layers, layer_synchronizer, configs, push, results,
                                                self._transfers.resolve, dst_blocks is not None))
        self._layer_jobs.add(task)
        task.add_done_callback(self._layer_jobs.discard)
        return CacheTask(task, results)

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """Checked as the reference does (``MemInfo`` or a list of them, DEVICE memory, non-zero address, size > 0),
        then refused with ``LLM_FEATURE_NOT_ENABLED``: it re-registers device memory with the NICs after a memory
        error, which has no meaning here (the reference reserves it too)."""
        self._check_open()
        infos = mem_infos if isinstance(mem_infos, list) else [mem_infos]
        for info in infos:
            check_isinstance("mem_infos", info, MemInfo)
            require(info.mem_type == Memtype.MEM_TYPE_DEVICE, "remap_registered_memory supports DEVICE memory only.")
            require(info.addr != 0, "mem_info addr must not be 0.")
            require(info.size > 0, "mem_info size must be > 0.")
        raise LLMException("remap_registered_memory repairs NIC registrations after a device memory error; "
                           "aiodatadist registers no memory with a NIC, so there is nothing to remap",
                           status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)

    def _remote_accessible(self) -> bool | None:
        """``llm.EnableRemoteCacheAccessible``: None when unset (pull by CacheKey allowed, push allowed)."""
        return self._settings.enable_remote_cache_accessible

    # -- lifetime --------------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop running copies and release every cache (``LLMDataDist.finalize``)."""
        if self._closed:
            return
        self._closed = True  # no new copy may start while the running ones are stopped
        for job in list(self._layer_jobs):  # layer-wise transfers stop first (each push stops cleanly)
            job.cancel()
        if self._layer_jobs:
            await asyncio.wait(list(self._layer_jobs))
        await self._engine.close()
        self._registry.close_all()
        for memory in self._host_memories:
            memory._force_close()
        self._host_memories.clear()
        if self._registry.directory is not None:
            self._registry.directory.close()
        self._engine.close_device()

    def __repr__(self) -> str:
        return f"CacheManager(cluster_id={self._cluster_id}, caches={len(self._registry.entries())})"


