"""``int_bounds``, the native fast path of block-list checks: ``(min, max)`` exactly when every item is an exact
``int`` that fits an int64, ``None`` otherwise (the Python checks then look at each item and raise as they do)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiodatadist._checks import I64_MAX, I64_MIN
from aiodatadist.native import int_bounds, native_extension

pytestmark = pytest.mark.skipif(native_extension() is None, reason="the native helper is not built")


@given(st.lists(st.integers(I64_MIN, I64_MAX), min_size=1), st.booleans())
def test_bounds_of_int64_lists_and_tuples(values: list[int], as_tuple: bool) -> None:
    seq: Any = tuple(values) if as_tuple else values
    assert int_bounds(seq) == (min(values), max(values))


@given(st.lists(st.integers(I64_MIN, I64_MAX), max_size=20), st.integers(0, 20),
       st.sampled_from([True, 2**63, -(2**63) - 1, 2**70, 1.0, np.int64(3), "1", None]))
def test_anything_but_exact_int64_ints_gives_none(values: list[int], at: int, odd: Any) -> None:
    """One odd item anywhere (a bool, an int beyond int64, a float, a numpy integer, ...) sends the list to
    the item-by-item checks."""
    values.insert(min(at, len(values)), odd)
    assert int_bounds(values) is None


@pytest.mark.parametrize("value", [[], (), range(3), np.arange(3), "abc", 5, None, {1, 2}])
def test_other_containers_and_empty_ones_give_none(value: Any) -> None:
    assert int_bounds(value) is None
