"""The cache directory: transfers by a key the owner already resolved skip the round trip, and stay exact.

The table's semantics are checked as a property against a model; the transfer path with two real instances
linked over ZeroMQ on 127.0.0.1 (in this process, so that the test can act between a copy's start and its end).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
from typing import Any

import numpy as np
import pytest
from helpers.data import blocks, fill_pattern, pattern
from helpers.requests import count_begins
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMException,
    LLMLinkError,
    LLMStatusCode,
    Placement,
)
from aiodatadist.registry.publication import CacheDirectory
from aiodatadist.testing import linked_pair
from aiodatadist.transport.directory import DirectoryView

NOT_EXIST = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


# -- the table -----------------------------------------------------------------------------------------------

operations = st.lists(st.one_of(
    st.tuples(st.just("publish"), st.integers(-1, 5)),
    st.tuples(st.just("withdraw"), st.integers(0, 7)),
    st.tuples(st.just("model"), st.integers(0, 7), st.integers(-1, 5)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_directory_matches_a_model(ops: list[tuple[Any, ...]]) -> None:
    """A published (row, stamp) is live until withdrawn, never again after (rows are reused with new stamps),
    and answers to the model id last set for it; a full table publishes nothing."""
    directory = CacheDirectory(rows=4)
    view = DirectoryView(directory.identity)
    try:
        live: dict[int, tuple[int, int, int, int]] = {}  # cache id -> (row, stamp, cache id, model)
        dead: list[tuple[int, int, int]] = []
        next_id = 1
        for op in ops:
            if op[0] == "publish":
                published = directory.publish(next_id, op[1])
                if len(live) == 4:
                    assert published is None
                else:
                    assert published is not None
                    live[next_id] = (*published, next_id, op[1])
                next_id += 1
            elif live:
                cache_id = sorted(live)[op[1] % len(live)]
                row, stamp, _, model = live[cache_id]
                if op[0] == "withdraw":
                    directory.withdraw(row)
                    del live[cache_id]
                    dead.append((row, stamp, cache_id))
                else:
                    directory.set_model(row, op[2])
                    live[cache_id] = (row, stamp, cache_id, op[2])
            for row, stamp, cache_id, model in live.values():
                assert view.live(row, stamp, cache_id, None)
                assert view.live(row, stamp, cache_id, model)
                assert not view.live(row, stamp, cache_id, model + 1)
                assert not view.live(row, stamp + 1, cache_id, None)
            for row, stamp, cache_id in dead:
                assert not view.live(row, stamp, cache_id, None)
        assert not view.live(99, 1, 1, None)  # rows outside the table are never live
    finally:
        view.close()
        directory.close()


def test_peers_map_the_directory_read_only() -> None:
    directory = CacheDirectory(rows=4)
    view = DirectoryView(directory.identity)
    try:
        with pytest.raises(TypeError, match="read-only"):
            view._words[0] = 1  # a peer can never forge a live entry
    finally:
        view.close()
        directory.close()


# -- transfers -----------------------------------------------------------------------------------------------

DESC = CacheDesc(4, (8, 256), DataType.DT_UINT8, Placement.HOST)






def config(transport: str) -> LLMConfig:
    cfg = LLMConfig()
    cfg.transport = transport
    return cfg


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("directory", ["on", "off"])
async def test_repeated_pulls_ask_the_owner_once(directory: str, transport: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Same host: the requester checks the owner's directory itself.  TCP: the owner's native threads serve a
    one-sided read (AIODATADIST_NET=python: no one-sided reads, every pull asks)."""
    if directory == "off":
        monkeypatch.setenv("AIODATADIST_DIRECTORY" if transport == "shm" else "AIODATADIST_NET",
                           "0" if transport == "shm" else "python")
    async with linked_pair(config=config(transport)) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 3))
        dst = decoder.cache_manager.allocate_blocks_cache(DESC)
        fill_pattern(src, 11)
        fill_pattern(dst, 12)
        begins = count_begins(decoder)
        for i, (s, d) in enumerate([([1, 2], [5, 0]), ([7], [3]), ([0, 4, 6], [1, 2, 4])]):
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 3), dst, s, d)
            for want, got in zip(blocks(src, s), blocks(dst, d)):
                assert np.array_equal(want, got), f"pull {i}"
        assert begins() == (1 if directory == "on" else 3)


