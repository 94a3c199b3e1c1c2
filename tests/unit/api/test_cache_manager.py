"""CacheManager: cache lifecycle (ids, allocation, registration, keys, release) and local copies.

Copies are checked byte for byte on random non-zero data, including the regions a call must leave alone,
and invalid calls must raise without moving a single byte.  Releasing or cancelling during a running copy
must never let a worker touch memory afterwards.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers.data import fill_rows, row_views
from helpers.ids import new_cluster_id
from helpers.internals import engine_of, registry_of
from helpers.keys import resolve

import aiodatadist.copy.python_pool as executor_module
from aiodatadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheManager,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMNotInitializedError,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.copy.python_pool import CopyExecutor
from aiodatadist.registry.caches import MAX_REGISTERED_ADDRS

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID
NOT_EXIST = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
U64_MAX = 2**64 - 1
HAS_CUDA_DEVICE = os.path.exists("/dev/nvidiactl")

# 128 MiB: many executor chunks per copy; the tests that race with a running copy pace its chunks (the
# ``paced_copier`` fixture) so that it is still running when they act, however fast the machine is, and hold
# its later chunks until they let them go (or stop the copy), so that it cannot end first, however slow.
BIG_TENSORS, BIG_BLOCKS, BIG_BLOCK_BYTES = 64, 64, 32 << 10


def host_desc(num_tensors: int, shape: list[int], dtype: DataType = DataType.DT_UINT8) -> CacheDesc:
    return CacheDesc(num_tensors, shape, dtype, Placement.HOST)


def raises_status(code: LLMStatusCode) -> Any:
    """``pytest.raises`` for an ``LLMException`` with ``status_code == code``."""

    class _Ctx:
        def __enter__(self) -> pytest.ExceptionInfo[LLMException]:
            self._cm = pytest.raises(LLMException)
            self.info = self._cm.__enter__()
            return self.info

        def __exit__(self, *exc: object) -> bool:
            handled = self._cm.__exit__(*exc)
            assert self.info.value.status_code == code, f"{self.info.value!r}: {self.info.value.status_code}"
            return bool(handled)

    return _Ctx()


def snapshot(*caches: Cache) -> list[list[np.ndarray[Any, Any]]]:
    return [[t.copy() for t in row_views(c)] for c in caches]


def assert_unchanged(before: list[list[np.ndarray[Any, Any]]], *caches: Cache) -> None:
    after = snapshot(*caches)
    for b_cache, a_cache in zip(before, after, strict=True):
        for b, a in zip(b_cache, a_cache, strict=True):
            assert np.array_equal(a, b)


@pytest.fixture
async def spawn() -> Any:
    """``spawn(coro)`` starts a task; every task is awaited at teardown (before the instance is finalized),
    so a failing test never leaves a running copy or an unretrieved exception behind."""
    tasks: list[asyncio.Task[Any]] = []

    def start(coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        tasks.append(task)
        return task

    yield start
    await asyncio.gather(*tasks, return_exceptions=True)


async def wait_until(predicate: Any, timeout: float = 30.0) -> None:
    """Poll ``predicate`` on the event loop (yielding to it) until true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0)


# ------------------------------------------------------------------------------------------------------------
# lifecycle: ids, allocation, registration
# ------------------------------------------------------------------------------------------------------------

async def test_cache_ids_start_at_one_per_instance(cache_manager: CacheManager) -> None:
    other = LLMDataDist(LLMRole.DECODER, new_cluster_id())
    await other.init(LLMConfig().generate_options())
    try:
        cm2 = other.cache_manager
        desc = host_desc(2, [4, 16])
        a = cache_manager.allocate_cache(desc)
        b = cache_manager.allocate_blocks_cache(desc)
        arrays = [np.zeros(64, np.uint8) for _ in range(2)]
        c = cache_manager.register_cache(desc, [x.ctypes.data for x in arrays])
        assert [a.cache_id, b.cache_id, c.cache_id] == [1, 2, 3]
        # the second instance in the same loop has its own numbering
        d = cm2.allocate_blocks_cache(desc)
        e = cm2.register_blocks_cache(desc, [x.ctypes.data for x in arrays])
        assert [d.cache_id, e.cache_id] == [1, 2]
        # ids are never reused after a release
        cache_manager.deallocate_cache(a)
        cache_manager.unregister_cache(c.cache_id)
        assert cache_manager.allocate_cache(desc).cache_id == 4
        # a handle of one instance is unknown to the other
        with raises_status(NOT_EXIST):
            await cm2.copy_blocks(b, {0: [1]})
    finally:
        await other.finalize()


async def test_allocate_cache_and_blocks_cache(cache_manager: CacheManager) -> None:
    desc = host_desc(3, [4, 5, 6], DataType.DT_FLOAT16)
    cache = cache_manager.allocate_cache(desc)
    blocks = cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(0, 7))
    for c, is_blocks in ((cache, False), (blocks, True)):
        assert c.is_blocks_cache is is_blocks
        assert c.cache_desc == desc
        assert len(c.tensor_addrs) == 3 and all(a > 0 for a in c.tensor_addrs)
        tensors = c.tensors
        assert len(tensors) == 3
        for t, addr in zip(tensors, c.tensor_addrs, strict=True):
            assert t.shape == (4, 5, 6) and t.dtype == np.float16
            assert t.ctypes.data == addr
            assert not t.view(np.uint16).any()  # zero-filled
    # the tensors of one cache and of different caches never overlap
    spans = sorted((a, a + desc.size) for c in (cache, blocks) for a in c.tensor_addrs)
    assert all(hi <= lo2 for (_, hi), (lo2, _) in itertools.pairwise(spans))
    # the views are the cache memory: writes through one handle are seen through a fresh one
    cache.tensors[1][2, 3, 4] = 1.5
    assert cache.tensors[1][2, 3, 4] == 1.5
    assert resolve(registry_of(cache_manager), BlocksCacheKey(99, 7))[0].handle is blocks


@pytest.mark.skipif(HAS_CUDA_DEVICE, reason="a CUDA device is present: DEVICE caches may be supported")
async def test_device_placement_not_enabled(cache_manager: CacheManager) -> None:
    desc = CacheDesc(1, [4, 8], DataType.DT_UINT8, Placement.DEVICE)
    arr = np.zeros(32, np.uint8)
    calls = [
        lambda: cache_manager.allocate_cache(desc),
        lambda: cache_manager.allocate_blocks_cache(desc),
        lambda: cache_manager.register_cache(desc, [arr.ctypes.data]),
        lambda: cache_manager.register_blocks_cache(desc, [arr.ctypes.data]),
    ]
    for call in calls:
        with raises_status(LLMStatusCode.LLM_FEATURE_NOT_ENABLED):
            call()
    assert registry_of(cache_manager).entries() == []


