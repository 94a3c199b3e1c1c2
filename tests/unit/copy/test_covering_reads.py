"""``process_vm_readv`` of close spans: the helper reads the range covering a tensor's spans at once, then copies
each span out of it.  The range must never reach past the tensor (the owner's memory around it may not be
mapped), and the bytes that land must be exactly the planned ones, whatever the spans' order, sizes and the job's
chunking."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.copy.native_pool import NativeExecutor
from aiodatadist.copy.spans import copy_grid_now
from aiodatadist.layout.plans import CacheGeometry, TransferParams, transfer_plan
from aiodatadist.native import CopyMode, CopySpec, native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="the native helper is not built")

PAGE = mmap.PAGESIZE
TENSORS = 3
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


@contextmanager
def _guarded_tensors(nbytes: int, seed: int) -> Iterator[list[np.ndarray[Any, Any]]]:
    """``TENSORS`` tensors of ``nbytes`` random bytes between pages that cannot be read, the even ones starting
    right after such a page and the odd ones ending right before one: a covering read past a tensor's first or
    last byte fails with ``EFAULT``.  Unmapped on a normal exit only: after a failure, reporting it may still
    read the arrays."""
    rng = np.random.default_rng(seed)
    pages = -(-nbytes // PAGE)
    stride = pages + 1
    size = (TENSORS * stride + 1) * PAGE
    base = _libc.mmap(None, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    tensors = []
    for t in range(TENSORS + 1):
        assert _libc.mprotect(base + t * stride * PAGE, PAGE, PROT_NONE) == 0, ctypes.get_errno()
    for t in range(TENSORS):
        start = base + (t * stride + 1) * PAGE + (pages * PAGE - nbytes if t % 2 else 0)
        view = np.ctypeslib.as_array(ctypes.cast(start, ctypes.POINTER(ctypes.c_uint8)), shape=(nbytes,))
        view[:] = rng.integers(1, 256, nbytes, dtype=np.uint8)
        tensors.append(view)
    yield tensors
    _libc.munmap(base, size)


def _plan(block: int, blocks: int, src_blocks: list[int], dst_blocks: list[int]) -> Any:
    geometry = CacheGeometry(TENSORS, blocks * block, blocks, True, 4)
    params = TransferParams("pull", "blocks", tuple(src_blocks), tuple(dst_blocks), None, None, 2, -1, 0)
    return transfer_plan(params, geometry, geometry, 0)


def _addrs(arrays: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    return np.array([a.ctypes.data for a in arrays], dtype=np.uint64)


def _pairs(blocks: int) -> st.SearchStrategy[list[tuple[int, int]]]:
    return st.lists(st.tuples(st.integers(0, blocks - 1), st.integers(0, blocks - 1)), min_size=1, max_size=blocks,
                    unique_by=(lambda p: p[0], lambda p: p[1]))


def _expected(src: list[np.ndarray[Any, Any]], dst: list[np.ndarray[Any, Any]], block: int, blocks: int,
              pairs: list[tuple[int, int]]) -> list[np.ndarray[Any, Any]]:
    out = [d.copy().reshape(blocks, block) for d in dst]
    for t in range(TENSORS):
        out[t][[d for _, d in pairs]] = src[t].reshape(blocks, block)[[s for s, _ in pairs]]
    return [o.reshape(-1) for o in out]


BLOCK_SIZES = [8, 64, 100, 512, 2048, 4096, 6000]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(BLOCK_SIZES), st.data())
def test_close_spans_read_from_guarded_tensors_land_exactly(block: int, data: st.DataObject) -> None:
    """Spans of a tensor up to its first and last byte, in any order, read on this thread: the planned blocks
    land byte-exact, no other byte changes, and nothing is read outside the tensors (their guard pages)."""
    pages = -(-16 * block // PAGE)
    blocks = pages * PAGE // block
    pairs = data.draw(_pairs(blocks))
    rng = np.random.default_rng(block + len(pairs))
    dst = [rng.integers(1, 256, blocks * block, dtype=np.uint8) for _ in range(TENSORS)]
    with _guarded_tensors(blocks * block, seed=len(pairs)) as src:
        expected = _expected(src, dst, block, blocks, pairs)
        plan = _plan(block, blocks, [s for s, _ in pairs], [d for _, d in pairs])
        copier = CopySpec(CopyMode.PVM_READ, pid=os.getpid())
        if not copy_grid_now(plan, _addrs(src), _addrs(dst), copier):  # above the inline threshold: a job
            _run_job(plan, src, dst, copier, chunk=None)
    for got, want in zip(dst, expected):
        assert np.array_equal(got, want)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([8, 64, 512]), st.data(), st.integers(1, 20000))
def test_a_covering_read_job_cut_anywhere_lands_the_planned_bytes(block: int, data: st.DataObject,
                                                                   chunk: int) -> None:
    """A queued job's chunks (byte ranges of its stream, cut inside spans too) each read their own part of the
    tensors: the same bytes land, and no chunk reads past a tensor."""
    pages = 2
    blocks = pages * PAGE // block
    pairs = data.draw(_pairs(blocks))
    rng = np.random.default_rng(chunk)
    dst = [rng.integers(1, 256, blocks * block, dtype=np.uint8) for _ in range(TENSORS)]
    with _guarded_tensors(blocks * block, seed=chunk) as src:
        expected = _expected(src, dst, block, blocks, pairs)
        plan = _plan(block, blocks, [s for s, _ in pairs], [d for _, d in pairs])
        _run_job(plan, src, dst, CopySpec(CopyMode.PVM_READ, pid=os.getpid()), chunk=chunk)
    for got, want in zip(dst, expected):
        assert np.array_equal(got, want)


def test_many_tiny_spans_of_large_tensors_land_exactly() -> None:
    """Tensors of many covering reads' worth (a covering read takes at most 1 MiB): 64-byte blocks in random
    order over 4 MiB tensors, half of them moved, as one job of several chunks."""
    block, pages = 64, (4 << 20) // PAGE
    blocks = pages * PAGE // block
    rng = np.random.default_rng(4)
    moved = blocks // 2
    pairs = list(zip(rng.choice(blocks, moved, replace=False).tolist(), rng.choice(blocks, moved, replace=False)
                     .tolist()))
    dst = [rng.integers(1, 256, blocks * block, dtype=np.uint8) for _ in range(TENSORS)]
    with _guarded_tensors(blocks * block, seed=5) as src:
        expected = _expected(src, dst, block, blocks, pairs)
        plan = _plan(block, blocks, [s for s, _ in pairs], [d for _, d in pairs])
        _run_job(plan, src, dst, CopySpec(CopyMode.PVM_READ, pid=os.getpid()), chunk=1 << 20)
    for got, want in zip(dst, expected):
        assert np.array_equal(got, want)


def test_a_covering_read_of_memory_gone_fails_with_efault() -> None:
    """Close spans of a tensor that is no longer mapped fail the read with ``EFAULT``, as single spans do, and
    the destination keeps its bytes."""
    block, blocks = 64, 64
    region = mmap.mmap(-1, blocks * block)
    gone = ctypes.addressof(ctypes.c_char.from_buffer(region))
    region_view = np.frombuffer(region, dtype=np.uint8)
    src_addrs = np.array([region_view.ctypes.data] * (TENSORS - 1) + [gone + (1 << 46)], dtype=np.uint64)
    rng = np.random.default_rng(8)
    dst = [rng.integers(1, 256, blocks * block, dtype=np.uint8) for _ in range(TENSORS)]
    before = dst[-1].copy()
    plan = _plan(block, blocks, [1, 5, 9, 3], [0, 2, 4, 6])
    with pytest.raises(OSError) as info:
        copy_grid_now(plan, src_addrs, _addrs(dst), CopySpec(CopyMode.PVM_READ, pid=os.getpid()))
    assert info.value.errno == 14  # EFAULT
    assert np.array_equal(dst[-1], before)
    del region_view
    region.close()


def _run_job(plan: Any, src: list[np.ndarray[Any, Any]], dst: list[np.ndarray[Any, Any]], copier: CopySpec,
             chunk: int | None) -> None:
    executor = NativeExecutor(workers=2)

    async def copy() -> None:
        await executor.wait(executor.start_plan(plan, _addrs(src), _addrs(dst), copier, chunk_bytes=chunk))

    try:
        asyncio.run(copy())
    finally:
        executor.shutdown()
