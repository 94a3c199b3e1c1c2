"""The running ends a one-sided TCP read hands to the native helper with its destination spans (used as they are,
not copied): computed once per read-only span list, never served for another list."""

from __future__ import annotations

import gc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.transport.tcp.native_connections import _running_ends


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 1 << 40), max_size=300))
def test_the_ends_are_the_running_sums(lengths: list[int]) -> None:
    array = np.array(lengths, dtype=np.uint64)
    assert np.array_equal(_running_ends(array), np.cumsum(array, dtype=np.uint64))
    array.flags.writeable = False
    assert np.array_equal(_running_ends(array), np.cumsum(array, dtype=np.uint64))


def test_a_read_only_list_gets_its_ends_once_and_a_new_list_never_gets_old_ones() -> None:
    first = np.array([3, 5, 7], dtype=np.uint64)
    first.flags.writeable = False
    ends = _running_ends(first)
    assert _running_ends(first) is ends and not ends.flags.writeable
    for _ in range(300):  # lists freed and allocated again, possibly at the same address (the same id)
        other = np.array([1, 1, 1], dtype=np.uint64)
        other.flags.writeable = False
        assert _running_ends(other).tolist() == [1, 2, 3]
        del other
        gc.collect(0)
    writeable = np.array([2, 2], dtype=np.uint64)
    got = _running_ends(writeable)
    writeable[0] = 9  # a caller's own (writeable) list is never cached: its next ends are computed afresh
    assert got.tolist() == [2, 4] and _running_ends(writeable).tolist() == [9, 11]
