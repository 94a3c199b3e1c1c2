"""Both copy executors (the native pool and the Python fallback) move bytes exactly and stop on cancel."""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers.examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.copy.native_pool import NativeExecutor
from aiodatadist.copy.python_pool import CopyExecutor
from aiodatadist.layout.plans import CacheGeometry, Spans, b2b_runs, make_plan
from aiodatadist.native import CopyMode, CopySpec, native_pool

EXECUTORS = ["python"] + (["native"] if native_pool() is not None else [])


def make(kind: str) -> CopyExecutor | NativeExecutor:
    return NativeExecutor(2) if kind == "native" else CopyExecutor(2)


def scattered(src: np.ndarray, dst: np.ndarray, block: int, seed: int) -> tuple[Spans, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = len(src) // block
    s_idx, d_idx = rng.permutation(n), rng.permutation(n)
    spans = Spans((src.ctypes.data + s_idx * block).astype(np.uint64), (dst.ctypes.data + d_idx * block).astype(np.uint64),
                  np.full(n, block, dtype=np.uint64))
    return spans, s_idx, d_idx


@pytest.mark.parametrize("kind", EXECUTORS)
@pytest.mark.parametrize("block", [4096, 32 << 10, 3 << 20])
async def test_copies_are_byte_exact(kind: str, block: int) -> None:
    executor = make(kind)
    try:
        src = np.random.default_rng(1).integers(1, 256, 48 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        spans, s_idx, d_idx = scattered(src, dst, block, 2)
        await executor.run(spans, CopySpec(CopyMode.MEMCPY, streaming=True))
        n = len(src) // block
        assert np.array_equal(dst[: n * block].reshape(n, block)[d_idx], src[: n * block].reshape(n, block)[s_idx])
    finally:
        await asyncio.to_thread(executor.shutdown)


@pytest.mark.parametrize("kind", EXECUTORS)
async def test_concurrent_jobs_and_cancellation(kind: str) -> None:
    executor = make(kind)
    try:
        src = np.random.default_rng(3).integers(1, 256, 256 << 20, dtype=np.uint8)
        dsts = [np.zeros(256 << 20, dtype=np.uint8) for _ in range(2)]
        jobs = [executor.start(scattered(src, d, 32 << 10, 4 + i)[0], CopySpec()) for i, d in enumerate(dsts)]
        await asyncio.sleep(0.002)
        executor.cancel(jobs[0])
        await executor.wait(jobs[1])
        first = dsts[0].copy()
        task = asyncio.ensure_future(executor.wait(jobs[0]))
        await asyncio.wait_for(task, 30)
        await asyncio.sleep(0.1)
        assert np.array_equal(dsts[0], first)  # nothing landed after the cancelled job ended
        assert jobs[0].stopped.is_set() and jobs[1].stopped.is_set()
    finally:
        await asyncio.to_thread(executor.shutdown)


@pytest.mark.parametrize("kind", EXECUTORS)
async def test_a_failing_copy_reports_os_error(kind: str) -> None:
    executor = make(kind)
    try:
        buf = ctypes.create_string_buffer(4096)
        spans = Spans(np.array([ctypes.addressof(buf)], np.uint64), np.array([16], np.uint64),  # bogus remote
                      np.array([4096], np.uint64))
        with pytest.raises(OSError):
            await executor.run(spans, CopySpec(CopyMode.PVM_WRITE, pid=__import__("os").getpid()))
    finally:
        await asyncio.to_thread(executor.shutdown)


@st.composite
def grid_plans(draw: st.DrawFn) -> tuple[int, int, list[int], list[int], list[tuple[int, int]], int]:
    """A small blocks-cache plan: block size, blocks per tensor, block lists, tensor pairs, chunk size."""
    block = draw(st.integers(1, 96))
    nblocks = draw(st.integers(1, 12))
    k = draw(st.integers(1, nblocks))
    ordered = draw(st.booleans())  # in-order lists merge into long runs, also across tensor boundaries
    src_blocks = list(range(k)) if ordered else draw(st.lists(st.integers(0, nblocks - 1), min_size=k, max_size=k))
    dst_blocks = list(range(k)) if ordered else draw(st.permutations(range(nblocks)))[:k]
    tensors = draw(st.integers(1, 5))
    pairs = draw(st.lists(st.tuples(st.integers(0, tensors - 1), st.integers(0, tensors - 1)), min_size=1,
                          max_size=tensors, unique_by=lambda p: p[1]))
    chunk = draw(st.integers(1, 3 * block * k * len(pairs)))
    return block, nblocks, src_blocks, dst_blocks, pairs, chunk


@pytest.mark.parametrize("kind", EXECUTORS)
def test_plans_copy_like_the_reference(kind: str) -> None:
    """``start_plan`` (built natively by the helper, or through spans in Python) moves exactly the plan's bytes,
    whatever the merging across tensors, the cutting into pieces and the grouping into chunks."""
    executor = make(kind)

    @settings(max_examples=examples(120), deadline=None)
    @given(grid_plans(), st.integers(0, 2**32 - 1))
    def check(plan_args: tuple[int, int, list[int], list[int], list[tuple[int, int]], int], seed: int) -> None:
        block, nblocks, src_blocks, dst_blocks, pairs, chunk = plan_args
        tensors = max(max(p) for p in pairs) + 1
        geometry = CacheGeometry(tensors, block * nblocks, nblocks, True)
        rng = np.random.default_rng(seed)
        src = rng.integers(1, 256, (tensors, nblocks, block), dtype=np.uint8)
        dst = rng.integers(1, 256, (tensors, nblocks, block), dtype=np.uint8)
        expected = dst.copy()
        for s_t, d_t in pairs:
            expected[d_t, dst_blocks] = src[s_t, src_blocks]
        plan = make_plan(np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]),
                         b2b_runs(src_blocks, dst_blocks, geometry, geometry))
        addrs = [np.array([a.ctypes.data + t * block * nblocks for t in range(tensors)], dtype=np.uint64)
                 for a in (src, dst)]

        async def run() -> None:
            await executor.wait(executor.start_plan(plan, addrs[0], addrs[1], CopySpec(), chunk_bytes=chunk))

        asyncio.run(run())
        assert np.array_equal(dst, expected)

    try:
        check()
    finally:
        executor.shutdown()


