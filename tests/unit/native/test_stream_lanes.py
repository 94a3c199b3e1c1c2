"""Streaming copies run several spans at once, a line of each in turn ("lanes", ``adt_stream_lanes``: 1 to 8, four
by default).  Whatever the count, a list of spans copies exactly as copying them one after the other with
``memmove`` would: spans that overlap one another (a later span reading what an earlier one writes, writing what it
reads, or writing the same bytes) are never run together, and a span that overlaps itself is copied as memmove
copies it.  The pool's jobs (span lists and plans' grids) and the benchmark's copy limit go through the same lanes."""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiodatadist.layout.plans import Spans
from aiodatadist.native import Streaming, local_copier, native_pool

LIB = native_pool()
pytestmark = pytest.mark.skipif(LIB is None, reason="the native helper is not built")
vp = ctypes.c_void_p
BUFFER = 1 << 20


@pytest.fixture(params=[1, 2, 3, 4, 8])
def lanes(request: pytest.FixtureRequest) -> Iterator[int]:
    assert LIB is not None
    default = LIB.adt_stream_lanes(0)
    assert LIB.adt_stream_lanes(request.param) == request.param
    try:
        yield request.param
    finally:
        LIB.adt_stream_lanes(default)


def test_the_lane_count_is_bounded() -> None:
    assert LIB is not None
    default = LIB.adt_stream_lanes(0)
    assert default == 4
    for bad in (-1, 9, 100):
        assert LIB.adt_stream_lanes(bad) == default
    assert LIB.adt_stream_lanes(8) == 8 and LIB.adt_stream_lanes(default) == default


def copy_spans(buf: np.ndarray, spans: list[tuple[int, int, int]], *, streaming: int = 1,
               stop: ctypes.c_int32 | None = None) -> int:
    assert LIB is not None
    base = buf.ctypes.data
    s = np.array([base + a for a, _, _ in spans], dtype=np.uint64)
    d = np.array([base + b for _, b, _ in spans], dtype=np.uint64)
    n = np.array([c for _, _, c in spans], dtype=np.uint64)
    flag = ctypes.byref(stop) if stop is not None else None
    return int(LIB.adt_copy_spans(vp(d.ctypes.data), vp(s.ctypes.data), vp(n.ctypes.data), len(spans), streaming,
                                  flag))


def one_after_another(buf: np.ndarray, spans: list[tuple[int, int, int]]) -> np.ndarray:
    out = buf.copy()
    for s, d, n in spans:
        out[d:d + n] = out[s:s + n].copy()  # memmove
    return out


