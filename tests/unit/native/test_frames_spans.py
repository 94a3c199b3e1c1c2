"""The TCP frame functions move a transfer's byte stream between scattered spans whatever their sizes: spans
shorter than 2 KiB go through a bounce buffer (gathered on send, scattered on receive), longer ones in place, and
a frame may start and end anywhere inside a span."""

from __future__ import annotations

import ctypes
import itertools
import socket
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.native import native_available, native_pool
from aiodatadist.transport.tcp.frames import recv_frame, send_frame

pytestmark = pytest.mark.skipif(not native_available(), reason="the native helper is not built")

sizes = st.lists(st.one_of(st.integers(0, 300), st.integers(1500, 2600), st.integers(60_000, 140_000)),
                 min_size=1, max_size=300)


def _spans(lengths: list[int], seed: int) -> tuple[list[np.ndarray[Any, Any]], np.ndarray[Any, Any],
                                                   np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    buffers = [rng.integers(1, 256, max(n, 1), dtype=np.uint8) for n in lengths]
    addr = np.array([b.ctypes.data for b in buffers], dtype=np.uint64)
    return buffers, addr, np.array(lengths, dtype=np.uint64)


@settings(max_examples=40, deadline=None)
@given(sizes, sizes, st.integers(0, 3), st.data())
def test_a_stream_crosses_any_span_layout(send_sizes: list[int], recv_sizes: list[int], cuts: int,
                                          data: st.DataObject) -> None:
    """The sender's spans, cut into frames at arbitrary byte offsets, land byte-exact in receiver spans of
    another layout (the stream is the concatenation of the spans in order); nothing beyond them is touched."""
    total = min(sum(send_sizes), sum(recv_sizes))
    send_sizes = _clip(send_sizes, total)
    recv_sizes = _clip(recv_sizes, total)
    src, saddr, slen = _spans(send_sizes, 1)
    dst, daddr, dlen = _spans(recv_sizes, 2)
    guard = [d.copy() for d in dst]
    expected = np.concatenate([s[:n] for s, n in zip(src, send_sizes)] + [np.zeros(0, np.uint8)])
    ends = np.cumsum(dlen, dtype=np.uint64)
    bounds = sorted({0, len(send_sizes), *data.draw(st.lists(st.integers(0, len(send_sizes)), max_size=cuts))})
    a, b = socket.socketpair()
    scratch = ctypes.create_string_buffer(1 << 20)
    stop = ctypes.c_int32(0)
    try:
        offsets = np.concatenate(([0], np.cumsum(slen, dtype=np.uint64))).tolist()

        def sender() -> None:
            for lo, hi in itertools.pairwise(bounds):
                send_frame(a, b"", saddr, slen, lo, hi)

        thread = threading.Thread(target=sender)
        thread.start()
        for lo, hi in itertools.pairwise(bounds):
            nbytes = int(offsets[hi] - offsets[lo])
            got, consumed = recv_frame(b, daddr, dlen, ends, int(offsets[lo]), nbytes, ctypes.addressof(stop), scratch)
            assert got == nbytes and consumed == nbytes
        thread.join()
    finally:
        a.close()
        b.close()
    landed = np.concatenate([d[:n] for d, n in zip(dst, recv_sizes)] + [np.zeros(0, np.uint8)])
    assert np.array_equal(landed, expected)
    for d, g, n in zip(dst, guard, recv_sizes):
        assert np.array_equal(d[n:], g[n:])  # (a zero-length span's buffer keeps its byte)


def _clip(lengths: list[int], total: int) -> list[int]:
    out, left = [], total
    for n in lengths:
        out.append(min(n, left))
        left -= out[-1]
    return out


runs = st.lists(st.one_of(st.integers(0, 70), st.integers(71, 300), st.integers(1500, 2600),
                          st.integers(60_000, 140_000)), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), runs, st.integers(0, 3), st.data())
def test_a_grid_is_sent_from_any_byte_range(tensors: int, lengths: list[int], gap: int, data: st.DataObject) -> None:
    """``adt_send_grid`` sends bytes ``[b0, b1)`` of a grid's stream (each tensor's runs in order, then the next
    tensor), walked from any offset: tiny runs through the bounce buffer, long ones in place, runs that continue
    each other merged; the header goes first."""
    lib = native_pool()
    assert lib is not None
    rng = np.random.default_rng(len(lengths))
    lens = np.array(lengths, dtype=np.uint64)
    # runs laid out in order, with gaps of 0-3 x 8 bytes between them (0: they continue each other)
    offs = np.concatenate(([0], np.cumsum(lens + np.uint64(8 * gap))[:-1])).astype(np.uint64)
    per_tensor = int(offs[-1] + lens[-1]) + 64
    memory = rng.integers(1, 256, tensors * per_tensor, dtype=np.uint8)
    bases = np.array([memory.ctypes.data + t * per_tensor for t in range(tensors)], dtype=np.uint64)
    stream = np.concatenate([memory[t * per_tensor + int(o):t * per_tensor + int(o) + int(n)]
                             for t in range(tensors) for o, n in zip(offs, lens)])
    b0 = data.draw(st.integers(0, len(stream)))
    b1 = data.draw(st.integers(b0, len(stream)))
    prefix = np.concatenate(([0], np.cumsum(lens))).astype(np.uint64)
    header = b"HEAD" * 5
    a, b = socket.socketpair()
    result: list[int] = []
    try:
        thread = threading.Thread(target=lambda: result.append(lib.adt_send_grid(
            a.fileno(), header, len(header), bases.ctypes.data, tensors, offs.ctypes.data, lens.ctypes.data, len(lens),
            prefix.ctypes.data, b0, b1)))
        thread.start()
        got = bytearray()
        while len(got) < len(header) + b1 - b0:
            chunk = b.recv(1 << 20)
            assert chunk
            got += chunk
        thread.join()
    finally:
        a.close()
        b.close()
    assert result == [0]
    assert bytes(got[:len(header)]) == header
    assert np.array_equal(np.frombuffer(bytes(got[len(header):]), dtype=np.uint8), stream[b0:b1])