MALLOC_DEBUG = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
FRAME_PLANNING = """
import os, sys
import numpy as np
from aiodatadist.native import native_extension, native_pool
lib, ext = native_pool(), native_extension(); r, w = os.pipe(); rng = np.random.default_rng(int(sys.argv[1]))
zero = np.zeros(1, dtype=np.uint64)  # one tensor at 0: the spans are a grid's runs
for _ in range(300):
    frame = int(rng.integers(1, 64))
    lens = rng.integers(0, 200, size=int(rng.integers(1, 40))).astype(np.uint64)
    addr = np.arange(len(lens), dtype=np.uint64) * np.uint64(4096) + np.uint64(4096)
    net = lib.adt_net_new(w, None, 0, frame)
    job = ext.net_send(net, 1, zero, addr, lens)
    lib.adt_net_cancel(net, job, 0); lib.adt_net_job_free(job); lib.adt_net_close(net); lib.adt_net_free(net)
print("ok")
"""


@pytest.mark.skipif(native_pool() is None or not os.path.exists(MALLOC_DEBUG), reason="needs the native helper and "
                    "glibc's malloc debugging library")
@pytest.mark.slow  # a child process under glibc malloc checks
def test_tcp_frame_planning_stays_inside_its_buffers() -> None:
    """Cutting spans into frames never writes past the arrays it allocated (once a heap overflow that crashed a
    TCP peer after tens of seconds): checked under glibc's malloc consistency checks."""
    env = {**os.environ, "LD_PRELOAD": MALLOC_DEBUG, "MALLOC_CHECK_": "3"}
    for seed in range(3):
        result = subprocess.run([sys.executable, "-c", FRAME_PLANNING, str(seed)], env=env, capture_output=True,
                                text=True, timeout=120, check=False)
        assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
