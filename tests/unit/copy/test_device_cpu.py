"""The CPU side of DEVICE caches (CI has no GPU): page-range math and wire validation (the refusal without
CUDA, which needs a linked pair, is in ``integration/test_device_refused.py``)."""

from __future__ import annotations

import itertools
import mmap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiodatadist.copy.device import merged_ranges
from aiodatadist.protocol.codec import ProtocolError
from aiodatadist.protocol.messages import ipc_from_wire

PAGE = mmap.PAGESIZE


@given(st.lists(st.integers(0, 1 << 30), min_size=1, max_size=12), st.integers(1, 3 * PAGE))
def test_merged_ranges_cover_every_tensor_with_disjoint_whole_pages(addrs: list[int], nbytes: int) -> None:
    ranges = merged_ranges(np.array(addrs, dtype=np.uint64), nbytes)
    for start, size in ranges:
        assert start % PAGE == 0 and size % PAGE == 0 and size > 0
    for (s1, n1), (s2, _) in itertools.pairwise(ranges):
        assert s1 + n1 < s2  # disjoint and not touching (touching ones merge)
    for a in addrs:
        assert any(s <= a and a + nbytes <= s + n for s, n in ranges)
    covered = sum(n for _, n in ranges)
    pages = {p for a in addrs for p in range(a // PAGE, (a + nbytes - 1) // PAGE + 1)}
    assert covered <= (len(pages) + 2 * len(ranges)) * PAGE  # nothing far beyond the tensors' pages


def test_ipc_allocations_from_the_wire_are_validated() -> None:
    handle = bytes(range(64))
    assert ipc_from_wire(None) is None
    assert ipc_from_wire([[handle, 3 << 20, 1 << 20], [handle, 1 << 20, 1 << 20]]) == (
        (handle, 1 << 20, 1 << 20), (handle, 3 << 20, 1 << 20))  # sorted by base
    for bad in ([], "x", [[handle[:63], 1, 1]], [[handle, 0, 1]], [[handle, 1, 0]], [[handle, 2**64 - 1, 2]],
                [[handle, 1]], [[handle, 1, True]], [[handle, 1, 1]] * 5000):
        with pytest.raises(ProtocolError):
            ipc_from_wire(bad)
