"""``aiodatadist.testing.pattern``: what every byte-exact check of the suite relies on."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from aiodatadist.testing import pattern


@given(seed=st.integers(0, 2**32 - 1), tensor=st.integers(0, 4096), nbytes=st.integers(0, 5000))
def test_a_pattern_is_deterministic_never_zero_and_exactly_as_long_as_asked(seed: int, tensor: int,
                                                                             nbytes: int) -> None:
    data = pattern(seed, tensor, nbytes)
    assert data.dtype == np.uint8 and data.shape == (nbytes,) and data.flags.c_contiguous
    assert not (data == 0).any()
    assert np.array_equal(data, pattern(seed, tensor, nbytes))
    # A longer pattern starts with the shorter one (a test may check a prefix of a tensor).
    assert np.array_equal(pattern(seed, tensor, nbytes + 13)[:nbytes], data)


def test_patterns_differ_by_seed_and_tensor_and_look_random() -> None:
    base = pattern(5, 0, 1 << 16)
    for other in (pattern(6, 0, 1 << 16), pattern(5, 1, 1 << 16)):
        assert np.count_nonzero(base == other) < (1 << 16) // 100  # about 1/255 of them agree by chance
    counts = np.bincount(base, minlength=256)
    assert counts[0] == 0 and counts[1:].min() > 0  # every non-zero value occurs
    assert len(set(base.reshape(-1, 64).sum(axis=1).tolist())) > 500  # no repeating 64-byte block
