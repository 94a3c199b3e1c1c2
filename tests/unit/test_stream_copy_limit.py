"""The benchmark's same-host limit, ``adt_stream_copy_limit``: N threads with streaming stores copy exactly the
bytes asked for (odd sizes, unaligned ends, more threads than 64-byte lines), and nothing beyond them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.native import native_pool
from aiodatadist_benchmarks.bench.baselines import StreamCopy, stream_copy_gbps

LIB = native_pool()
pytestmark = pytest.mark.skipif(LIB is None or not hasattr(LIB, "adt_stream_copy_limit"),
                                reason="native helper not built")


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 300_000), offset=st.integers(0, 63), threads=st.integers(1, 9), seed=st.integers(0, 99))
def test_copies_exactly_the_bytes_asked_for(size: int, offset: int, threads: int, seed: int) -> None:
    assert LIB is not None
    copy = LIB.adt_stream_copy_limit
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 256, size + 128, dtype=np.uint8)
    dst = np.zeros(size + 128, dtype=np.uint8)
    assert copy(dst.ctypes.data + offset, src.ctypes.data + offset, size, threads) == 0
    assert np.array_equal(dst[offset:offset + size], src[offset:offset + size])
    assert not dst[:offset].any() and not dst[offset + size:].any()


def test_the_baseline_measures_a_copy() -> None:
    assert (stream_copy_gbps(4 << 20, 2, 2) or 0) > 0


def test_the_instrument_copies_its_bytes_each_time_it_is_read() -> None:
    limit = StreamCopy.create(3 << 20, 2)
    assert limit is not None and limit.name == "streaming copy 3 MiB, 2 threads"
    assert all(limit.seconds() > 0 for _ in range(3))
    limit.check()
    assert limit._own is not None
    limit._own[0][768 * 16] ^= 0xFF  # a wrong byte where check() looks (every 768th of 3 MiB) is caught
    with pytest.raises(RuntimeError, match="wrong bytes"):
        limit.check()


def test_the_instrument_can_copy_within_memory_it_does_not_own() -> None:
    buf = np.random.default_rng(5).integers(1, 256, 2 << 20, dtype=np.uint8)
    half = 1 << 20
    limit = StreamCopy.create(half, 2, within=(buf.ctypes.data + half, buf.ctypes.data), name="within")
    assert limit is not None and limit.name == "within"
    assert np.array_equal(buf[half:], buf[:half])  # the warm-up copy already ran
    buf[half:] = 0
    assert limit.seconds() > 0
    assert np.array_equal(buf[half:], buf[:half])
    limit.check()  # nothing of its own to check