@pytest.mark.parametrize(
    "num_tensors,shape",
    [(0, [4, 8]), (2, [0, 8]), (2, [4, 0]), (2, [4, 8, 0])],
    ids=["no-tensors", "zero-blocks", "zero-dim", "zero-last-dim"],
)
async def test_empty_desc_rejected(cache_manager: CacheManager, num_tensors: int, shape: list[int]) -> None:
    desc = host_desc(num_tensors, shape)
    arrays = [np.zeros(64, np.uint8) for _ in range(max(num_tensors, 1))]
    addrs = [a.ctypes.data for a in arrays][: max(num_tensors, 1)]
    calls = [
        lambda: cache_manager.allocate_cache(desc),
        lambda: cache_manager.allocate_blocks_cache(desc),
        lambda: cache_manager.register_cache(desc, addrs),
        lambda: cache_manager.register_blocks_cache(desc, addrs),
    ]
    for call in calls:
        with raises_status(PARAM_INVALID):
            call()
    assert registry_of(cache_manager).entries() == []


async def test_register_host_memory(cache_manager: CacheManager) -> None:
    desc = host_desc(3, [4, 8], DataType.DT_INT32)
    arrays = [np.zeros((4, 8), np.int32) for _ in range(3)]
    cache = cache_manager.register_cache(desc, [a.ctypes.data for a in arrays])
    blocks = cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays], BlocksCacheKey(0, 1))
    assert not cache.is_blocks_cache and blocks.is_blocks_cache
    assert cache.tensor_addrs == [a.ctypes.data for a in arrays]
    # the cache views alias the caller's arrays
    arrays[1][2, 5] = 12345
    assert cache.tensors[1][2, 5] == 12345 and blocks.tensors[1][2, 5] == 12345
    cache.tensors[2][3] = np.arange(8)
    assert np.array_equal(arrays[2][3], np.arange(8))
    # copies move the caller's bytes
    await cache_manager.copy_blocks(blocks, {2: [0]})
    assert np.array_equal(arrays[1][0], arrays[1][2]) and arrays[1][0, 5] == 12345
    cache_manager.unregister_cache(cache.cache_id)
    cache_manager.unregister_cache(blocks.cache_id)
    assert cache.tensor_addrs == [] and blocks.tensor_addrs == []
    assert arrays[1][2, 5] == 12345  # the caller's memory is untouched by unregistering


@pytest.mark.parametrize("blocks", [False, True], ids=["register_cache", "register_blocks_cache"])
async def test_register_addrs_validation(cache_manager: CacheManager, blocks: bool) -> None:
    desc = host_desc(2, [4, 8])
    arrays = [np.zeros(32, np.uint8) for _ in range(3)]
    good = [a.ctypes.data for a in arrays[:2]]
    register = cache_manager.register_blocks_cache if blocks else cache_manager.register_cache
    with pytest.raises(TypeError):
        register(desc, tuple(good))
    with pytest.raises(TypeError):
        register(desc, [good[0], "1234"])
    with pytest.raises(ValueError):
        register(desc, [good[0], -1])
    for addrs in ([], good[:1], [a.ctypes.data for a in arrays], [good[0], 0]):
        with raises_status(PARAM_INVALID):
            register(desc, addrs)
    with pytest.raises(TypeError):
        register(desc, good, remote_accessible=1)
    assert registry_of(cache_manager).entries() == []
    assert register(desc, good).cache_id == 1


async def test_register_address_limit(cache_manager: CacheManager) -> None:
    # the reference's 240 is raised (docs/api.md, "Differences"): 120 layers of separate K and V tensors fit
    # many times over
    cap = MAX_REGISTERED_ADDRS
    assert cap >= 4096
    memory = np.zeros((cap + 1, 16), np.uint8)
    addrs = [int(memory[i].ctypes.data) for i in range(cap + 1)]
    first = cache_manager.register_cache(host_desc(cap - 40, [2, 8]), addrs[:cap - 40])
    # allocated caches do not count against the limit of registered addresses
    cache_manager.allocate_cache(host_desc(64, [2, 8]))
    cache_manager.register_blocks_cache(host_desc(39, [2, 8]), addrs[cap - 40:cap - 1])
    last = cache_manager.register_cache(host_desc(1, [2, 8]), addrs[cap - 1:cap])  # exactly the cap
    count = len(registry_of(cache_manager).entries())
    with raises_status(PARAM_INVALID):
        cache_manager.register_cache(host_desc(1, [2, 8]), addrs[cap:cap + 1])
    with raises_status(PARAM_INVALID):
        cache_manager.register_blocks_cache(host_desc(1, [2, 8]), addrs[cap:cap + 1])
    assert len(registry_of(cache_manager).entries()) == count
    # unregistering gives the addresses back
    cache_manager.unregister_cache(last.cache_id)
    cache_manager.register_cache(host_desc(1, [2, 8]), addrs[cap:cap + 1])
    with raises_status(PARAM_INVALID):
        cache_manager.register_cache(host_desc(1, [2, 8]), addrs[cap - 1:cap])
    cache_manager.unregister_cache(first.cache_id)
    cache_manager.register_blocks_cache(host_desc(cap - 40, [2, 8]), addrs[:cap - 40])


async def test_cache_keys_bind_slots(cache_manager: CacheManager) -> None:
    desc = host_desc(2, [4, 16])
    k0, k2 = CacheKey(1, 100), CacheKey(1, 102, 3)
    pad = CacheKey(1, U64_MAX)
    prefix = CacheKey(1, U64_MAX, 0, 55)
    cache = cache_manager.allocate_cache(desc, [k0, pad, k2, prefix])
    reg = registry_of(cache_manager)
    assert resolve(reg, k0) == (reg.by_id(cache.cache_id), 0)
    assert resolve(reg, k2)[1] == 2
    assert resolve(reg, prefix)[1] == 3
    # cluster_id is not part of the stored key
    assert resolve(reg, CacheKey(999, 102, 3))[1] == 2
    with raises_status(NOT_EXIST):
        resolve(reg, CacheKey(1, 102, 4))  # model_id is part of the key
    with raises_status(NOT_EXIST):
        resolve(reg, pad)  # placeholders bind nothing
    assert resolve(reg, CacheKeyByIdAndIndex(1, cache.cache_id, 3)) == (reg.by_id(cache.cache_id), 3)
    # a tuple of keys works as well; registered memory binds keys the same way
    arrays = [np.zeros(64, np.uint8) for _ in range(2)]
    other = cache_manager.register_cache(desc, [a.ctypes.data for a in arrays], (CacheKey(1, 200),))
    assert resolve(reg, CacheKey(1, 200))[0].handle is other


