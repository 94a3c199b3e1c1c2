"""Small host copies on the calling thread (``copy_grid_now``): the same bytes as a queued job would move, the
same errors, and nothing at all for a plan above the threshold or without the native helper."""

from __future__ import annotations

import asyncio
import mmap
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.copy.native_pool import NativeExecutor
from aiodatadist.copy.spans import (
    INLINE_BYTES,
    STREAMING_THRESHOLD,
    _last_level_cache_bytes,
    copier_for_local,
    copy_grid_now,
)
from aiodatadist.layout.plans import CacheGeometry, TransferParams, transfer_plan
from aiodatadist.native import CopyMode, CopySpec, native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="the native helper is not built")

TENSORS, BLOCKS = 4, 16
# Block sizes through every branch of the helper's small-span copy (1-7, 8-15, 16-31, 32-64 bytes; merged
# neighbours are longer) and past it (libc's memmove, streaming stores)
BLOCK_SIZES = [1, 3, 8, 12, 24, 40, 63, 64, 65, 512]


def _caches(block: int, seed: int) -> tuple[list[np.ndarray[Any, Any]], list[np.ndarray[Any, Any]]]:
    rng = np.random.default_rng(seed)
    src = [rng.integers(1, 256, BLOCKS * block, dtype=np.uint8) for _ in range(TENSORS)]
    dst = [rng.integers(1, 256, BLOCKS * block, dtype=np.uint8) for _ in range(TENSORS)]
    return src, dst


def _addrs(arrays: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    return np.array([a.ctypes.data for a in arrays], dtype=np.uint64)


def _plan(block: int, src_blocks: list[int], dst_blocks: list[int]) -> Any:
    geometry = CacheGeometry(TENSORS, BLOCKS * block, BLOCKS, True, 4)
    params = TransferParams("pull", "blocks", tuple(src_blocks), tuple(dst_blocks), None, None, 2, -1, 0)
    return transfer_plan(params, geometry, geometry, 0)


def _expected(src: list[np.ndarray[Any, Any]], dst: list[np.ndarray[Any, Any]], block: int,
              src_blocks: list[int], dst_blocks: list[int]) -> list[np.ndarray[Any, Any]]:
    out = [d.copy().reshape(BLOCKS, block) for d in dst]
    for t in range(TENSORS):
        out[t][dst_blocks] = src[t].reshape(BLOCKS, block)[src_blocks]
    return [o.reshape(-1) for o in out]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(BLOCK_SIZES), st.lists(st.tuples(st.integers(0, BLOCKS - 1), st.integers(0, BLOCKS - 1)),
                                                 min_size=1, max_size=BLOCKS, unique_by=(lambda p: p[0], lambda p: p[1])),
       st.sampled_from([CopyMode.MEMCPY, CopyMode.PVM_READ, CopyMode.PVM_WRITE]))
def test_inline_copy_moves_exactly_the_planned_blocks(block: int, pairs: list[tuple[int, int]],
                                                      mode: CopyMode) -> None:
    """Every mode (memcpy, process_vm_readv/writev on this process) lands the planned blocks byte-exact and
    touches no other byte; adjacent blocks are merged into one span, which must not change the result."""
    src, dst = _caches(block, len(pairs) * 7 + block)
    src_blocks, dst_blocks = [s for s, _ in pairs], [d for _, d in pairs]
    expected = _expected(src, dst, block, src_blocks, dst_blocks)
    plan = _plan(block, src_blocks, dst_blocks)
    assert copy_grid_now(plan, _addrs(src), _addrs(dst), CopySpec(mode, pid=os.getpid()))
    for got, want in zip(dst, expected):
        assert np.array_equal(got, want)


def test_deltas_translate_both_sides() -> None:
    """``src_delta``/``dst_delta`` (a peer's segment mapped here) shift the addresses as a queued job does."""
    block = 64
    src, dst = _caches(block, 3)
    shift = 4096
    bases_src = _addrs(src) - np.uint64(shift)
    bases_dst = _addrs(dst) + np.uint64(shift)
    expected = _expected(src, dst, block, [1, 2, 9], [0, 5, 6])
    assert copy_grid_now(_plan(block, [1, 2, 9], [0, 5, 6]), bases_src, bases_dst,
                         CopySpec(src_delta=shift, dst_delta=(1 << 64) - shift))
    assert all(np.array_equal(g, w) for g, w in zip(dst, expected))


def test_a_plan_above_the_threshold_is_left_to_a_job() -> None:
    block = INLINE_BYTES // (TENSORS * 2) + 64  # two blocks per tensor exceed the threshold
    src, dst = _caches(block, 5)
    before = [d.copy() for d in dst]
    assert not copy_grid_now(_plan(block, [0, 1], [2, 3]), _addrs(src), _addrs(dst), CopySpec())
    assert all(np.array_equal(a, b) for a, b in zip(before, dst))