@pytest.mark.parametrize("memory", ["allocated", "registered", "registered apart"])
@pytest.mark.parametrize("direction", ["pull", "push"])
@pytest.mark.parametrize("block_bytes", [64, 4096, 32768])  # bounce buffers; in place; frames cut inside runs
async def test_one_sided_tcp_transfers_move_every_byte_between_their_grids(block_bytes: int, direction: str,
                                                                           memory: str) -> None:
    """One-sided reads and writes name both sides as grids, which the helper walks into spans (merging where one
    side's memory continues: consecutive blocks, and a tensor's last block with the next tensor's first, as
    allocated tensors lie back to back) and cuts into frames (a write's frames name the owner's spans of their
    bytes): every byte lands where the plan says, and nothing else is touched.  Memory the owner registered
    (its directory row names each tensor: spans merged across touching tensors pass, nothing between tensors
    apart is reachable) goes one-sided as allocated memory does."""
    await _every_byte_between_grids(block_bytes, direction, memory)


@pytest.mark.parametrize("net", ["native", "python"])
@pytest.mark.parametrize("direction", ["pull", "push"])
@pytest.mark.parametrize("block_bytes", [64, 32768])
async def test_tcp_transfers_through_the_owner_move_every_byte_between_their_grids(
        block_bytes: int, direction: str, net: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Transfers through the owner (the first by each key: each list goes to the same memory registered under a
    key of its own; or the Python I/O threads, which serve no one-sided transfer) hand each end's side of the plan
    to the data connections as a grid too (the native helper walks it into its frames or its destination, the
    Python threads expand it): the same checks as the one-sided transfers."""
    monkeypatch.setenv("AIODATADIST_NET", net)
    await _every_byte_between_grids(block_bytes, direction, "first by each key" if net == "native" else "allocated")


async def _every_byte_between_grids(block_bytes: int, direction: str, memory: str) -> None:
    desc = CacheDesc(6, (40, block_bytes), DataType.DT_UINT8, Placement.HOST)
    rng = np.random.default_rng(block_bytes)
    one_sided = memory != "first by each key" and os.environ.get("AIODATADIST_NET") != "python"
    async with linked_pair(config=config("tcp")) as (prompt, decoder):
        pcm = prompt.cache_manager
        if memory == "allocated":
            theirs = pcm.allocate_blocks_cache(desc, BlocksCacheKey(1, 3))
        else:  # caller memory, its tensors back to back as allocated ones, or apart (other data between them)
            pitch = desc.size + (4096 if memory == "registered apart" else 0)
            buffer = np.full(desc.num_tensors * pitch, 0xEE, dtype=np.uint8)
            addrs = [buffer.ctypes.data + t * pitch for t in range(desc.num_tensors)][::-1]  # any order
            theirs = pcm.register_blocks_cache(desc, addrs, BlocksCacheKey(1, 3))
            gaps = [buffer[a - buffer.ctypes.data + desc.size:a - buffer.ctypes.data + pitch] for a in addrs]
        mine = decoder.cache_manager.allocate_blocks_cache(desc)
        src, dst = (theirs, mine) if direction == "pull" else (mine, theirs)
        fill_pattern(src, 21)
        move = decoder.cache_manager.pull_blocks if direction == "pull" else decoder.cache_manager.push_blocks
        begins = count_begins(decoder)
        lists = [(rng.choice(40, 40, replace=False).tolist(), list(range(40))),  # every destination block, merged
                 (list(range(40)), rng.choice(40, 40, replace=False).tolist()),  # every source block, merged
                 (rng.choice(40, 9, replace=False).tolist(), list(range(31, 40))),  # the tail: merges into the next
                 (list(range(0, 40, 2)), rng.choice(40, 20, replace=False).tolist())]  # scattered on both sides
        lists += [(rng.choice(40, k, replace=False).tolist(), rng.choice(40, k, replace=False).tolist())
                  for k in rng.integers(1, 41, 8).tolist()]
        for i, (s, d) in enumerate(lists):
            fill_pattern(dst, 100 + i)
            before = blocks(dst, list(range(40)))
            key = BlocksCacheKey(1, 3)
            if memory == "first by each key":
                key = BlocksCacheKey(1, 100 + i)
                pcm.register_blocks_cache(desc, addrs, key)
            await move(key, mine, s, d)  # block s[i] of the source -> block d[i] of the destination
            after = blocks(dst, list(range(40)))
            wanted = blocks(src, s)
            untouched = sorted(set(range(40)) - set(d))
            for t in range(desc.num_tensors):
                assert np.array_equal(after[t][d], wanted[t]), f"{direction} {i}, tensor {t}"
                assert np.array_equal(after[t][untouched], before[t][untouched]), f"{direction} {i}, tensor {t}"
        if memory != "allocated":
            assert all((gap == 0xEE).all() for gap in gaps)
        if not one_sided:
            assert begins() == len(lists)  # every transfer went through the owner
            return
        assert begins() == 1  # the first transfer resolved the key; every other one was one-sided
        served = prompt._links.links[2].plane.conns.served_one_sided()
        assert served[0 if direction == "pull" else 3] >= len(lists) - 1


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_model_id_taken_over_or_released_is_resolved_again(transport: str) -> None:
    async with linked_pair(config=config(transport)) as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        first = pcm.allocate_blocks_cache(DESC, BlocksCacheKey(1, 5))
        fill_pattern(first, 21)
        dst = dcm.allocate_blocks_cache(DESC)
        await dcm.pull_blocks(BlocksCacheKey(1, 5), dst, [1], [1])
        assert np.array_equal(blocks(first, [1])[0], blocks(dst, [1])[0])

        second = pcm.allocate_blocks_cache(DESC, BlocksCacheKey(1, 5))  # the last one registered wins
        fill_pattern(second, 22)
        await dcm.pull_blocks(BlocksCacheKey(1, 5), dst, [2], [2])
        assert np.array_equal(blocks(second, [2])[0], blocks(dst, [2])[0])

        pcm.deallocate_blocks_cache(second)  # model 5 now names no cache, although `first` still exists
        before = blocks(dst, [3])
        with pytest.raises(LLMException) as info:
            await dcm.pull_blocks(BlocksCacheKey(1, 5), dst, [3], [3])
        assert info.value.status_code == NOT_EXIST
        assert all(np.array_equal(a, b) for a, b in zip(before, blocks(dst, [3])))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_release_during_a_pull_without_round_trip_fails_it(transport: str) -> None:
    """The owner releases the cache between the copy's start and its end: the pull reports LLM_KV_CACHE_NOT_EXIST
    (as the round-trip path does), and the link stays usable."""
    big = CacheDesc(16, (16, 256 << 10), DataType.DT_UINT8, Placement.HOST)  # 64 MiB
    async with linked_pair(config=config(transport)) as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        src = pcm.allocate_blocks_cache(big, BlocksCacheKey(1, 9))
        fill_pattern(src, 31)
        dst = dcm.allocate_blocks_cache(big)
        await dcm.pull_blocks(BlocksCacheKey(1, 9), dst, [0], [0])  # resolved once through the owner
        plane = next(iter(decoder._links.links.values())).plane
        link = decoder._transfers.state_of(next(iter(decoder._links.links.values())))
        task = asyncio.ensure_future(dcm.pull_blocks(BlocksCacheKey(1, 9), dst, list(range(16)), list(range(16))))
        while not plane.moving():
            await asyncio.sleep(0)
        pcm.deallocate_blocks_cache(src)  # before the pull can look at the directory again
        with pytest.raises(LLMException) as info:
            await task
        assert info.value.status_code == NOT_EXIST
        assert not plane.moving() and not link.resolved

        again = pcm.allocate_blocks_cache(big, BlocksCacheKey(1, 9))
        fill_pattern(again, 32)
        await dcm.pull_blocks(BlocksCacheKey(1, 9), dst, [4, 5], [4, 5])
        assert all(np.array_equal(a, b) for a, b in zip(blocks(again, [4, 5]), blocks(dst, [4, 5])))



async def test_one_sided_reads_outside_the_cache_are_refused() -> None:
    """A requester that asks the owner's native threads for bytes outside the published cache (a hostile or
    buggy peer) gets LLM_PARAM_INVALID, and no byte of the owner's other memory leaves the process."""
    async with linked_pair(config=config("tcp")) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 3))
        secret = prompt.cache_manager.allocate_blocks_cache(DESC)  # not the published cache being read
        fill_pattern(src, 41)
        fill_pattern(secret, 42)
        dst = decoder.cache_manager.allocate_blocks_cache(DESC)
        fill_pattern(dst, 43)
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 3), dst, [0], [0])  # resolved once
        link = next(iter(decoder._links.links.values()))
        resolved = next(iter(decoder._transfers.state_of(link).resolved.values()))
        before = [t.copy() for t in dst.tensors]
        here = int(dst.tensor_addrs[0])
        first, end = src.tensor_addrs[0], src.tensor_addrs[0] + 4 * DESC.size

        def grid(bases: list[int], offsets: list[int]) -> tuple[np.ndarray[Any, Any], ...]:
            """The owner's spans as READ names them: each base plus each offset, 1024 bytes each."""
            return (np.array(bases, np.uint64), np.array(offsets, np.uint64), np.full(len(offsets), 1024, np.uint64))

        def local(tensors: int, runs: int) -> tuple[np.ndarray[Any, Any], ...]:
            """Where they would land here: 2048 bytes of the first tensor, in the owner's grid's shape."""
            return (here + 1024 * runs * np.arange(tensors, dtype=np.uint64),
                    1024 * np.arange(runs, dtype=np.uint64))

        for bad in (grid([secret.tensor_addrs[0]], [0, 1024]),  # elsewhere
                    grid([first, end - 512], [0]),  # the second tensor's span straddles the end
                    grid([first], [0, 4 * DESC.size]),  # an offset past the end
                    grid([first], [0, 2**64 - 512])):  # an offset that wraps around
            job = link.plane.conns.read(10_000, resolved.row, resolved.stamp, resolved.cache_id, None, bad[:2], bad[2],
                                        local(len(bad[0]), len(bad[1])))
            with pytest.raises(LLMException) as info:
                await link.plane.conns.wait(job)
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        stale = link.plane.conns.read(10_001, resolved.row, resolved.stamp + 1, resolved.cache_id, None,
                                      grid([first], [0, 1024])[:2], np.full(2, 1024, np.uint64), local(1, 2))
        with pytest.raises(LLMException) as info:
            await link.plane.conns.wait(stale)
        assert info.value.status_code == NOT_EXIST
        assert all(np.array_equal(a, b) for a, b in zip(before, dst.tensors))
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 3), dst, [2], [2])  # the link still works
        assert np.array_equal(blocks(src, [2])[0], blocks(dst, [2])[0])