async def test_cache_keys_validation(cache_manager: CacheManager) -> None:
    desc = host_desc(1, [2, 16])
    arrays = [np.zeros(32, np.uint8)]
    addrs = [arrays[0].ctypes.data]
    taken = cache_manager.allocate_cache(desc, [CacheKey(1, 7)])
    n = len(registry_of(cache_manager).entries())
    bad_keys = [
        [CacheKey(1, 1), CacheKey(1, 2), CacheKey(1, 3)],  # more keys than the batch size 2
        [CacheKey(1, 1), CacheKey(2, 1)],  # the same (req_id, model_id) twice
        [CacheKey(1, 8), CacheKey(1, 7)],  # already bound to `taken`
        [CacheKey(5, 7)],  # already bound: cluster_id is not part of the key
    ]
    for keys in bad_keys:
        with raises_status(PARAM_INVALID):
            cache_manager.allocate_cache(desc, keys)
        with raises_status(PARAM_INVALID):
            cache_manager.register_cache(desc, addrs, keys)
    with pytest.raises(TypeError):
        cache_manager.allocate_cache(desc, [CacheKey(1, 9), "key"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        cache_manager.allocate_cache(desc, CacheKey(1, 9))  # type: ignore[arg-type]
    # nothing was created and no key of a failed call was bound
    assert len(registry_of(cache_manager).entries()) == n
    for req in (1, 2, 3, 8):
        with raises_status(NOT_EXIST):
            resolve(registry_of(cache_manager), CacheKey(1, req))
    assert resolve(registry_of(cache_manager), CacheKey(1, 7))[0].handle is taken


async def test_blocks_cache_model_id_last_wins(cache_manager: CacheManager) -> None:
    desc = host_desc(1, [4, 16])
    reg = registry_of(cache_manager)
    first = cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    second = cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(2, 0))  # cluster_id is ignored
    other = cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 1))
    cache_manager.allocate_blocks_cache(desc)  # no key: indexed by id only
    assert resolve(reg, BlocksCacheKey(1, 0))[0].handle is second
    assert resolve(reg, BlocksCacheKey(3, 1))[0].handle is other
    arr = np.zeros(64, np.uint8)
    third = cache_manager.register_blocks_cache(desc, [arr.ctypes.data], BlocksCacheKey(1, 0))
    assert resolve(reg, BlocksCacheKey(1, 0))[0].handle is third
    cache_manager.unregister_cache(third.cache_id)
    with raises_status(NOT_EXIST):
        resolve(reg, BlocksCacheKey(1, 0))
    assert reg.by_id(first.cache_id).handle is first  # replaced in the index, still alive by id
    cache_manager.deallocate_blocks_cache(other)
    with raises_status(NOT_EXIST):
        resolve(reg, BlocksCacheKey(1, 1))
    with raises_status(NOT_EXIST):
        resolve(reg, BlocksCacheKey(1, 2))


# ------------------------------------------------------------------------------------------------------------
# lifecycle: release
# ------------------------------------------------------------------------------------------------------------

async def test_deallocate_wrong_kind_and_noops(cache_manager: CacheManager) -> None:
    desc = host_desc(1, [4, 16])
    cache = cache_manager.allocate_cache(desc)
    blocks = cache_manager.allocate_blocks_cache(desc)
    with raises_status(PARAM_INVALID):
        cache_manager.deallocate_cache(blocks)
    with raises_status(PARAM_INVALID):
        cache_manager.deallocate_blocks_cache(cache)
    # the wrong-kind calls released nothing
    assert cache.tensor_addrs and blocks.tensor_addrs
    fill_rows(cache, 1)
    await cache_manager.copy_blocks(blocks, {0: [1]})
    with pytest.raises(TypeError):
        cache_manager.deallocate_cache(cache.cache_id)  # type: ignore[arg-type]
    cache_manager.deallocate_cache(cache)
    cache_manager.deallocate_blocks_cache(blocks)
    # second calls, foreign and create_cpu_cache handles, unknown ids and keys: no-ops
    cache_manager.deallocate_cache(cache)
    cache_manager.deallocate_blocks_cache(blocks)
    arr = np.zeros(64, np.uint8)
    cache_manager.deallocate_blocks_cache(Cache.create_cpu_cache(desc, [arr.ctypes.data]))
    cache_manager.unregister_cache(cache.cache_id)
    cache_manager.unregister_cache(12345)
    cache_manager.unregister_cache(-1)
    cache_manager.remove_cache_key(CacheKey(1, 4242))
    with pytest.raises(TypeError):
        cache_manager.remove_cache_key(BlocksCacheKey(1, 0))  # type: ignore[arg-type]
    assert registry_of(cache_manager).entries() == []


async def test_released_handle_is_invalid(cache_manager: CacheManager) -> None:
    desc = host_desc(2, [4, 16])
    blocks = cache_manager.allocate_blocks_cache(desc)
    cache = cache_manager.allocate_cache(desc)
    peer = cache_manager.allocate_cache(desc)
    arrays = [np.zeros(64, np.uint8) for _ in range(2)]
    registered = cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays])
    cache_manager.deallocate_blocks_cache(blocks)
    cache_manager.deallocate_cache(cache)
    cache_manager.unregister_cache(registered.cache_id)
    for handle in (blocks, cache, registered):
        assert handle.tensor_addrs == []
        with raises_status(NOT_EXIST):
            handle.tensors  # noqa: B018
        with raises_status(NOT_EXIST):
            registry_of(cache_manager).by_id(handle.cache_id)
    with raises_status(NOT_EXIST):
        await cache_manager.copy_blocks(blocks, {0: [1]})
    with raises_status(NOT_EXIST):
        await cache_manager.copy_blocks(registered, {0: [1]})
    with raises_status(NOT_EXIST):
        await cache_manager.copy_cache(peer, cache)
    with raises_status(NOT_EXIST):
        await cache_manager.copy_cache(cache, peer)
    with raises_status(NOT_EXIST):
        cpu = Cache.create_cpu_cache(desc, [a.ctypes.data for a in arrays])
        await cache_manager.swap_blocks(blocks, cpu, {0: 0})


async def test_release_with_outstanding_key_defers_free(cache_manager: CacheManager) -> None:
    desc = host_desc(2, [4, 1024])
    keys = [CacheKey(1, 10), CacheKey(1, 11)]
    cache = cache_manager.allocate_cache(desc, keys)
    reg = registry_of(cache_manager)
    entry = reg.by_id(cache.cache_id)
    assert entry.segment is not None and not entry.segment.closed
    data = fill_rows(cache, 3)
    cache_manager.deallocate_cache(cache)
    assert cache.tensor_addrs == []
    with raises_status(NOT_EXIST):
        reg.by_id(cache.cache_id)
    # both keys still resolve to the released cache and its memory is intact
    assert resolve(reg, keys[0]) == (entry, 0) and resolve(reg, keys[1]) == (entry, 1)
    assert not entry.segment.closed
    whole = entry.segment.array()
    for t in range(2):
        assert np.array_equal(whole[t * desc.size:(t + 1) * desc.size].reshape(4, -1), data[t])
    del whole
    cache_manager.remove_cache_key(keys[0])
    with raises_status(NOT_EXIST):
        resolve(reg, keys[0])
    assert resolve(reg, keys[1]) == (entry, 1)
    assert not entry.segment.closed
    cache_manager.remove_cache_key(keys[1])
    assert entry.segment.closed
    with raises_status(NOT_EXIST):
        resolve(reg, keys[1])
    cache_manager.remove_cache_key(keys[1])  # again: no-op
    # the keys are free again
    assert cache_manager.allocate_cache(desc, keys).cache_id == cache.cache_id + 1


async def test_remove_key_of_live_cache_keeps_cache(cache_manager: CacheManager) -> None:
    desc = host_desc(1, [2, 64])
    key = CacheKey(1, 5)
    cache = cache_manager.allocate_cache(desc, [key])
    entry = registry_of(cache_manager).by_id(cache.cache_id)
    cache_manager.remove_cache_key(key)
    with raises_status(NOT_EXIST):
        resolve(registry_of(cache_manager), key)
    assert not entry.segment.closed and cache.tensor_addrs
    cache_manager.deallocate_cache(cache)
    assert entry.segment.closed


