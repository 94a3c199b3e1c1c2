"""``transport.tcp.side_spans``: one end's span lists of a plan, from the native walk and from numpy alike."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.examples import examples
from helpers.plans import draw_plan
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.transport.tcp import side_spans


@settings(max_examples=examples(300), deadline=None)
@given(st.data())
def test_the_native_walk_lists_one_end_as_numpy_does(data: st.DataObject) -> None:
    """Addresses and lengths in plan order, merged where this end continues (across runs and tensors), for each
    end of random plans; the native walk and the numpy path give the same lists."""
    if side_spans._grid_table is None:
        pytest.skip("no native helper")
    plan, src_addrs, dst_addrs = draw_plan(data)
    for side in ("src", "dst"):
        addrs = src_addrs if side == "src" else dst_addrs
        native = side_spans._side(plan, addrs, side)
        grid_table, side_spans._grid_table = side_spans._grid_table, None
        try:
            reference = side_spans._side(plan, addrs, side)
        finally:
            side_spans._grid_table = grid_table
        assert np.array_equal(native[0], reference[0]) and np.array_equal(native[1], reference[1])
        assert int(native[1].sum()) == plan.total_bytes