def registered(cm: Any, desc: CacheDesc, key: BlocksCacheKey, seed: int) -> tuple[Any, list[np.ndarray[Any, Any]]]:
    """A blocks cache in caller memory (numpy arrays, outside any HostMemory), filled with pattern bytes."""
    arrays = [np.frombuffer(pattern(seed, i, desc.size), dtype=np.uint8).copy() for i in range(desc.num_tensors)]
    return cm.register_blocks_cache(desc, [int(a.ctypes.data) for a in arrays], key), arrays


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_registered_memory_is_moved_one_sided(transport: str) -> None:
    """Caller-registered memory: pulls and pushes by BlocksCacheKey ask the owner once, then read or write it on
    their own (an engine's busy Python thread is not on the path): on one host with process_vm_readv/writev, over
    TCP through the owner's I/O threads, which check every span against its tensors.  Every byte is checked."""
    async with linked_pair(config=config(transport)) as (prompt, decoder):
        src, arrays = registered(prompt.cache_manager, DESC, BlocksCacheKey(1, 3), 51)
        dst = decoder.cache_manager.allocate_blocks_cache(DESC)
        fill_pattern(dst, 52)
        begins = count_begins(decoder)
        for i, (s, d) in enumerate([([1, 2], [5, 0]), ([7], [3]), ([0, 4, 6], [1, 2, 4])]):
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 3), dst, s, d)
            for want, got in zip(blocks(src, s), blocks(dst, d)):
                assert np.array_equal(want, got), f"pull {i}"
        assert begins() == 1
        for d in ([6], [2, 3]):
            await decoder.cache_manager.push_blocks(BlocksCacheKey(1, 3), dst, [0] * len(d), d)
            assert all(np.array_equal(want, got) for want, got in zip(blocks(dst, [0] * len(d)), blocks(src, d)))
        assert begins() == 1
        assert arrays[0].ctypes.data == src.tensor_addrs[0]