async def test_release_without_keys_frees_at_once(cache_manager: CacheManager) -> None:
    desc = host_desc(2, [4, 1024])
    cache = cache_manager.allocate_cache(desc)
    blocks = cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 3))
    entries = [registry_of(cache_manager).by_id(c.cache_id) for c in (cache, blocks)]
    fds = [e.segment.identity.fd for e in entries]
    assert all(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:") for fd in fds)
    cache_manager.deallocate_cache(cache)
    cache_manager.deallocate_blocks_cache(blocks)
    assert all(e.segment.closed for e in entries)
    with raises_status(NOT_EXIST):
        resolve(registry_of(cache_manager), BlocksCacheKey(1, 3))


async def test_registered_cache_keys_released_with_it(cache_manager: CacheManager) -> None:
    desc = host_desc(1, [2, 64])
    arr = np.zeros(128, np.uint8)
    cache = cache_manager.register_cache(desc, [arr.ctypes.data], [CacheKey(1, 1), CacheKey(1, 2)])
    cache_manager.unregister_cache(cache.cache_id)
    for req in (1, 2):
        with raises_status(NOT_EXIST):
            resolve(registry_of(cache_manager), CacheKey(1, req))
    cache_manager.register_cache(desc, [arr.ctypes.data], [CacheKey(1, 1)])  # the key is free again


async def test_methods_after_finalize_raise() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    await dd.init(LLMConfig().generate_options())
    cm = dd.cache_manager
    desc = host_desc(1, [4, 16])
    blocks = cm.allocate_blocks_cache(desc)
    cache = cm.allocate_cache(desc)
    arr = np.zeros(64, np.uint8)
    await dd.finalize()
    assert blocks.tensor_addrs == [] and cache.tensor_addrs == []
    with pytest.raises(LLMNotInitializedError):
        dd.cache_manager  # noqa: B018
    calls = [
        lambda: cm.allocate_cache(desc),
        lambda: cm.allocate_blocks_cache(desc),
        lambda: cm.register_cache(desc, [arr.ctypes.data]),
        lambda: cm.register_blocks_cache(desc, [arr.ctypes.data]),
        lambda: cm.unregister_cache(1),
        lambda: cm.deallocate_cache(cache),
        lambda: cm.deallocate_blocks_cache(blocks),
        lambda: cm.remove_cache_key(CacheKey(1, 1)),
    ]
    for call in calls:
        with pytest.raises(LLMNotInitializedError) as info:
            call()
        assert isinstance(info.value, RuntimeError)
    for coro in (cm.copy_blocks(blocks, {0: [1]}), cm.copy_cache(cache, cache),
                 cm.swap_blocks(blocks, blocks, {0: 1})):
        with pytest.raises(LLMNotInitializedError):
            await coro
    await dd.finalize()  # a second finalize is a no-op


async def test_cache_manager_before_init_raises() -> None:
    dd = LLMDataDist(LLMRole.DECODER, new_cluster_id())
    with pytest.raises(RuntimeError) as info:
        dd.cache_manager  # noqa: B018
    assert isinstance(info.value, LLMNotInitializedError)
    await dd.finalize()  # not initialized: no-op


# ------------------------------------------------------------------------------------------------------------
# copies
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "num_tensors,shape,dtype,info",
    [
        (3, [8, 8], DataType.DT_FLOAT16, {2: [0, 5, 7]}),
        (2, [5, 7], DataType.DT_UINT8, {4: [0, 1, 2]}),
        (1, [16, 3, 4], DataType.DT_INT32, {0: [15], 7: [3, 1], 9: [8]}),
        # big: 16.5 MiB per call, takes the streaming path
        (8, [64, 64 << 10], DataType.DT_UINT8, {3: list(range(10, 41)), 5: [50, 51]}),
        # big and unaligned: odd block size
        (2, [64, 131075], DataType.DT_UINT8, {63: list(range(0, 60, 2)) + [61]}),
    ],
    ids=["small-fp16", "tiny-odd", "multi-src", "big", "big-odd"],
)
async def test_copy_blocks_exact(cache_manager: CacheManager, num_tensors: int, shape: list[int],
                                 dtype: DataType, info: dict[int, list[int]]) -> None:
    desc = host_desc(num_tensors, shape, dtype)
    cache = cache_manager.allocate_blocks_cache(desc)
    bystander = cache_manager.allocate_blocks_cache(desc)
    original = fill_rows(cache, 11)
    bystander_data = fill_rows(bystander, 12)
    await cache_manager.copy_blocks(cache, info)
    expected = [t.copy() for t in original]
    for src, dsts in info.items():
        for t in expected:
            t[dsts] = t[src]
    for got, want in zip(row_views(cache), expected, strict=True):
        assert np.array_equal(got, want)
    for got, want in zip(row_views(bystander), bystander_data, strict=True):
        assert np.array_equal(got, want)


async def test_copy_blocks_accepts_numpy_ints_and_tuples(cache_manager: CacheManager) -> None:
    cache = cache_manager.allocate_blocks_cache(host_desc(2, [6, 32]))
    data = fill_rows(cache, 5)
    await cache_manager.copy_blocks(cache, {np.int64(1): (np.uint32(4), 5)})
    for got, want in zip(row_views(cache), data, strict=True):
        assert np.array_equal(got[[4, 5]], [want[1], want[1]])
        assert np.array_equal(got[:4], want[:4])


@pytest.mark.parametrize(
    "info,exc",
    [
        ({1: [2], 2: [3]}, PARAM_INVALID),  # block 2 is destination and source
        ({1: [1]}, PARAM_INVALID),  # copy onto itself
        ({1: [2, 8]}, PARAM_INVALID),  # destination out of range
        ({8: [2]}, PARAM_INVALID),  # source out of range
        ({1: [2], 3: [2]}, PARAM_INVALID),  # duplicate destination
        ({1: [2, 2]}, PARAM_INVALID),
        ({1: []}, PARAM_INVALID),
        ({}, PARAM_INVALID),
        ({"1": [2]}, TypeError),
        ({1: ["2"]}, TypeError),
        ({1: 2}, TypeError),
        ({1: [2.0]}, TypeError),
        ({-1: [2]}, ValueError),
        ({1: [3, -2]}, ValueError),
        ([(1, [2])], TypeError),
    ],
)
async def test_copy_blocks_invalid_changes_nothing(cache_manager: CacheManager, info: Any, exc: Any) -> None:
    cache = cache_manager.allocate_blocks_cache(host_desc(2, [8, 64]))
    other = cache_manager.allocate_blocks_cache(host_desc(2, [8, 64]))
    fill_rows(cache, 1)
    fill_rows(other, 2)
    before = snapshot(cache, other)
    if isinstance(exc, LLMStatusCode):
        with raises_status(exc):
            await cache_manager.copy_blocks(cache, info)
    else:
        with pytest.raises(exc):
            await cache_manager.copy_blocks(cache, info)
    assert_unchanged(before, cache, other)


