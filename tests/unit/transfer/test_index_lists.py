"""Block lists accept any one-dimensional integer sequence (list, tuple, range, numpy array, anything with
``__array__`` or ``tolist`` such as a torch tensor) with the same meaning as the list, and refuse everything
else with the list form's exceptions.  (Torch tensors themselves: tests/unit/api/test_torch.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiodatadist import BlocksCacheKey, CacheDesc, CacheKey, CacheManager, DataType, LLMException, Placement
from aiodatadist._checks import check_index_list
from aiodatadist.registry.caches import CacheEntry
from aiodatadist.transfer import validate

U64_MAX = 2**64 - 1
PARAM_INVALID_CODE = "LLM_PARAM_INVALID"


class OnlyToList:
    """Duck-typed like a CUDA tensor: no usable ``__array__``, only ``tolist``."""

    def __init__(self, items: Any) -> None:
        self._items = items

    def tolist(self) -> Any:
        return self._items


class OnlyArray:
    """Array-like through ``__array__`` only."""

    def __init__(self, items: Any, dtype: Any = np.int64) -> None:
        self._array = np.asarray(items, dtype=dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self._array


FORMS: dict[str, Callable[[list[int]], Any]] = {
    "list": list,
    "tuple": tuple,
    "int64": lambda xs: np.asarray(xs, dtype=np.int64),
    "uint64": lambda xs: np.asarray(xs, dtype=np.uint64),
    "int32": lambda xs: np.asarray(xs, dtype=np.int32),
    "uint16": lambda xs: np.asarray(xs, dtype=np.uint16),
    "strided": lambda xs: np.repeat(np.asarray(xs, dtype=np.int64), 2)[::2],  # a non-contiguous view
    "tolist": OnlyToList,
    "__array__": OnlyArray,
}

small_lists = st.lists(st.integers(0, 2**15 - 1), max_size=40)


@given(small_lists, st.sampled_from(sorted(FORMS)))
def test_every_form_means_the_list(xs: list[int], form: str) -> None:
    out = check_index_list("dst_blocks", FORMS[form](xs), "uint64")
    assert out == xs
    assert all(type(v) is int for v in out)


@given(st.integers(0, 1000), st.integers(0, 1000), st.integers(-7, 7).filter(bool))
def test_a_range_means_its_list(start: int, stop: int, step: int) -> None:
    r = range(start, stop, step)
    assert check_index_list("src_blocks", r, "uint64") == list(r)


@given(st.lists(st.integers(0, U64_MAX), min_size=1, max_size=20))
def test_full_uint64_range(xs: list[int]) -> None:
    assert check_index_list("b", np.asarray(xs, dtype=np.uint64), "uint64") == xs
    assert check_index_list("b", np.asarray(xs, dtype=object), "uint64") == xs


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (np.array([True, False]), TypeError),  # a bool array is no index array
        (np.array([1.0, 2.0]), TypeError),
        (np.array([[1, 2], [3, 4]]), TypeError),  # 2-D
        (np.array(3), TypeError),  # 0-D
        (np.int64(3), TypeError),  # a scalar
        ("12", TypeError),
        (b"\x01\x02", TypeError),
        ({1, 2}, TypeError),
        ({1: 2}, TypeError),
        ((i for i in range(3)), TypeError),
        (3, TypeError),
        (OnlyToList([[1, 2], [3, 4]]), TypeError),
        (OnlyToList([[1, 2], [3]]), TypeError),  # ragged
        (OnlyToList([1.5, 2.0]), TypeError),
        (OnlyToList([True, False]), TypeError),
        (OnlyArray([1.0], dtype=np.float64), TypeError),
        (np.array([1, "a"], dtype=object), TypeError),
        (np.array([1, 2.0], dtype=object), TypeError),
        ([1, 2.0], TypeError),  # as before
        (["1"], TypeError),
        (np.array([3, -1]), ValueError),
        (np.array([-(2**63)], dtype=np.int64), ValueError),
        (np.array([2**64], dtype=object), ValueError),
        (range(-1, 3), ValueError),
        (range(3, -2, -1), ValueError),
        (range(U64_MAX, U64_MAX + 2), ValueError),
        ([0, -1], ValueError),  # as before
        (OnlyToList([1, -5]), ValueError),
    ],
)
def test_refused_forms(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        check_index_list("dst_blocks", value, "uint64")


def test_empty_forms_are_empty() -> None:
    for value in ([], (), range(0), range(5, 2), np.array([], dtype=np.int64), np.empty(0, dtype=np.uint8),
                  OnlyToList([])):
        assert check_index_list("b", value, "uint64") == []


def _entry(blocks: int = 64) -> CacheEntry:
    desc = CacheDesc(2, [blocks, 8], DataType.DT_UINT8, Placement.HOST)
    return CacheEntry(1, desc, np.array([4096, 8192], dtype=np.uint64), True, True)


@given(st.lists(st.integers(0, 63), min_size=1, max_size=30, unique=True), st.sampled_from(sorted(FORMS)),
       st.sampled_from(sorted(FORMS)))
def test_pull_and_push_blocks_params_match_the_list_form(xs: list[int], src_form: str, dst_form: str) -> None:
    entry = _entry()
    src = list(reversed(xs))

    def entry_of(name: str, cache: Any) -> CacheEntry:
        return entry

    key = BlocksCacheKey(7, 0)
    _, want = validate.pull_blocks(entry_of, key, None, src, xs, {})
    _, got = validate.pull_blocks(entry_of, key, None, FORMS[src_form](src), FORMS[dst_form](xs), {})
    assert got == want
    _, want = validate.push_blocks(entry_of, None, key, None, src, xs, {})
    _, got = validate.push_blocks(entry_of, None, key, None, FORMS[src_form](src), FORMS[dst_form](xs), {})
    assert got == want
    # C2B: no source blocks, given as None or as an empty array
    _, want = validate.pull_blocks(entry_of, CacheKey(7, 1), None, (), xs, {})
    _, got = validate.pull_blocks(entry_of, CacheKey(7, 1), None, np.array([], dtype=np.int64),
                                  FORMS[dst_form](xs), {})
    assert got == want


def test_local_bounds_still_checked_for_arrays() -> None:
    entry = _entry(blocks=4)

    def entry_of(name: str, cache: Any) -> CacheEntry:
        return entry

    with pytest.raises(LLMException) as info:
        validate.pull_blocks(entry_of, BlocksCacheKey(7, 0), None, range(2), np.array([0, 4]), {})
    assert info.value.status_code.name == PARAM_INVALID_CODE
    with pytest.raises(TypeError):
        validate.pull_blocks(entry_of, BlocksCacheKey(7, 0), None, np.array([0.0]), [0], {})


async def test_copy_blocks_accepts_arrays_and_ranges(cache_manager: CacheManager) -> None:
    desc = CacheDesc(2, [8, 16], DataType.DT_UINT8, Placement.HOST)
    cache = cache_manager.allocate_blocks_cache(desc)
    views = cache.tensors
    rng = np.random.default_rng(5)
    for view in views:
        view[...] = rng.integers(1, 256, size=view.shape, dtype=np.uint8)
    before = [v.copy() for v in views]
    await cache_manager.copy_blocks(cache, {0: np.array([1, 2], dtype=np.uint32), np.int64(3): range(4, 6)})
    for view, old in zip(views, before):
        for dst, src in ((1, 0), (2, 0), (4, 3), (5, 3)):
            assert np.array_equal(view[dst], old[src])
        for untouched in (0, 3, 6, 7):
            assert np.array_equal(view[untouched], old[untouched])
    with pytest.raises(TypeError):
        await cache_manager.copy_blocks(cache, {0: np.array([[1]])})
