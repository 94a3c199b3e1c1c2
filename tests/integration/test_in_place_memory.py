"""Host memory shared in place (``CacheManager.share_host_memory``): an engine's own tensors become reachable by
same-host peers through shared memory without moving.  The content and every pointer survive the switch, the
bytes around the ranges stay private, transfers inside the shared pages take the mapped path (they work where
process_vm_* is refused: ``AIODATADIST_SAME_HOST=map``), and transfers touching a tensor's partial edge pages
go the unshared way (process_vm_*), never through the file's holes."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os

import numpy as np
import pytest
from helpers.data import blocks, fill_pattern, pattern
from helpers.internals import registry_of
from helpers.requests import count_begins

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.memory import in_place
from aiodatadist.native import DIR_WORDS, DirWord
from aiodatadist.testing import PeerProcess, linked_pair

PAGE = mmap.PAGESIZE
DESC = CacheDesc(4, (8, 4096), DataType.DT_UINT8, Placement.HOST)  # 8 blocks of 4 KiB a tensor
HEAD = 64  # each tensor starts 64 bytes into a page: blocks 0 and 7 touch its partial edge pages
INTERIOR = [1, 2, 3, 4, 5, 6]


def unaligned_tensors(seed: int, desc: CacheDesc = DESC) -> tuple[np.ndarray, list[np.ndarray]]:
    """One random buffer holding ``desc.num_tensors`` tensors, each 64 bytes past a page, a page apart.

    The buffer is a mapping of its own, never memory of malloc's heap: once shared in place its pages are shared
    file pages for good, and a heap chunk given back to malloc afterwards would be shared with every child this
    process forks until it execs (each subprocess a later test starts), whose writes would then corrupt this
    process's heap (docs/api.md, ``share_host_memory``)."""
    pitch = (desc.size + 2 * PAGE) // PAGE * PAGE
    nbytes = desc.num_tensors * pitch + 2 * PAGE
    whole = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)  # unmapped once no view is left
    whole[:] = np.random.default_rng(seed).integers(1, 256, nbytes, dtype=np.uint8)
    first = -whole.ctypes.data % PAGE + HEAD
    return whole, [whole[first + i * pitch: first + i * pitch + desc.size] for i in range(desc.num_tensors)]


def ranges_of(tensors: list[np.ndarray]) -> list[tuple[int, int]]:
    return [(int(t.ctypes.data), t.nbytes) for t in tensors]