async def test_copy_blocks_needs_blocks_cache(cache_manager: CacheManager) -> None:
    cache = cache_manager.allocate_cache(host_desc(1, [4, 64]))
    fill_rows(cache, 1)
    before = snapshot(cache)
    with raises_status(PARAM_INVALID):
        await cache_manager.copy_blocks(cache, {0: [1]})
    with pytest.raises(TypeError):
        await cache_manager.copy_blocks(None, {0: [1]})  # type: ignore[arg-type]
    assert_unchanged(before, cache)


@pytest.mark.parametrize(
    "dst_slot,src_slot,offset,size",
    [(0, 0, 0, -1), (2, 1, 0, -1), (3, 0, 10, -1), (1, 2, 17, 100), (0, 3, 0, 1), (2, 2, 255, 1)],
)
async def test_copy_cache_exact(cache_manager: CacheManager, dst_slot: int, src_slot: int,
                                offset: int, size: int) -> None:
    desc = host_desc(3, [4, 64], DataType.DT_INT32)  # 256 bytes per slot
    src = cache_manager.allocate_cache(desc)
    dst = cache_manager.allocate_cache(desc)
    src_data, dst_data = fill_rows(src, 21), fill_rows(dst, 22)
    await cache_manager.copy_cache(dst, src, dst_slot, src_slot, offset, size, req_id=7)
    end = 256 if size == -1 else offset + size
    for t in range(3):
        want = dst_data[t].copy()
        want[dst_slot, offset:end] = src_data[t][src_slot, offset:end]
        assert np.array_equal(row_views(dst)[t], want)
        assert np.array_equal(row_views(src)[t], src_data[t])


async def test_copy_cache_big_and_within_one_cache(cache_manager: CacheManager) -> None:
    desc = host_desc(4, [3, 3 << 20])  # 9 MiB per tensor, 12 MiB per copy: streaming path
    a = cache_manager.allocate_cache(desc)
    b = cache_manager.allocate_cache(desc)
    a_data, b_data = fill_rows(a, 1), fill_rows(b, 2)
    await cache_manager.copy_cache(b, a, 2, 0, 1, (3 << 20) - 2)
    for t in range(4):
        want = b_data[t].copy()
        want[2, 1:-1] = a_data[t][0, 1:-1]
        assert np.array_equal(row_views(b)[t], want)
    # source and destination may be the same cache (different slots)
    await cache_manager.copy_cache(a, a, 1, 2)
    for t in range(4):
        want = a_data[t].copy()
        want[1] = a_data[t][2]
        assert np.array_equal(row_views(a)[t], want)


@pytest.mark.parametrize(
    "kwargs,exc",
    [
        ({"dst_batch_index": 4}, PARAM_INVALID),
        ({"src_batch_index": 4}, PARAM_INVALID),
        ({"offset": 256}, PARAM_INVALID),
        ({"offset": 200, "size": 57}, PARAM_INVALID),
        ({"size": 257}, PARAM_INVALID),
        ({"size": 0}, PARAM_INVALID),
        ({"size": -2}, PARAM_INVALID),
        ({"dst_batch_index": -1}, ValueError),
        ({"offset": -1}, ValueError),
        ({"src_batch_index": "0"}, TypeError),
        ({"size": 1.0}, TypeError),
        ({"req_id": -1}, ValueError),
    ],
)
async def test_copy_cache_invalid_changes_nothing(cache_manager: CacheManager, kwargs: dict[str, Any],
                                                  exc: Any) -> None:
    desc = host_desc(2, [4, 64], DataType.DT_INT32)
    src, dst = cache_manager.allocate_cache(desc), cache_manager.allocate_cache(desc)
    fill_rows(src, 1)
    fill_rows(dst, 2)
    before = snapshot(src, dst)
    if isinstance(exc, LLMStatusCode):
        with raises_status(exc):
            await cache_manager.copy_cache(dst, src, **kwargs)
    else:
        with pytest.raises(exc):
            await cache_manager.copy_cache(dst, src, **kwargs)
    assert_unchanged(before, src, dst)


async def test_copy_cache_mismatched_caches_change_nothing(cache_manager: CacheManager) -> None:
    desc = host_desc(2, [4, 64])
    src = cache_manager.allocate_cache(desc)
    others = [
        cache_manager.allocate_cache(host_desc(2, [4, 128])),  # other shape
        cache_manager.allocate_cache(host_desc(3, [4, 64])),  # other tensor count
        cache_manager.allocate_cache(host_desc(2, [4, 64], DataType.DT_INT8)),  # other dtype
        cache_manager.allocate_blocks_cache(desc),  # blocks cache
    ]
    fill_rows(src, 1)
    for i, o in enumerate(others):
        fill_rows(o, 10 + i)
    before = snapshot(src, *others)
    for o in others:
        with raises_status(PARAM_INVALID):
            await cache_manager.copy_cache(o, src)
        with raises_status(PARAM_INVALID):
            await cache_manager.copy_cache(src, o)
    assert_unchanged(before, src, *others)


async def test_swap_blocks_between_blocks_caches(cache_manager: CacheManager) -> None:
    # same block size (4 KiB), different block counts and shapes
    a = cache_manager.allocate_blocks_cache(host_desc(3, [8, 1024], DataType.DT_FLOAT))
    b = cache_manager.allocate_blocks_cache(host_desc(3, [12, 64, 64]))
    a_data, b_data = fill_rows(a, 31), fill_rows(b, 32)
    mapping = {7: 0, 0: 11, 3: 4}
    await cache_manager.swap_blocks(a, b, mapping)
    for t in range(3):
        want = b_data[t].copy()
        for s, d in mapping.items():
            want[d] = a_data[t][s]
        assert np.array_equal(row_views(b)[t], want)
        assert np.array_equal(row_views(a)[t], a_data[t])
    await cache_manager.swap_blocks(b, a, {11: 1})
    for t in range(3):
        want = a_data[t].copy()
        want[1] = a_data[t][0]
        assert np.array_equal(row_views(a)[t], want)


async def test_swap_blocks_with_cpu_cache(cache_manager: CacheManager) -> None:
    desc = host_desc(4, [16, 2048])  # 2 KiB blocks
    blocks = cache_manager.allocate_blocks_cache(desc)
    blocks_data = fill_rows(blocks, 41)
    rng = np.random.default_rng(42)
    host = rng.integers(1, 256, size=(4, 10, 2048), dtype=np.uint8)
    host_data = host.copy()
    cpu = Cache.create_cpu_cache(host_desc(4, [10, 2048]), [int(host[i].ctypes.data) for i in range(4)])
    assert cpu.cache_id == -1 and cpu.is_blocks_cache
    # swap out: device-side blocks cache -> caller-owned host memory
    await cache_manager.swap_blocks(blocks, cpu, {15: 0, 2: 9, 3: 5})
    want_host = host_data.copy()
    for s, d in {15: 0, 2: 9, 3: 5}.items():
        want_host[:, d] = np.stack(blocks_data)[:, s]
    assert np.array_equal(host, want_host)
    # swap in: host memory -> blocks cache
    await cache_manager.swap_blocks(cpu, blocks, {1: 1, 9: 4})
    want = np.stack(blocks_data)
    want[:, 1] = want_host[:, 1]
    want[:, 4] = want_host[:, 9]
    assert np.array_equal(np.stack(row_views(blocks)), want)
    assert np.array_equal(host, want_host)