async def test_a_release_during_a_one_sided_pull_of_registered_memory_fails_it() -> None:
    """The owner unregisters caller memory (and the caller unmaps it) while a one-sided process_vm_readv pull of
    it runs: the pull fails with LLM_KV_CACHE_NOT_EXIST (whether it read the stale pages or faulted), the
    owner's process is untouched, and the link stays usable."""
    big = CacheDesc(4, (16, 1 << 20), DataType.DT_UINT8, Placement.HOST)  # 64 MiB
    async with linked_pair(config=config("shm")) as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        regions = [mmap.mmap(-1, big.size) for _ in range(big.num_tensors)]
        for i, region in enumerate(regions):
            region.write(pattern(61, i, big.size))
        addrs = [ctypes.addressof(ctypes.c_char.from_buffer(region)) for region in regions]
        src = pcm.register_blocks_cache(big, addrs, BlocksCacheKey(1, 9))
        dst = dcm.allocate_blocks_cache(big)
        await dcm.pull_blocks(BlocksCacheKey(1, 9), dst, [0], [0])  # resolved once through the owner
        link = decoder._transfers.state_of(next(iter(decoder._links.links.values())))
        plane = next(iter(decoder._links.links.values())).plane
        assert link.resolved
        task = asyncio.ensure_future(dcm.pull_blocks(BlocksCacheKey(1, 9), dst, list(range(16)), list(range(16))))
        while not plane.moving():
            await asyncio.sleep(0)
        pcm.unregister_cache(src.cache_id)
        for region in regions:  # the caller takes its memory back: the peer's reads now fault
            with contextlib.suppress(BufferError):
                region.close()
        with pytest.raises(LLMException) as info:
            await task
        assert info.value.status_code == NOT_EXIST
        assert not plane.moving() and not link.resolved

        again, _ = registered(pcm, DESC, BlocksCacheKey(1, 9), 62)
        small = dcm.allocate_blocks_cache(DESC)
        await dcm.pull_blocks(BlocksCacheKey(1, 9), small, [4, 5], [4, 5])
        assert all(np.array_equal(a, b) for a, b in zip(blocks(again, [4, 5]), blocks(small, [4, 5])))


