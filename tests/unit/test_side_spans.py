"""``transport.tcp.side_spans``: one end's span lists of a plan, from the native walk and from numpy alike."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.layout import Runs, make_plan
from aiodatadist.transport.tcp import side_spans


@settings(max_examples=examples(300), deadline=None)
@given(st.data())
def test_the_native_walk_lists_one_end_as_numpy_does(data: st.DataObject) -> None:
    """Addresses and lengths in plan order, merged where this end continues (across runs and tensors), for each
    end of random plans; the native walk and the numpy path give the same lists."""
    if side_spans._grid_table is None:
        pytest.skip("no native helper")
    tensors, size = data.draw(st.integers(1, 4)), 1 << 20
    adjacent = data.draw(st.booleans())
    addrs = np.array([(1 << 40) + t * size * (1 if adjacent else 3) for t in range(tensors)], np.uint64)
    pairs = data.draw(st.integers(1, 6))
    src_tensor = data.draw(st.lists(st.integers(0, tensors - 1), min_size=pairs, max_size=pairs))
    dst_tensor = data.draw(st.lists(st.integers(0, tensors - 1), min_size=pairs, max_size=pairs))
    s_off, d_off, lengths = [], [], []
    for _ in range(data.draw(st.integers(1, 8))):
        n = data.draw(st.integers(1, 100_000))
        if s_off and data.draw(st.booleans()):  # continues the previous run on the source side, or on both
            s = s_off[-1] + lengths[-1]
            d = d_off[-1] + lengths[-1] if data.draw(st.booleans()) else data.draw(st.integers(0, size - n))
        else:
            s, d = data.draw(st.integers(0, size - n)), data.draw(st.integers(0, size - n))
        s_off.append(s)
        d_off.append(d)
        lengths.append(n)
    plan = make_plan(np.array(src_tensor, np.int64), np.array(dst_tensor, np.int64),
                     Runs(np.array(s_off, np.int64), np.array(d_off, np.int64), np.array(lengths, np.int64)))
    for side in ("src", "dst"):
        native = side_spans._side(plan, addrs, side)
        grid_table, side_spans._grid_table = side_spans._grid_table, None
        try:
            reference = side_spans._side(plan, addrs, side)
        finally:
            side_spans._grid_table = grid_table
        assert np.array_equal(native[0], reference[0]) and np.array_equal(native[1], reference[1])
        assert int(native[1].sum()) == plan.total_bytes