@pytest.mark.parametrize(
    "dst_shape,mapping,exc",
    [
        ([8, 128], {0: 0}, PARAM_INVALID),  # block size 128 vs 64
        ([8, 32], {0: 0}, PARAM_INVALID),
        ([8, 64], {8: 0}, PARAM_INVALID),  # source out of range
        ([8, 64], {0: 8}, PARAM_INVALID),  # destination out of range
        ([8, 64], {0: 1, 2: 1}, PARAM_INVALID),  # duplicate destination
        ([8, 64], {}, PARAM_INVALID),
        ([8, 64], {"0": 1}, TypeError),
        ([8, 64], {0: "1"}, TypeError),
        ([8, 64], {0: [1]}, TypeError),
        ([8, 64], {-1: 1}, ValueError),
        ([8, 64], {1: -1}, ValueError),
        ([8, 64], [(0, 1)], TypeError),
    ],
)
async def test_swap_blocks_invalid_changes_nothing(cache_manager: CacheManager, dst_shape: list[int],
                                                   mapping: Any, exc: Any) -> None:
    src = cache_manager.allocate_blocks_cache(host_desc(2, [8, 64]))
    dst = cache_manager.allocate_blocks_cache(host_desc(2, dst_shape))
    host = np.random.default_rng(0).integers(1, 256, size=(2, *dst_shape), dtype=np.uint8)
    host_before = host.copy()
    cpu = Cache.create_cpu_cache(host_desc(2, dst_shape), [int(host[i].ctypes.data) for i in range(2)])
    fill_rows(src, 1)
    fill_rows(dst, 2)
    before = snapshot(src, dst)
    for target in (dst, cpu):
        for a, b in ((src, target), (target, src)):  # every case is invalid in both directions
            if isinstance(exc, LLMStatusCode):
                with raises_status(exc):
                    await cache_manager.swap_blocks(a, b, mapping)
            else:
                with pytest.raises(exc):
                    await cache_manager.swap_blocks(a, b, mapping)
    assert_unchanged(before, src, dst)
    assert np.array_equal(host, host_before)


async def test_swap_blocks_kind_and_tensor_count_mismatch(cache_manager: CacheManager) -> None:
    src = cache_manager.allocate_blocks_cache(host_desc(2, [8, 64]))
    fewer = cache_manager.allocate_blocks_cache(host_desc(1, [8, 64]))
    contiguous = cache_manager.allocate_cache(host_desc(2, [8, 64]))
    for c, seed in ((src, 1), (fewer, 2), (contiguous, 3)):
        fill_rows(c, seed)
    before = snapshot(src, fewer, contiguous)
    for a, b in ((src, fewer), (fewer, src), (src, contiguous), (contiguous, src)):
        with raises_status(PARAM_INVALID):
            await cache_manager.swap_blocks(a, b, {0: 1})
    assert_unchanged(before, src, fewer, contiguous)


async def test_swap_blocks_within_one_cache(cache_manager: CacheManager) -> None:
    """A destination that is also a source of the same call is rejected, as in copy_blocks (regression: it was
    accepted and the result depended on the copy order)."""
    cache = cache_manager.allocate_blocks_cache(host_desc(2, [6, 64]))
    data = fill_rows(cache, 1)
    before = snapshot(cache)
    for mapping in ({0: 1, 1: 0}, {0: 1, 1: 2}, {3: 3}):
        with raises_status(PARAM_INVALID):
            await cache_manager.swap_blocks(cache, cache, mapping)
    assert_unchanged(before, cache)
    await cache_manager.swap_blocks(cache, cache, {0: 2, 1: 3, 5: 4})
    for got, want in zip(row_views(cache), data, strict=True):
        assert np.array_equal(got, want[[0, 1, 0, 1, 5, 5]])


# ------------------------------------------------------------------------------------------------------------
# release and cancellation during a running copy
# ------------------------------------------------------------------------------------------------------------

def big_desc() -> CacheDesc:
    return host_desc(BIG_TENSORS, [BIG_BLOCKS, BIG_BLOCK_BYTES])


def fill_block0(views: list[np.ndarray[Any, Any]], seed: int) -> np.ndarray[Any, Any]:
    """Random non-zero bytes in block 0 of every tensor; returns them as (tensors, block_bytes)."""
    rng = np.random.default_rng(seed)
    block0 = rng.integers(1, 256, size=(len(views), views[0].shape[1]), dtype=np.uint8)
    for view, row in zip(views, block0, strict=True):
        view[0] = row
    return block0


async def test_deallocate_during_copy_keeps_memory_alive(cache_manager: CacheManager, paced_copier: Any,
                                                         spawn: Any) -> None:
    cache = cache_manager.allocate_blocks_cache(big_desc())
    views = row_views(cache)
    block0 = fill_block0(views, 7)
    entry = registry_of(cache_manager).by_id(cache.cache_id)
    task = spawn(cache_manager.copy_blocks(cache, {0: list(range(1, BIG_BLOCKS))}))
    await wait_until(lambda: views[0][1, 0] != 0)  # the copy has started
    assert not task.done()
    cache_manager.deallocate_blocks_cache(cache)
    # gone for new work at once, memory kept for the running copy
    assert cache.tensor_addrs == []
    with raises_status(NOT_EXIST):
        await cache_manager.copy_blocks(cache, {0: [1]})
    assert not entry.segment.closed
    paced_copier.release()
    await task  # completes successfully
    assert entry.segment.closed
    assert views[-1][-1].any()
    for view, row in zip(views, block0, strict=True):
        assert (view == row).all()


