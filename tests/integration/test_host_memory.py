"""Shareable host memory for engines (``CacheManager.allocate_host_memory``): caches registered inside it take
the mapped path (published in the owner's directory, copied by the requester's own threads, no
process_vm_readv/writev), its lifetime rules, and the clear error when process_vm_* is refused for registered
memory outside it.  ``AIODATADIST_SAME_HOST=map`` stands in for an OS that refuses process_vm_*."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from helpers.data import blocks, fill_pattern, pattern
from helpers.internals import registry_of
from helpers.requests import count_begins

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    HostMemory,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.memory.segment import PAGE
from aiodatadist.testing import PeerProcess, linked_pair

DESC = CacheDesc(4, (8, 4096), DataType.DT_UINT8, Placement.HOST)
NOT_EXIST = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST






def register_inside(cm: object, memory: HostMemory, desc: CacheDesc, key: BlocksCacheKey, offset: int = 0) -> object:
    addrs = [memory.address + offset + i * desc.size for i in range(desc.num_tensors)]
    return cm.register_blocks_cache(desc, addrs, key)  # type: ignore[attr-defined]


# -- the memory and its lifetime ----------------------------------------------------------------------------------
async def test_host_memory_is_shared_zeroed_and_closed_by_its_rules() -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({})
        cm = dd.cache_manager
        with pytest.raises(LLMException) as info:
            cm.allocate_host_memory(0)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        memory = cm.allocate_host_memory(DESC.size * DESC.num_tensors + 1)
        assert memory.size >= DESC.size * DESC.num_tensors + 1 and memory.size % PAGE == 0
        whole = memory.array()
        assert whole.ctypes.data == memory.address and len(whole) == memory.size and not whole.any()
        floats = memory.array(np.float32)
        floats[:4] = [1.0, 2.0, 3.0, 4.0]
        assert whole[:16].tobytes() == np.array([1, 2, 3, 4], dtype=np.float32).tobytes()  # one memory

        cache = register_inside(cm, memory, DESC, BlocksCacheKey(1, 0))
        entry = registry_of(cm).by_id(cache.cache_id)
        assert entry.host_memory is memory and entry.published is not None and not entry.owned
        assert memory.registrations == 1
        with pytest.raises(LLMException) as info:
            memory.close()  # registered caches first
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert not memory.closed
        cm.unregister_cache(cache.cache_id)  # type: ignore[attr-defined]
        assert memory.registrations == 0 and entry.published is None
        memory.close()
        memory.close()  # idempotent
        assert memory.closed
        assert whole[3] == 0x3F  # views handed out earlier keep their pages (1.0f: 00 00 80 3f)

        # Straddling the end: plain registered memory (not published); another instance's memory is not ours.
        with cm.allocate_host_memory(DESC.size) as small:
            outside = cm.register_blocks_cache(DESC, [small.address + i * DESC.size for i in range(4)])
            assert registry_of(cm).by_id(outside.cache_id).host_memory is None
            cm.unregister_cache(outside.cache_id)
        assert small.closed

        kept = cm.allocate_host_memory(4096)
        register_inside(cm, kept, CacheDesc(1, (1, 4096), DataType.DT_UINT8, Placement.HOST), BlocksCacheKey(1, 1))
    assert kept.closed  # finalize closes it, registrations and all


async def test_torch_views_share_the_memory() -> None:
    torch = pytest.importorskip("torch")
    from aiodatadist.torch import host_memory_tensor, register_blocks_cache_from_tensors, tensors_of

    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({})
        cm = dd.cache_manager
        memory = cm.allocate_host_memory(2 * 8 * 64 * 2)
        k = host_memory_tensor(memory, torch.bfloat16, (8, 64))
        v = host_memory_tensor(memory, DataType.DT_BF16, (8, 64), offset=8 * 64 * 2)
        assert k.dtype == torch.bfloat16 and k.data_ptr() == memory.address
        assert v.data_ptr() == memory.address + 8 * 64 * 2
        k.fill_(1.5)
        raw = memory.array(np.uint16)
        assert (raw[: 8 * 64] == torch.tensor(1.5, dtype=torch.bfloat16).view(torch.int16).item()).all()
        assert not raw[8 * 64:].any()
        with pytest.raises(LLMException):
            host_memory_tensor(memory, torch.float32, (memory.size,))  # does not fit
        with pytest.raises(LLMException):
            host_memory_tensor(memory, torch.float32, (2,), offset=2)  # misaligned
        cache = register_blocks_cache_from_tensors(cm, [k, v], BlocksCacheKey(1, 0))
        assert registry_of(cm).by_id(cache.cache_id).host_memory is memory
        assert torch.equal(tensors_of(cache)[0], k)


# -- transfers -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("same_host", ["map,pvm", "map"])
async def test_pulls_and_pushes_take_the_mapped_path(same_host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeated pulls from a cache registered in HostMemory ask the owner once, and work where process_vm_* is
    refused; pushes into it are exact, and one-sided too once the key is resolved (unregistering WITHDRAWs them)."""
    monkeypatch.setenv("AIODATADIST_SAME_HOST", same_host)
    async with linked_pair() as (prompt, decoder):
        assert decoder.links()[0]["peer"] == f"same host ({same_host.replace(',', '+')})"
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        memory = pcm.allocate_host_memory(DESC.size * DESC.num_tensors + PAGE)
        src = register_inside(pcm, memory, DESC, BlocksCacheKey(1, 3), offset=PAGE)  # not at the base
        fill_pattern(src, 11)  # type: ignore[arg-type]
        dst = dcm.allocate_blocks_cache(DESC)
        fill_pattern(dst, 12)
        begins = count_begins(decoder)
        for i, (s, d) in enumerate([([1, 2], [5, 0]), ([7], [3]), ([0, 4, 6], [1, 2, 4])]):
            await dcm.pull_blocks(BlocksCacheKey(1, 3), dst, s, d)
            for want, got in zip(blocks(src, s), blocks(dst, d)):
                assert np.array_equal(want, got), f"pull {i}"
        assert begins() == 1

        for i, (s, d) in enumerate([([0], [6]), ([2, 3], [0, 1])]):
            await dcm.push_blocks(BlocksCacheKey(1, 3), dst, s, d)
            for want, got in zip(blocks(dst, s), blocks(src, d)):
                assert np.array_equal(want, got), f"push {i}"
        assert begins() == 1

        if same_host == "map":  # registered memory outside any HostMemory: only process_vm_* would reach it
            plain = [np.zeros(DESC.size, dtype=np.uint8) for _ in range(DESC.num_tensors)]
            pcm.register_blocks_cache(DESC, [int(a.ctypes.data) for a in plain], BlocksCacheKey(1, 4))
            before = blocks(dst, [0])
            for attempt in (dcm.pull_blocks(BlocksCacheKey(1, 4), dst, [1], [0]),
                            dcm.push_blocks(BlocksCacheKey(1, 4), dst, [1], [0])):
                with pytest.raises(LLMException) as info:
                    await attempt
                assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
                message = str(info.value)
                assert "allocate_host_memory" in message and "llm.Transport=tcp" in message
                assert "ptrace" in message
            assert all(np.array_equal(a, b) for a, b in zip(before, blocks(dst, [0])))
            assert not any(p.any() for p in plain)
            await dcm.pull_blocks(BlocksCacheKey(1, 3), dst, [5], [5])  # the link still works
            assert np.array_equal(blocks(src, [5])[0], blocks(dst, [5])[0])


