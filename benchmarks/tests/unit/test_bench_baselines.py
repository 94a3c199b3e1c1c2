"""The benchmarks' memory limits (:mod:`aiodatadist_benchmarks.bench.baselines`): the streaming-copy instrument
measures a copy of its bytes each time it is read, on buffers of its own or within memory it does not own."""

from __future__ import annotations

import numpy as np
import pytest

from aiodatadist.testing import probes
from aiodatadist_benchmarks.bench.baselines import StreamCopy, copyto_gbps, stream_copy_gbps

pytestmark = pytest.mark.skipif(probes.stream_copy_function() is None, reason="native helper not built")


def test_the_baselines_measure_a_copy() -> None:
    assert (stream_copy_gbps(4 << 20, 2, 2) or 0) > 0
    assert copyto_gbps(4 << 20, 2) > 0


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