async def test_unregister_during_copy_aborts_it(cache_manager: CacheManager, held_copier: Any,
                                                spawn: Any) -> None:
    memory = np.zeros((BIG_TENSORS, BIG_BLOCKS, BIG_BLOCK_BYTES), np.uint8)
    rng = np.random.default_rng(8)
    memory[:, 0] = rng.integers(1, 256, size=(BIG_TENSORS, BIG_BLOCK_BYTES), dtype=np.uint8)
    addrs = [int(memory[i].ctypes.data) for i in range(BIG_TENSORS)]
    cache = cache_manager.register_blocks_cache(big_desc(), addrs)
    task = spawn(cache_manager.copy_blocks(cache, {0: list(range(1, BIG_BLOCKS))}))
    await wait_until(lambda: memory[0, 1, 0] != 0)
    assert not task.done()
    cache_manager.unregister_cache(cache.cache_id)
    # from here on the caller may free or reuse the memory: nothing may write into it any more
    snap = memory.copy()
    await asyncio.sleep(0.05)
    assert np.array_equal(memory, snap)
    with raises_status(NOT_EXIST):
        await task
    assert np.array_equal(memory, snap)
    assert not memory[-1, -1].any()  # the copy was really cut short
    # the manager keeps working
    other = cache_manager.allocate_blocks_cache(host_desc(1, [4, 64]))
    data = fill_rows(other, 1)
    await cache_manager.copy_blocks(other, {0: [3]})
    assert np.array_equal(row_views(other)[0][3], data[0][0])


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_cancel_running_copy_stops_writes(cache_manager: CacheManager, paced_copier: Any, spawn: Any,
                                                how: str) -> None:
    cache = cache_manager.allocate_blocks_cache(big_desc())
    views = row_views(cache)
    block0 = fill_block0(views, 9)
    info = {0: list(range(1, BIG_BLOCKS))}
    if how == "cancel":
        task = spawn(cache_manager.copy_blocks(cache, info))
        await wait_until(lambda: views[0][1, 0] != 0)
        assert not task.done()
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.002):
                await cache_manager.copy_blocks(cache, info)
    assert time.monotonic() - started < 5.0  # promptly (the chunks in flight pause 15 ms)
    snap = [v.copy() for v in views]
    await asyncio.sleep(0.05)
    for view, before in zip(views, snap, strict=True):
        assert np.array_equal(view, before)
    assert not views[-1][-1].any()  # cut short
    # the cache and the manager still work
    paced_copier.release()
    await cache_manager.copy_blocks(cache, info)
    for view, row in zip(views, block0, strict=True):
        assert (view == row).all()
    entry = registry_of(cache_manager).by_id(cache.cache_id)
    cache_manager.deallocate_blocks_cache(cache)
    assert entry.segment.closed  # the cancelled copy left no lease behind


async def test_finalize_during_copy(datadist: LLMDataDist, paced_copier: Any, spawn: Any) -> None:
    cm = datadist.cache_manager
    cache = cm.allocate_blocks_cache(big_desc())
    views = row_views(cache)
    fill_block0(views, 10)
    entry = registry_of(cm).by_id(cache.cache_id)
    task = spawn(cm.copy_blocks(cache, {0: list(range(1, BIG_BLOCKS))}))
    await wait_until(lambda: views[0][1, 0] != 0)
    await datadist.finalize()
    with pytest.raises(LLMException):  # never a CancelledError: nobody cancelled the copy
        await task
    assert entry.segment.closed
    snap = [v.copy() for v in views]
    await asyncio.sleep(0.02)
    assert all(np.array_equal(v, s) for v, s in zip(views, snap, strict=True))


async def test_many_concurrent_copies(cache_manager: CacheManager) -> None:
    desc = host_desc(2, [16, 16 << 10])
    caches = [cache_manager.allocate_blocks_cache(desc) for _ in range(32)]
    datas = [fill_rows(c, 100 + i) for i, c in enumerate(caches)]
    infos = [{i % 16: [(i + 1 + k) % 16 for k in range(1 + i % 8)]} for i in range(32)]
    await asyncio.gather(*(cache_manager.copy_blocks(c, info) for c, info in zip(caches, infos, strict=True)))
    for cache, data, info in zip(caches, datas, infos, strict=True):
        for got, want in zip(row_views(cache), data, strict=True):
            expected = want.copy()
            for s, dsts in info.items():
                expected[dsts] = want[s]
            assert np.array_equal(got, expected)


async def test_concurrent_copies_on_one_cache(cache_manager: CacheManager) -> None:
    cache = cache_manager.allocate_blocks_cache(host_desc(4, [64, 64 << 10]))
    data = fill_rows(cache, 3)
    # 8 sources (blocks 0..7), each copied to its own 7 destinations, as 8 concurrent calls
    infos = [{s: [8 + s * 7 + k for k in range(7)]} for s in range(8)]
    await asyncio.gather(*(cache_manager.copy_blocks(cache, info) for info in infos))
    for got, want in zip(row_views(cache), data, strict=True):
        expected = want.copy()
        for info in infos:
            for s, dsts in info.items():
                expected[dsts] = want[s]
        assert np.array_equal(got, expected)


# ------------------------------------------------------------------------------------------------------------
# deterministic versions: a copier whose chunks stay "in flight" for a known time
# ------------------------------------------------------------------------------------------------------------

HOLD_S = 30.0
"""The longest a held chunk waits for the gate or its job's stop (a test that never opens it still ends)."""


class SlowCopier:
    """Wraps the manager's local copier: each chunk signals that it started, then waits ``delay`` seconds (or
    until ``gate`` is set) before really copying.  Late writes therefore land long after a broken
    implementation would have returned.

    With ``hold_from``, chunks started after the first ``hold_from`` first wait until the gate opens or their
    job is stopped: a copy cannot end before its test lets it (:meth:`release`), however long the event loop
    is kept from running on a loaded machine; a stop lets them go at once (to copy nothing, if it works)."""

    def __init__(self, delay: float | None, *, hold_after_first: bool = False,
                 hold_from: int | None = None) -> None:
        self.delay = delay
        self.hold_after_first = hold_after_first  # the chunk at span 0 runs at once, every other one is held
        self.hold_from = hold_from
        self.started = threading.Event()
        self.gate = threading.Event()
        self.chunks = 0
        self._count = threading.Lock()

    def release(self) -> None:
        """Let every held chunk go, and later ones run without a pause."""
        self.delay = 0.0
        self.gate.set()

    def _hold(self, stop: Any) -> None:
        deadline = time.monotonic() + HOLD_S
        while not self.gate.is_set() and not stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)

    def before_chunk(self, lo: int, stop: Any) -> None:
        with self._count:
            index = self.chunks
            self.chunks += 1
        self.started.set()
        if self.hold_after_first:
            # Held until the gate opens or the job is stopped: the copy stays mid-way, however slow.
            if lo != 0:
                self._hold(stop)
        elif self.delay is not None:
            if self.hold_from is not None and index >= self.hold_from:
                self._hold(stop)
            time.sleep(self.delay)
        else:
            self.gate.wait(HOLD_S)

    def install(self, monkeypatch: pytest.MonkeyPatch, manager: CacheManager) -> CopyExecutor:
        """Give ``manager`` its own Python executor whose chunk runners pause first (the native pool runs no
        Python per chunk, so its timing cannot be steered this way)."""
        real = executor_module.bind_runner

        def bind(spec: Any, spans: Any) -> Any:
            run_real = real(spec, spans)

            def run(lo: int, hi: int, stop: Any) -> None:
                self.before_chunk(lo, stop)
                run_real(lo, hi, stop)

            return run

        monkeypatch.setattr(executor_module, "bind_runner", bind)
        executor = CopyExecutor()
        monkeypatch.setattr(engine_of(manager), "_executor", executor)
        return executor


@pytest.fixture
def slow_copier(monkeypatch: pytest.MonkeyPatch, cache_manager: CacheManager) -> Iterator[SlowCopier]:
    """The real copier, 100 ms pause before each chunk; a 16 MiB copy's first two chunks (one per worker) run,
    its others are held until the test releases them or stops the copy."""
    copier = SlowCopier(0.1, hold_from=2)
    executor = copier.install(monkeypatch, cache_manager)
    yield copier
    copier.gate.set()
    executor.shutdown()


