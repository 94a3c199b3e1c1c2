"""How the native TCP helper cuts a send into frames (``frame_spans``: spans split at every frame boundary, a span
that continues the previous piece of its frame merged into it), on two helpers joined by two real socket pairs:
any source and destination layouts (contiguous runs, zero-length spans, frames cut anywhere) deliver every byte,
in order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers.native_net import joined_helpers, send_spans, set_destination_spans, wait_job_state
from hypothesis import assume, given, settings
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
    assert set_destination_spans(lib, b, rx, dst_addr, dst_len) == 0
    tx = send_spans(lib, a, key, src_addr, src_len)
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


@st.composite
def grids(draw: st.DrawFn) -> tuple[list[tuple[int, int, int]], list[int], list[int]]:
    """Runs (source offset, destination offset, length) shared by every tensor, and each side's tensor bases
    inside a BUFFER-byte array: runs that continue each other, zero-length ones, and tensors that sometimes
    follow each other (a run continued by the next tensor's first run)."""
    runs, src_at, dst_at = [], 0, 0
    for _ in range(draw(st.integers(1, 12))):
        n = draw(st.sampled_from([0, 1, 64, 100, FRAME - 1, FRAME + 3]))
        src_at += draw(st.sampled_from([0, 0, 64]))
        dst_at += draw(st.sampled_from([0, 0, 8]))
        runs.append((src_at, dst_at, n))
        src_at, dst_at = src_at + n, dst_at + n
    tensors = draw(st.integers(1, 4))

    def bases(extent: int) -> list[int]:
        out, at = [], 0
        for _ in range(tensors):
            at += draw(st.sampled_from([0, 0, 512]))  # 0: this tensor starts where the last one's extent ends
            out.append(at)
            at += extent
        return out
    return runs, bases(src_at), bases(dst_at)


@settings(max_examples=60, deadline=None)
@given(grids())
def test_two_sided_grids_deliver_every_run_of_every_tensor(nets: tuple[Any, int, int], case: Any) -> None:
    """``net_send`` / ``net_set_destination`` (the calls the TCP plane makes) take each side as a grid: tensor t's
    run r lands at the destination's tensor t run r, every byte, and nothing else is written."""
    from aiodatadist.native import native_extension

    ext = native_extension()
    lib, a, b = nets
    runs, src_bases, dst_bases = case
    room = max(src_bases[-1], dst_bases[-1]) + max(r[0] + r[2] for r in runs) + max(r[1] + r[2] for r in runs)
    assume(room <= BUFFER)
    rng = np.random.default_rng(len(runs) * 31 + len(src_bases))
    src = rng.integers(1, 256, BUFFER, dtype=np.uint8)
    dst = np.zeros(BUFFER, dtype=np.uint8)
    offsets = np.array([r[0] for r in runs], np.int64), np.array([r[1] for r in runs], np.int64)
    lengths = np.array([r[2] for r in runs], np.int64)
    src_grid = np.array(src_bases, np.uint64) + np.uint64(src.ctypes.data), offsets[0]
    dst_grid = np.array(dst_bases, np.uint64) + np.uint64(dst.ctypes.data), offsets[1]
    key = 5000 + len(runs)
    rx = lib.adt_net_receive(b, key)
    assert ext.net_set_destination(b, rx, *dst_grid, lengths) == 0
    tx = ext.net_send(a, key, *src_grid, lengths)
    assert wait_job_state(lib, a, tx) == JobState.FINISHED
    assert wait_job_state(lib, b, rx) == JobState.FINISHED
    lib.adt_net_job_free(tx)
    lib.adt_net_job_free(rx)
    expected = np.zeros(BUFFER, dtype=np.uint8)
    for s_base, d_base in zip(src_bases, dst_bases, strict=True):
        for s_off, d_off, n in runs:
            expected[d_base + d_off:d_base + d_off + n] = src[s_base + s_off:s_base + s_off + n]
    assert np.array_equal(dst, expected)


def test_two_sided_grid_calls_check_their_arrays(nets: tuple[Any, int, int]) -> None:
    from aiodatadist.native import native_extension

    ext = native_extension()
    _, a, _ = nets
    bases, offsets = np.zeros(2, np.uint64), np.zeros(3, np.int64)
    with pytest.raises(ValueError, match="different lengths"):
        ext.net_send(a, 1, bases, offsets, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="8-byte"):
        ext.net_send(a, 1, bases, offsets, np.zeros(3, np.int32))
    with pytest.raises(TypeError):
        ext.net_set_destination(a, 1, bases, offsets)
    with pytest.raises(ValueError, match="no data plane"):
        ext.net_set_destination(0, 1, bases, offsets, np.zeros(3, np.int64))
