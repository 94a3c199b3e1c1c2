"""The benchmarks' same-host limit, ``adt_stream_copy_limit`` (``aiodatadist.testing.probes``): N threads with
streaming stores copy exactly the bytes asked for (odd sizes, unaligned ends, more threads than 64-byte lines),
and nothing beyond them.  The benchmarks' instrument built on it is tested with them
(``benchmarks/tests/unit/test_bench_baselines.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.native import native_pool
from aiodatadist.testing import probes

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


def test_the_hook_is_the_native_function() -> None:
    assert LIB is not None and probes.stream_copy_function() is LIB.adt_stream_copy_limit
