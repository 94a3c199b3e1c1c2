"""The native helper's streaming (non-temporal) copies, at every store width this CPU has (16, 32 and 64 bytes per
store: SSE2, AVX2, AVX-512; the widest suitable one is chosen when the library loads), copy exactly the spans they
are given, from and to any alignment, and nothing else."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np
import pytest

from aiodatadist.native import native_pool

LIB = native_pool()
pytestmark = pytest.mark.skipif(LIB is None, reason="the native helper is not built")


@pytest.fixture(params=[16, 32, 64])
def width(request: pytest.FixtureRequest) -> Iterator[int]:
    assert LIB is not None
    chosen = LIB.adt_stream_stores(0)
    if LIB.adt_stream_stores(request.param) != request.param:
        pytest.skip(f"this CPU or build has no {request.param}-byte streaming stores")
    try:
        yield request.param
    finally:
        assert LIB.adt_stream_stores(0) == chosen


def test_the_width_chosen_at_load_is_one_this_cpu_has() -> None:
    assert LIB is not None
    chosen = LIB.adt_stream_stores(0)
    assert chosen in (0, 16, 32, 64)  # 0: a build without SSE2 (memcpy only)
    assert LIB.adt_stream_stores(8) == -1 and LIB.adt_stream_stores(0) == chosen


@pytest.mark.parametrize("seed", range(4))
def test_streaming_copies_land_exactly_at_any_alignment(width: int, seed: int) -> None:
    assert LIB is not None
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 256, 4 << 20, dtype=np.uint8)
    dst = rng.integers(1, 256, 4 << 20, dtype=np.uint8)
    expected = dst.copy()
    spans: list[tuple[int, int, int]] = []
    src_at, dst_at = int(rng.integers(0, 128)), int(rng.integers(0, 128))
    while True:  # spans of 4 KiB and more (the streaming path), at odd offsets, some of them back to back
        n = int(rng.integers(4096, 70_000))
        if max(src_at, dst_at) + n > len(src):
            break
        spans.append((src_at, dst_at, n))
        expected[dst_at:dst_at + n] = src[src_at:src_at + n]
        gap = 0 if rng.random() < 0.3 else int(rng.integers(1, 200))
        src_at += n + int(rng.integers(0, 200))
        dst_at += n + gap
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    s = np.array([base_s + a for a, _, _ in spans], dtype=np.uint64)
    d = np.array([base_d + b for _, b, _ in spans], dtype=np.uint64)
    lengths = np.array([n for _, _, n in spans], dtype=np.uint64)
    vp = ctypes.c_void_p
    copied = LIB.adt_copy_spans(vp(d.ctypes.data), vp(s.ctypes.data), vp(lengths.ctypes.data), len(spans), 1, None)
    assert copied == len(spans) > 20
    assert np.array_equal(dst, expected)  # every span's bytes, and nothing between them