@pytest.mark.parametrize("piece_pages", [None, 1, 3])
async def test_sharing_keeps_the_memory_its_content_and_the_bytes_around_it(piece_pages: int | None,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Also with the switch cut into pieces of 1 and 3 pages (copied and pre-faulted on several threads)."""
    if piece_pages is not None:
        monkeypatch.setattr(in_place, "SWITCH_PIECE", piece_pages * PAGE)
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({})
        whole, tensors = unaligned_tensors(1)
        before = whole.copy()
        memory = dd.cache_manager.share_host_memory(ranges_of(tensors))
        assert memory.is_in_place and not memory.closed
        assert np.array_equal(whole, before)  # content, edges and the bytes between ranges unchanged
        assert memory.address == tensors[0].ctypes.data - HEAD + PAGE  # the first whole page

        fd = memory.segment.fd
        assert fd is not None
        handle = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        with mmap.mmap(handle, memory.size) as other:
            shared = np.frombuffer(other, dtype=np.uint8)
            for t in tensors:
                offset = t.ctypes.data - memory.address
                inner = slice(PAGE - HEAD, DESC.size - HEAD)  # the tensor's bytes on its whole pages
                assert np.array_equal(shared[offset + inner.start: offset + inner.stop], t[inner])
                t[5000] ^= 0xFF  # one memory: a write either way is seen the other way
                assert shared[offset + 5000] == t[5000]
                shared[offset + 6000] ^= 0xFF
                assert t[6000] == shared[offset + 6000]
                if offset >= 0:  # (the first tensor's head page lies before the segment)
                    t[10] ^= 0xFF  # the partial head page is not shared: a hole of the file
                    assert shared[offset + 10] == 0
            del shared
        os.close(handle)
        entry_window = memory.window(np.array([t.ctypes.data for t in tensors], dtype=np.uint64), DESC.size)
        assert entry_window == (PAGE - HEAD, DESC.size - HEAD)
        cache = dd.cache_manager.register_blocks_cache(DESC, [t.ctypes.data for t in tensors], BlocksCacheKey(1, 0))
        entry = registry_of(dd.cache_manager).by_id(cache.cache_id)
        assert entry.host_memory is memory and entry.shared_window == entry_window
        # Over TCP its row names each tensor, not the span of them all (which holds other data of the process).
        row = registry_of(dd.cache_manager).directory._words.reshape(-1, DIR_WORDS)[entry.published[0]]
        assert entry.tcp_readable and row[DirWord.SIZE] == DESC.size and row[DirWord.TENSORS] == len(tensors)
        table = np.frombuffer((ctypes.c_uint64 * len(tensors)).from_address(int(row[DirWord.TABLE])), np.uint64)
        assert table.tolist() == sorted(t.ctypes.data for t in tensors)
        # A cache outside the ranges is plain registered memory.
        other_tensors = [np.ones(DESC.size, dtype=np.uint8) for _ in range(4)]
        plain = dd.cache_manager.register_blocks_cache(DESC, [t.ctypes.data for t in other_tensors])
        assert registry_of(dd.cache_manager).by_id(plain.cache_id).host_memory is None
        dd.cache_manager.unregister_cache(cache.cache_id)
        dd.cache_manager.unregister_cache(plain.cache_id)
        memory.close()
        assert memory.closed
        tensors[0][5] = 7  # the memory stays the caller's
        assert tensors[0][5] == 7


async def test_bad_ranges_are_refused_and_change_nothing() -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({})
        cm = dd.cache_manager
        whole, tensors = unaligned_tensors(2)
        before = whole.copy()
        base = int(tensors[0].ctypes.data)
        for ranges, why in (([], "at least one"), ([(base, DESC.size), (base + 100, 10)], "overlap"),
                            ([(base, 100)], "whole page"), ([(base, 0)], "> 0"),
                            ([(base, DESC.size), (base + (1 << 34), DESC.size)], "scattered")):
            with pytest.raises(LLMException) as info:
                cm.share_host_memory(ranges)
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
            assert why in str(info.value)
        for bad in ([base], [(base,)], "ranges", [("a", 1)]):
            with pytest.raises((TypeError, LLMException)):
                cm.share_host_memory(bad)  # type: ignore[arg-type]
        assert np.array_equal(whole, before)


@pytest.mark.parametrize("same_host", ["map", "map,pvm"])
async def test_transfers_inside_the_shared_pages_take_the_mapped_path(same_host: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With process_vm_* refused (``map``), blocks on whole pages still move, one-sided after the first transfer;
    a block on an edge page fails cleanly there, and moves the unshared way where process_vm_* is allowed."""
    monkeypatch.setenv("AIODATADIST_SAME_HOST", same_host)
    async with linked_pair() as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        _, tensors = unaligned_tensors(3)
        memory = pcm.share_host_memory(ranges_of(tensors))
        src = pcm.register_blocks_cache(DESC, [t.ctypes.data for t in tensors], BlocksCacheKey(1, 3))
        fill_pattern(src, 11)
        dst = dcm.allocate_blocks_cache(DESC)
        fill_pattern(dst, 12)
        begins = count_begins(decoder)
        for s, d in ([1, 2], [5, 0]), ([6], [3]), ([3, 4, 5], [1, 2, 4]):
            await dcm.pull_blocks(BlocksCacheKey(1, 3), dst, s, d)
            assert all(np.array_equal(w, g) for w, g in zip(blocks(src, s), blocks(dst, d)))
        for s, d in ([0], [6]), ([2, 3], [1, 5]):
            await dcm.push_blocks(BlocksCacheKey(1, 3), dst, s, d)
            assert all(np.array_equal(w, g) for w, g in zip(blocks(dst, s), blocks(src, d)))
        assert begins() == 1

        edge = [([0], [0]), ([7], [7])]
        if same_host == "map":
            src_before, dst_before = blocks(src, list(range(8))), blocks(dst, list(range(8)))
            for s, d in edge:
                for attempt in (dcm.pull_blocks(BlocksCacheKey(1, 3), dst, s, d),
                                dcm.push_blocks(BlocksCacheKey(1, 3), dst, s, d)):
                    with pytest.raises(LLMException) as info:
                        await attempt
                    assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
            assert all(np.array_equal(a, b) for a, b in zip(src_before, blocks(src, list(range(8)))))
            assert all(np.array_equal(a, b) for a, b in zip(dst_before, blocks(dst, list(range(8)))))
        else:
            for t, tensor in enumerate(tensors):
                tensor[:] = pattern(21, t, DESC.size)
            for s, d in edge:
                await dcm.pull_blocks(BlocksCacheKey(1, 3), dst, s, d)
                assert all(np.array_equal(w, g) for w, g in zip(blocks(src, s), blocks(dst, d)))
            fill_pattern(dst, 22)
            await dcm.push_blocks(BlocksCacheKey(1, 3), dst, [0, 7, 1], [7, 0, 6])
            assert all(np.array_equal(w, g) for w, g in zip(blocks(dst, [0, 7, 1]), blocks(src, [7, 0, 6])))
        await dcm.pull_blocks(BlocksCacheKey(1, 3), dst, [4], [4])  # the link still works
        assert np.array_equal(blocks(src, [4])[0], blocks(dst, [4])[0])
        # The file holds the tensors' whole pages and nothing else: the peer's mapping did not fill its holes
        # (pre-faulting runs in the background: wait until it reached the tensors' pages, then a while longer).
        fd = memory.segment.fd
        assert fd is not None
        pages = DESC.num_tensors * (DESC.size // PAGE - 1) * PAGE
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while os.fstat(fd).st_blocks * 512 < pages and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert os.fstat(fd).st_blocks * 512 == pages < memory.size


async def test_another_process_s_memory_shared_in_place_without_pvm(
        peer_without_pvm: tuple[PeerProcess, LLMDataDist]) -> None:
    """A real peer process shares its registered tensors in place; process_vm_* is refused, so every byte that
    moves goes through the shared pages."""
    peer, dd = peer_without_pvm
    assert dd.links()[0]["peer"] == "same host (map)"
    shape = [int(d) for d in DESC.shape]
    mine = await peer.call("register", blocks=True, num_tensors=4, shape=shape, blocks_key=[1, 0], in_place=True)
    await peer.call("fill", cache_id=mine["cache_id"], seed=7)
    cm = dd.cache_manager
    dst = cm.allocate_blocks_cache(DESC)
    await cm.pull_blocks(BlocksCacheKey(1, 0), dst, [1, 6, 3], [3, 4, 5])
    for t, tensor in enumerate(dst.tensors):
        expected = pattern(7, t, DESC.size).reshape(8, -1)
        assert np.array_equal(tensor.reshape(8, -1)[[3, 4, 5]], expected[[1, 6, 3]])
    for t, tensor in enumerate(dst.tensors):
        tensor.reshape(-1)[:] = pattern(9, t, DESC.size)
    await cm.push_blocks(BlocksCacheKey(1, 0), dst, [2], [5])
    for t in range(4):
        got = await peer.call("read", cache_id=mine["cache_id"], tensor=t, offset=5 * 4096, nbytes=4096)
        assert bytes.fromhex(got) == pattern(9, t, DESC.size)[2 * 4096: 3 * 4096].tobytes()
    with pytest.raises(LLMException) as info:  # block 0 lies partly on an unshared page
        await cm.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
    assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
