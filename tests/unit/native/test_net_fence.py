"""The native TCP helper's fence on a cancelled send (``adt_net_cancel`` with ``CANCEL_FENCE``), on two helpers
joined by a real socket pair: the send job ends only once the receiving helper acknowledged that nothing of it
is written any more, and nothing lands afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers.native_net import (
    job_state,
    joined_helpers,
    send_spans,
    set_destination_spans,
    unread_bytes,
    wait_job_state,
)

from aiodatadist.native import JobState, native_pool

pytestmark = pytest.mark.skipif(native_pool() is None, reason="needs the native helper")

CANCEL_FENCE = 2
KEY = 7
FRAME = 1 << 20


@pytest.fixture
def nets(sockets: list[tuple[int, int]]) -> Iterator[tuple[Any, int, int]]:
    """Two helpers (sender, receiver) joined by one connection."""
    with joined_helpers(FRAME, sockets=sockets) as joined:
        yield joined


@pytest.fixture
def sockets() -> list[tuple[int, int]]:
    """The descriptors of the connection of ``nets`` (sender's end, receiver's end)."""
    return []


def _span(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.array([array.ctypes.data], np.uint64), np.array([array.nbytes], np.uint64)


def test_a_cancelled_send_ends_fenced_and_nothing_lands_afterwards(nets: tuple[Any, int, int],
                                                                   sockets: list[tuple[int, int]]) -> None:
    lib, a, b = nets
    rng = np.random.default_rng(5)
    src = rng.integers(1, 256, 64 * FRAME, dtype=np.uint8)
    dst = np.zeros_like(src)
    # The receiving end has no destination yet, so its thread holds the first frame: the send is mid-way.
    rx = lib.adt_net_receive(b, KEY)
    tx = send_spans(lib, a, KEY, *_span(src))
    (_, received), = sockets
    deadline = time.monotonic() + 30
    while unread_bytes(received) == 0:  # the sender has begun its first frame (which the fence lets it finish)
        assert time.monotonic() < deadline, "the sender sent nothing in 30 s"
        time.sleep(0.001)
    assert job_state(lib, a, tx) == JobState.RUNNING
    assert lib.adt_net_cancel(a, tx, CANCEL_FENCE) == 1  # armed
    time.sleep(0.05)
    assert job_state(lib, a, tx) == JobState.RUNNING  # not acknowledged while the receiver is held
    addr, length = _span(dst)
    assert set_destination_spans(lib, b, rx, addr, length) == 0
    assert wait_job_state(lib, a, tx) == JobState.FENCED
    # The FENCE stopped the receiving end: what landed is a prefix of the source, and nothing lands any more.
    assert wait_job_state(lib, b, rx) == JobState.STOPPED
    landed = dst.copy()
    time.sleep(0.1)
    assert np.array_equal(dst, landed)
    moved = int(np.flatnonzero(landed == 0)[0]) if (landed == 0).any() else landed.size
    assert 0 < moved < src.size
    assert np.array_equal(landed[:moved], src[:moved]) and not landed[moved:].any()
    lib.adt_net_job_free(tx)
    lib.adt_net_job_free(rx)


def test_a_send_that_ended_arms_no_fence(nets: tuple[Any, int, int]) -> None:
    lib, a, b = nets
    src = np.random.default_rng(6).integers(1, 256, 3 * FRAME + 5, dtype=np.uint8)
    dst = np.zeros_like(src)
    rx = lib.adt_net_receive(b, KEY)
    addr, length = _span(dst)
    assert set_destination_spans(lib, b, rx, addr, length) == 0
    tx = send_spans(lib, a, KEY, *_span(src))
    assert wait_job_state(lib, b, rx) == JobState.FINISHED
    assert wait_job_state(lib, a, tx) == JobState.FINISHED
    assert lib.adt_net_cancel(a, tx, CANCEL_FENCE) == 0
    assert job_state(lib, a, tx) == JobState.FINISHED
    assert np.array_equal(dst, src)
    lib.adt_net_job_free(tx)
    lib.adt_net_job_free(rx)
