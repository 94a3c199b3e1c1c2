"""``transport.base.plan_grid`` / ``grid_spans``: one side of a plan as a grid (what the TCP planes hand the
native helper), and its spans in stream order as the Python fallback plane places them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.layout.plans import CacheGeometry, TransferParams, transfer_plan
from aiodatadist.transport.base import grid_spans, plan_grid

BLOCK = 64


def _naive_spans(plan, addrs: np.ndarray, src: bool) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """Every span in plan order (tensor-major), unmerged, zero-length ones left out."""
    tensors = plan.src_tensor if src else plan.dst_tensor
    offsets = plan.runs.src_offset if src else plan.runs.dst_offset
    return [(int(addrs[t]) + int(o), int(n)) for t in tensors for o, n in zip(offsets, plan.runs.length, strict=True)
            if n]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for addr, n in spans:
        if out and out[-1][0] + out[-1][1] == addr:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((addr, n))
    return out


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_grid_spans_are_the_plans_spans_in_stream_order_merged(data: st.DataObject) -> None:
    blocks = data.draw(st.integers(2, 40))
    count = data.draw(st.integers(1, blocks))
    src = data.draw(st.permutations(range(blocks)))[:count]
    dst = data.draw(st.permutations(range(blocks)))[:count]
    tensors = data.draw(st.integers(1, 4))
    geometry = CacheGeometry(tensors, blocks * BLOCK, blocks, True, 1)
    plan = transfer_plan(TransferParams("pull", "blocks", tuple(src), tuple(dst), None, None, 2, -1, 0),
                         geometry, geometry, 0)
    # Tensors back to back (a run at a tensor's end continues into the next one) or apart.
    pitch = blocks * BLOCK + data.draw(st.sampled_from([0, 4096]))
    addrs = np.arange(tensors, dtype=np.uint64) * np.uint64(pitch) + np.uint64(1 << 20)
    for side in (True, False):
        grid = plan_grid(plan, addrs, side)
        assert grid[0].dtype == np.uint64 and grid[0].flags.c_contiguous and grid[1].flags.c_contiguous
        starts, lengths = grid_spans(grid, plan.runs.length)
        got = [(int(a), int(n)) for a, n in zip(starts, lengths, strict=True) if n]
        assert _merged(got) == got  # nothing left that continues the span before it
        assert got == _merged(_naive_spans(plan, addrs, side))
        assert int(lengths.sum()) == plan.total_bytes


def test_a_grid_of_one_tensor_at_zero_is_a_span_list() -> None:
    starts, lengths = grid_spans((np.zeros(1, np.uint64), np.array([4096, 8192, 8292], np.int64)),
                                 np.array([100, 100, 7], np.int64))
    assert starts.tolist() == [4096, 8192] and lengths.tolist() == [100, 107]