span = st.tuples(st.integers(0, BUFFER - 1), st.integers(0, BUFFER - 1),
                 st.one_of(st.integers(1, 4095), st.integers(4096, 200_000))).map(
    lambda t: (min(t[0], BUFFER - t[2]) if t[2] <= BUFFER else 0, min(t[1], BUFFER - t[2]), t[2]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spans=st.lists(span, min_size=1, max_size=24), seed=st.integers(0, 999))
def test_spans_in_one_buffer_copy_as_one_after_another(lanes: int, spans: list[tuple[int, int, int]],
                                                       seed: int) -> None:
    """Spans drawn anywhere in one buffer overlap each other and themselves often."""
    buf = np.random.default_rng(seed).integers(1, 256, BUFFER, dtype=np.uint8)
    expected = one_after_another(buf, spans)
    assert copy_spans(buf, spans) == len(spans)
    assert np.array_equal(buf, expected)


def test_chains_of_blocks_keep_their_order(lanes: int) -> None:
    """Block i+1 <- block i, in order, for 16 blocks of 32 KiB: each block gets the first one's bytes only if every
    copy reads what the one before wrote; and the reverse chain moves every block by one."""
    block = 32 << 10
    buf = np.random.default_rng(3).integers(1, 256, 17 * block, dtype=np.uint8)
    for spans in ([(i * block, (i + 1) * block, block) for i in range(16)],
                  [((i + 1) * block, i * block, block) for i in range(16)],
                  [(0, block, block)] * 3 + [(2 * block, 0, 3 * block + 100)]):
        expected = one_after_another(buf, spans)
        assert copy_spans(buf, spans) == len(spans)
        assert np.array_equal(buf, expected)


def test_scattered_blocks_between_two_buffers_land_exactly(lanes: int) -> None:
    """The paged pattern (4 KiB to 64 KiB blocks, scattered, at odd offsets), bytes between blocks untouched."""
    rng = np.random.default_rng(lanes)
    src = rng.integers(1, 256, 8 << 20, dtype=np.uint8)
    dst = rng.integers(1, 256, 8 << 20, dtype=np.uint8)
    expected = dst.copy()
    size = int(rng.choice([4096, 32 << 10, 65536]))
    count = (8 << 20) // size - 1
    order = rng.permutation(count)
    spans = [(int(a) * size + 7, int(b) * size + 13, size) for a, b in zip(order[:count // 2], order[count // 2:])]
    for s, d, n in spans:
        expected[d:d + n] = src[s:s + n]
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    assert LIB is not None
    s_arr = np.array([base_s + s for s, _, _ in spans], dtype=np.uint64)
    d_arr = np.array([base_d + d for _, d, _ in spans], dtype=np.uint64)
    n_arr = np.full(len(spans), size, dtype=np.uint64)
    assert LIB.adt_copy_spans(vp(d_arr.ctypes.data), vp(s_arr.ctypes.data), vp(n_arr.ctypes.data), len(spans), 1,
                              None) == len(spans)
    assert np.array_equal(dst, expected)


def test_a_stop_before_the_call_copies_nothing() -> None:
    buf = np.random.default_rng(9).integers(1, 256, BUFFER, dtype=np.uint8)
    before = buf.copy()
    assert copy_spans(buf, [(0, 1 << 19, 1 << 18)] * 4, stop=ctypes.c_int32(1)) == 0
    assert np.array_equal(buf, before)


def test_pool_jobs_and_the_limit_copy_exactly(lanes: int) -> None:
    """A streaming span-list job of the pool (split into chunks per worker) and the benchmark's copy limit."""
    from aiodatadist.copy.native_pool import NativeExecutor

    rng = np.random.default_rng(lanes + 20)
    src = rng.integers(1, 256, 16 << 20, dtype=np.uint8)
    dst = np.zeros(16 << 20, dtype=np.uint8)
    block = 32 << 10
    order = rng.permutation(512)
    s = np.array([src.ctypes.data + int(b) * block for b in order[:256]], dtype=np.uint64)
    d = np.array([dst.ctypes.data + int(b) * block for b in order[256:]], dtype=np.uint64)
    expected = np.zeros_like(dst)
    for a, b in zip(order[:256], order[256:]):
        expected[b * block:(b + 1) * block] = src[a * block:(a + 1) * block]

    async def run() -> None:
        executor = NativeExecutor(2, stream_share=0)
        try:
            await executor.run(Spans(s, d, np.full(256, block, dtype=np.uint64)), local_copier(streaming=True),
                               chunk_bytes=1 << 20)
        finally:
            executor.shutdown()

    asyncio.run(run())
    assert np.array_equal(dst, expected)
    assert LIB is not None
    limit_dst = np.zeros(5 << 20, dtype=np.uint8)
    assert LIB.adt_stream_copy_limit(limit_dst.ctypes.data + 3, src.ctypes.data + 5, (5 << 20) - 3, 2) == 0
    assert np.array_equal(limit_dst[3:], src[5:5 + (5 << 20) - 3]) and limit_dst[:3].sum() == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(runs=st.lists(span, min_size=1, max_size=16), tiny=st.lists(st.integers(1, 64), max_size=6),
       seed=st.integers(0, 999))
def test_a_plan_within_one_buffer_copies_as_one_run_after_another(lanes: int, runs: list[tuple[int, int, int]],
                                                                   tiny: list[int], seed: int) -> None:
    """The pool's grid walk (a plan's runs, on one worker, streaming): runs overlapping each other, and stretches
    of tiny runs (copied apart from the lanes) between them."""
    from aiodatadist.copy.native_pool import NativeExecutor
    from aiodatadist.layout.plans import Runs, make_plan

    rng = np.random.default_rng(seed)
    runs = runs + [(int(rng.integers(0, BUFFER - 64)), int(rng.integers(0, BUFFER - 64)), n) for n in tiny]
    runs = [runs[i] for i in rng.permutation(len(runs))]
    buf = rng.integers(1, 256, BUFFER, dtype=np.uint8)
    expected = one_after_another(buf, runs)
    plan = make_plan(np.zeros(1, np.int64), np.zeros(1, np.int64),
                     Runs(*(np.array(col, np.int64) for col in zip(*runs, strict=True))))
    addrs = np.array([buf.ctypes.data], np.uint64)

    async def run() -> None:
        executor = NativeExecutor(1, stream_share=1)  # every local job streams
        try:
            await executor.wait(executor.start_plan(plan, addrs, addrs, local_copier(), chunk_bytes=1 << 30))
        finally:
            executor.shutdown()

    asyncio.run(run())
    assert np.array_equal(buf, expected)


@settings(max_examples=60, deadline=None)
@given(spans=st.lists(span, min_size=1, max_size=16), seed=st.integers(0, 999))
def test_a_span_at_a_time_copies_the_same(spans: list[tuple[int, int, int]], seed: int) -> None:
    """``Streaming.ALONE`` (a copy whose source is likely cached: one stream, no lanes) copies as ``LANES`` does."""
    buf = np.random.default_rng(seed).integers(1, 256, BUFFER, dtype=np.uint8)
    expected = one_after_another(buf, spans)
    assert copy_spans(buf, spans, streaming=int(Streaming.ALONE)) == len(spans)
    assert np.array_equal(buf, expected)