@pytest.fixture
def held_copier(monkeypatch: pytest.MonkeyPatch, cache_manager: CacheManager) -> Iterator[SlowCopier]:
    """The real copier: the first chunk copies at once, the others wait until the job is stopped (or the gate
    opens), so a copy is mid-way for as long as a test needs."""
    copier = SlowCopier(None, hold_after_first=True)
    executor = copier.install(monkeypatch, cache_manager)
    yield copier
    copier.gate.set()
    executor.shutdown()


@pytest.fixture
def paced_copier(monkeypatch: pytest.MonkeyPatch, cache_manager: CacheManager) -> Iterator[SlowCopier]:
    """The real copier, 15 ms pause before each chunk (<= 16 MiB): a 128 MiB copy (eight chunks) copies its
    first four, the others held until the test releases them or stops the copy."""
    copier = SlowCopier(0.015, hold_from=4)
    executor = copier.install(monkeypatch, cache_manager)
    yield copier
    copier.gate.set()
    executor.shutdown()


def edges(views: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    """First and last byte of every block of every tensor: a snapshot fast enough to beat a late chunk."""
    return np.stack([v[:, [0, -1]] for v in views])


MID_DESC = (8, [64, 32 << 10])  # 16 MiB: several executor chunks per full copy


async def test_cancel_waits_for_chunks_in_flight(cache_manager: CacheManager, slow_copier: SlowCopier,
                                                  spawn: Any) -> None:
    cache = cache_manager.allocate_blocks_cache(host_desc(*MID_DESC))
    views = row_views(cache)
    block0 = fill_block0(views, 12)
    task = spawn(cache_manager.copy_blocks(cache, {0: list(range(1, 64))}))
    await wait_until(slow_copier.started.is_set)
    task.cancel()
    started = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await task
    quick, full = edges(views), [v.copy() for v in views]
    assert time.monotonic() - started < 5.0  # bounded by the chunks in flight (100 ms each), not 30 s
    await asyncio.sleep(0.25)  # well past the in-flight chunks' delay
    assert np.array_equal(edges(views), quick)
    assert all(np.array_equal(v, f) for v, f in zip(views, full, strict=True))
    assert not views[-1][-1].any()  # pending chunks were dropped
    # the manager still works afterwards
    slow_copier.release()
    await cache_manager.copy_blocks(cache, {0: list(range(1, 64))})
    assert all((v == row).all() for v, row in zip(views, block0, strict=True))


async def test_unregister_waits_for_chunks_in_flight(cache_manager: CacheManager, slow_copier: SlowCopier,
                                                     spawn: Any) -> None:
    n, shape = MID_DESC
    memory = np.zeros((n, *shape), np.uint8)
    memory[:, 0] = np.random.default_rng(13).integers(1, 256, size=(n, shape[1]), dtype=np.uint8)
    addrs = [int(memory[i].ctypes.data) for i in range(n)]
    cache = cache_manager.register_blocks_cache(host_desc(*MID_DESC), addrs)
    task = spawn(cache_manager.copy_blocks(cache, {0: list(range(1, 64))}))
    await wait_until(slow_copier.started.is_set)
    cache_manager.unregister_cache(cache.cache_id)
    quick, full = edges(list(memory)), memory.copy()
    await asyncio.sleep(0.25)
    assert np.array_equal(edges(list(memory)), quick)
    assert np.array_equal(memory, full)
    with raises_status(NOT_EXIST):
        await task
    assert not memory[-1, -1].any()


async def test_deallocate_during_slow_copy(cache_manager: CacheManager, slow_copier: SlowCopier,
                                           spawn: Any) -> None:
    cache = cache_manager.allocate_blocks_cache(host_desc(*MID_DESC))
    views = row_views(cache)
    block0 = fill_block0(views, 14)
    entry = registry_of(cache_manager).by_id(cache.cache_id)
    task = spawn(cache_manager.copy_blocks(cache, {0: list(range(1, 64))}))
    await wait_until(slow_copier.started.is_set)
    cache_manager.deallocate_blocks_cache(cache)
    assert not entry.segment.closed
    slow_copier.gate.set()  # the held chunks go on (after their pause)
    await task
    assert entry.segment.closed
    assert all((v == row).all() for v, row in zip(views, block0, strict=True))


async def test_finalize_waits_for_chunks_in_flight(datadist: LLMDataDist, slow_copier: SlowCopier,
                                                   spawn: Any) -> None:
    cm = datadist.cache_manager
    cache = cm.allocate_blocks_cache(host_desc(*MID_DESC))
    views = row_views(cache)
    fill_block0(views, 15)
    entry = registry_of(cm).by_id(cache.cache_id)
    # another instance keeps the shared worker threads alive, so finalize cannot rely on joining them
    other = LLMDataDist(LLMRole.DECODER, new_cluster_id())
    await other.init(LLMConfig().generate_options())
    try:
        task = spawn(cm.copy_blocks(cache, {0: list(range(1, 64))}))
        await wait_until(slow_copier.started.is_set)
        await datadist.finalize()
        # finalize has returned: no worker may touch the cache any more, and its memory is released
        quick, full = edges(views), [v.copy() for v in views]
        assert entry.segment.closed
        await asyncio.sleep(0.25)
        assert np.array_equal(edges(views), quick)
        assert all(np.array_equal(v, f) for v, f in zip(views, full, strict=True))
        assert task.done()
        assert not views[-1][-1].any()
        # the other instance is unaffected
        small = other.cache_manager.allocate_blocks_cache(host_desc(1, [4, 64]))
        data = fill_rows(small, 2)
        slow_copier.release()
        await other.cache_manager.copy_blocks(small, {1: [2]})
        assert np.array_equal(row_views(small)[0][2], data[0][1])
    finally:
        await other.finalize()


async def test_finalize_fails_queued_copy_with_llm_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: finalize cancelled the internal future of a job with no chunk in flight, so the copy
    coroutine raised CancelledError although nobody had cancelled it."""
    copier = SlowCopier(None)  # chunks block on copier.gate
    busy = LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    victim = LLMDataDist(LLMRole.DECODER, new_cluster_id())
    await busy.init(LLMConfig().generate_options())
    await victim.init(LLMConfig().generate_options())
    executor = copier.install(monkeypatch, busy.cache_manager)  # one slowed executor for both instances
    monkeypatch.setattr(engine_of(victim.cache_manager), "_executor", executor)
    try:
        # occupy every worker of the shared executor with chunks that wait on the gate
        big = busy.cache_manager.allocate_blocks_cache(host_desc(*MID_DESC))
        blocker = asyncio.create_task(busy.cache_manager.copy_blocks(big, {0: list(range(1, 64))}))
        await wait_until(lambda: copier.chunks >= 2)
        # a copy of the other instance is queued behind them, no chunk of it in flight
        small = victim.cache_manager.allocate_blocks_cache(host_desc(1, [4, 64]))
        queued = asyncio.create_task(victim.cache_manager.copy_blocks(small, {0: [1]}))
        await asyncio.sleep(0.01)
        assert not queued.done()
        await victim.finalize()
        result = (await asyncio.gather(queued, return_exceptions=True))[0]
        assert isinstance(result, LLMException), repr(result)
    finally:
        copier.gate.set()
        await asyncio.gather(blocker, return_exceptions=True)
        await victim.finalize()
        await busy.finalize()
        executor.shutdown()