@pytest.mark.parametrize("moved", [1, 16], ids=["on the calling thread", "by the copy threads"])
async def test_a_one_sided_pull_of_memory_gone_under_a_live_cache_fails_alike_small_or_large(moved: int) -> None:
    """The owner's caller unmaps memory it still has registered (its bug): a one-sided pull of it faults, and fails
    the same way whether it is small enough to be copied on the calling thread (16 KiB) or goes to the copy
    threads (256 KiB): an ``LLMLinkError`` saying the copy failed, nothing else touched; the resolution is kept
    (the directory still says the cache is live), and once the owner unregisters it and registers new memory under
    the key, the same pull moves every byte."""
    desc = CacheDesc(4, (16, 4096), DataType.DT_UINT8, Placement.HOST)
    async with linked_pair(config=config("shm")) as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        regions = [mmap.mmap(-1, desc.size) for _ in range(desc.num_tensors)]
        for i, region in enumerate(regions):
            region.write(pattern(71, i, desc.size))
        src = pcm.register_blocks_cache(desc, [ctypes.addressof(ctypes.c_char.from_buffer(r)) for r in regions],
                                        BlocksCacheKey(1, 4))
        dst = dcm.allocate_blocks_cache(desc)
        fill_pattern(dst, 72)
        await dcm.pull_blocks(BlocksCacheKey(1, 4), dst, [0], [0])  # resolved once through the owner
        state = decoder._transfers.state_of(next(iter(decoder._links.links.values())))
        begins = count_begins(decoder)
        for region in regions:
            with contextlib.suppress(BufferError):
                region.close()
        before = blocks(dst, list(range(16)))
        with pytest.raises(LLMException) as info:
            await dcm.pull_blocks(BlocksCacheKey(1, 4), dst, list(range(moved)), list(range(moved)))
        assert isinstance(info.value, LLMLinkError) and info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert "copy with cluster 1 failed" in str(info.value) and "Bad address" in str(info.value)
        assert begins() == 0 and state.resolved  # one-sided, and the cache is still the one resolved
        after = blocks(dst, list(range(16)))
        assert all(np.array_equal(a, b) for a, b in zip(before[moved:], after[moved:]))

        pcm.unregister_cache(src.cache_id)
        again, _ = registered(pcm, desc, BlocksCacheKey(1, 4), 73)
        await dcm.pull_blocks(BlocksCacheKey(1, 4), dst, list(range(moved)), list(range(moved)))
        assert all(np.array_equal(a, b) for a, b in zip(blocks(again, list(range(moved))),
                                                        blocks(dst, list(range(moved)))))
