"""How the native TCP helper cuts a send into frames (``frame_spans``: spans split at every frame boundary, a span
that continues the previous piece of its frame merged into it), on two helpers joined by two real socket pairs:
any source and destination layouts (contiguous runs, zero-length spans, frames cut anywhere) deliver every byte,
in order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers.native_net import joined_helpers, wait_job_state
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.native import JobState, native_pool

pytestmark = pytest.mark.skipif(native_pool() is None, reason="needs the native helper")

FRAME = 4096  # bytes per frame: a few hundred bytes of spans already cross frame boundaries
BUFFER = 64 << 10


@pytest.fixture(scope="module")
def nets() -> Iterator[tuple[Any, int, int]]:
    """Two helpers (sender, receiver) joined by two connections."""
    with joined_helpers(FRAME, connections=2) as joined:
        yield joined


def layout(draw: st.DrawFn, total: int) -> tuple[np.ndarray, np.ndarray]:
    """Spans over a BUFFER-byte array covering ``total`` bytes: runs of touching spans, gaps, empty spans."""
    lengths: list[int] = []
    left = total
    while left:
        n = min(left, draw(st.sampled_from([1, 7, 64, 100, 2048, FRAME, FRAME + 3, 3 * FRAME])))
        lengths.append(n)
        left -= n
        if draw(st.integers(0, 9)) == 0:
            lengths.append(0)
    starts, at = [], 0
    room = BUFFER - total
    for n in lengths:
        gap = draw(st.sampled_from([0, 0, 0, 1, 64]))  # mostly touching: merged into one piece of a frame
        gap = min(gap, room)
        room -= gap
        at += gap
        starts.append(at)
        at += n
    return np.array(starts, np.uint64), np.array(lengths, np.uint64)


@st.composite
def transfers(draw: st.DrawFn) -> tuple[int, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    total = draw(st.integers(0, BUFFER // 2))
    return total, layout(draw, total), layout(draw, total)


@settings(max_examples=60, deadline=None)
@given(transfers())
def test_any_layouts_deliver_every_byte_in_order(nets: tuple[Any, int, int], case: Any) -> None:
    lib, a, b = nets
    total, (src_off, src_len), (dst_off, dst_len) = case
    rng = np.random.default_rng(total)
    src = rng.integers(1, 256, BUFFER, dtype=np.uint8)
    dst = np.zeros(BUFFER, dtype=np.uint8)
    src_addr = src_off + np.uint64(src.ctypes.data)
    dst_addr = dst_off + np.uint64(dst.ctypes.data)
    key = 1000 + total
    rx = lib.adt_net_receive(b, key)
    assert lib.adt_net_set_destination(b, rx, dst_addr.ctypes.data, dst_len.ctypes.data, len(dst_len)) == 0
    tx = lib.adt_net_send(a, key, src_addr.ctypes.data, src_len.ctypes.data, len(src_len))
    assert wait_job_state(lib, a, tx) == JobState.FINISHED
    assert wait_job_state(lib, b, rx) == JobState.FINISHED
    lib.adt_net_job_free(tx)
    lib.adt_net_job_free(rx)
    sent = np.concatenate([src[int(o):int(o + n)] for o, n in zip(src_off, src_len, strict=True)] or [src[:0]])
    got = np.concatenate([dst[int(o):int(o + n)] for o, n in zip(dst_off, dst_len, strict=True)] or [dst[:0]])
    assert np.array_equal(got, sent)
    covered = np.zeros(BUFFER, dtype=bool)
    for o, n in zip(dst_off, dst_len, strict=True):
        covered[int(o):int(o + n)] = True
    assert not dst[~covered].any()  # nothing outside the destination spans