@pytest.mark.parametrize("op", ["pull", "push"])
async def test_unregister_during_a_transfer_aborts_it(op: str) -> None:
    # 256 MiB: the copy must still run when the owner's ABORT arrives, even on a loaded 2-core machine (at 64 MiB
    # it sometimes finished first, and the push rightly succeeded)
    big = CacheDesc(16, (64, 256 << 10), DataType.DT_UINT8, Placement.HOST)
    async with linked_pair() as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        memory = pcm.allocate_host_memory(big.size * big.num_tensors)
        src = register_inside(pcm, memory, big, BlocksCacheKey(1, 9))
        dst = dcm.allocate_blocks_cache(big)
        fill_pattern(dst, 5)
        await dcm.pull_blocks(BlocksCacheKey(1, 9), dst, [0], [0])  # resolved once through the owner
        plane = next(iter(decoder._links.links.values())).plane
        link = decoder._transfers.state_of(next(iter(decoder._links.links.values())))
        every = list(range(64))
        call = dcm.pull_blocks if op == "pull" else dcm.push_blocks
        task = asyncio.ensure_future(call(BlocksCacheKey(1, 9), dst, every, every))
        while not plane.moving():
            await asyncio.sleep(0)
        pcm.unregister_cache(src.cache_id)  # type: ignore[attr-defined]
        with pytest.raises(LLMException) as info:
            await task
        assert info.value.status_code == NOT_EXIST
        assert not plane.moving() and not link.resolved
        memory.close()  # nothing registered any more

        again = pcm.allocate_host_memory(big.size * big.num_tensors)
        cache = register_inside(pcm, again, big, BlocksCacheKey(1, 9))
        fill_pattern(cache, 6)  # type: ignore[arg-type]
        await dcm.pull_blocks(BlocksCacheKey(1, 9), dst, [4, 5], [4, 5])
        assert all(np.array_equal(a, b) for a, b in zip(blocks(cache, [4, 5]), blocks(dst, [4, 5])))


# -- with a real peer process, process_vm_* refused on both sides (fixture peer_without_pvm: conftest) ----------


async def test_another_process_s_host_memory_without_pvm(peer_without_pvm: tuple[PeerProcess, LLMDataDist]) -> None:
    peer, dd = peer_without_pvm
    assert dd.links()[0]["peer"] == "same host (map)"
    shape = [int(d) for d in DESC.shape]
    mine = await peer.call("register", blocks=True, num_tensors=4, shape=shape, blocks_key=[1, 0], host_memory=True)
    await peer.call("fill", cache_id=mine["cache_id"], seed=7)
    cm = dd.cache_manager
    dst = cm.allocate_blocks_cache(DESC)
    begins = count_begins(dd)
    for s, d in ([1, 2], [3, 4]), ([7], [0]), ([0, 5], [6, 7]):
        await cm.pull_blocks(BlocksCacheKey(1, 0), dst, s, d)
        for t, tensor in enumerate(dst.tensors):
            expected = pattern(7, t, DESC.size).reshape(8, -1)
            assert np.array_equal(tensor.reshape(8, -1)[d], expected[s])
    assert begins() == 1

    for t, tensor in enumerate(dst.tensors):
        tensor.reshape(-1)[:] = pattern(9, t, DESC.size)
    await cm.push_blocks(BlocksCacheKey(1, 0), dst, [2], [6])
    got = await peer.call("read", cache_id=mine["cache_id"], tensor=3, offset=6 * 4096, nbytes=4096)
    assert bytes.fromhex(got) == pattern(9, 3, DESC.size)[2 * 4096: 3 * 4096].tobytes()

    plain = await peer.call("register", blocks=True, num_tensors=4, shape=shape, blocks_key=[1, 1])
    with pytest.raises(LLMException) as info:
        await cm.pull_blocks(BlocksCacheKey(1, 1), dst, [0], [0])
    assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert "allocate_host_memory" in str(info.value)
    await peer.call("release", cache_id=plain["cache_id"], how="unregister")