def test_an_unmapped_remote_range_fails_with_efault() -> None:
    """process_vm_readv of a range that is not mapped (a peer's memory that went away) fails as a job would,
    with ``EFAULT``, and the local destination keeps what it had where nothing was read."""
    block = 64
    region = mmap.mmap(-1, mmap.PAGESIZE)
    base = np.frombuffer(region, dtype=np.uint8).ctypes.data  # a valid address, then one that is not
    src = np.array([base] * (TENSORS - 1) + [base + (1 << 46)], dtype=np.uint64)
    _, dst = _caches(block, 9)
    with pytest.raises(OSError) as info:
        copy_grid_now(_plan(block, [0], [1]), src, _addrs(dst), CopySpec(CopyMode.PVM_READ, pid=os.getpid()))
    assert info.value.errno == 14  # EFAULT


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(BLOCK_SIZES), st.lists(st.tuples(st.integers(0, BLOCKS - 1), st.integers(0, BLOCKS - 1)),
                                                 min_size=1, max_size=BLOCKS, unique_by=(lambda p: p[0], lambda p: p[1])),
       st.sampled_from([CopyMode.MEMCPY, CopyMode.PVM_READ, CopyMode.PVM_WRITE]), st.integers(1, 5000),
       st.booleans())
def test_a_grid_job_cut_anywhere_moves_the_same_bytes(block: int, pairs: list[tuple[int, int]], mode: CopyMode,
                                                      chunk: int, streaming: bool) -> None:
    """A queued grid job's workers walk the grid themselves, chunk by chunk (byte ranges of its stream, cut
    anywhere, inside spans too) and piece by piece (pieces of at most the chunk): the result is the planned
    blocks, byte for byte, and nothing else."""
    src, dst = _caches(block, len(pairs) * 13 + chunk)
    src_blocks, dst_blocks = [s for s, _ in pairs], [d for _, d in pairs]
    expected = _expected(src, dst, block, src_blocks, dst_blocks)
    plan = _plan(block, src_blocks, dst_blocks)
    executor = NativeExecutor(workers=2)

    async def copy() -> None:
        copier = CopySpec(mode, pid=os.getpid(), streaming=streaming)
        await executor.wait(executor.start_plan(plan, _addrs(src), _addrs(dst), copier, chunk_bytes=chunk))

    try:
        asyncio.run(copy())
    finally:
        executor.shutdown()
    for got, want in zip(dst, expected):
        assert np.array_equal(got, want)


def test_submit_grid_refuses_inconsistent_plan_arrays() -> None:
    """The pool's entry point checks what it is given: tensor indices beyond the address arrays and run arrays
    of different lengths raise ``ValueError`` and queue nothing."""
    from aiodatadist.native import native_extension

    ext = native_extension()
    executor = NativeExecutor(workers=1)
    pool = executor._pool
    plan = _plan(64, [0, 1], [2, 3])
    runs = plan.runs
    src, dst = _caches(64, 1)
    too_few = _addrs(src)[:1]
    try:
        with pytest.raises(ValueError):
            ext.submit_grid(pool, too_few, _addrs(dst), plan.src_tensor, plan.dst_tensor, runs.src_offset,
                            runs.dst_offset, runs.length, 0, 0, 1 << 20, 1 << 20, 0, 0, 0, -1)
        with pytest.raises(ValueError):
            ext.submit_grid(pool, _addrs(src), _addrs(dst), plan.src_tensor, plan.dst_tensor, runs.src_offset,
                            runs.dst_offset, runs.length[:0], 0, 0, 1 << 20, 1 << 20, 0, 0, 0, -1)
        with pytest.raises(ValueError):
            ext.copy_grid(_addrs(src), too_few, plan.src_tensor, plan.dst_tensor, runs.src_offset, runs.dst_offset,
                          runs.length, 0, 0, 0, 0)
    finally:
        executor.shutdown()


def test_streaming_starts_at_an_eighth_of_the_last_level_cache() -> None:
    """Copies that fit in the last-level cache stay there (the engine reads them next); bigger ones stream."""
    llc = _last_level_cache_bytes()
    if os.path.isdir("/sys/devices/system/cpu/cpu0/cache"):
        assert llc >= 256 << 10
    assert STREAMING_THRESHOLD == max(1 << 20, (llc or 8 << 20) // 8)
    assert not copier_for_local(STREAMING_THRESHOLD - 1).streaming
    assert copier_for_local(STREAMING_THRESHOLD).streaming
