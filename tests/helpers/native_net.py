"""Two native TCP helpers (``native/src/net.c``) joined by real socket pairs, driven through their C API, and their
jobs' states: for tests of the helper's framing, fences and jobs without a link around it."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import termios
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from aiodatadist.native import JobState, native_extension, native_pool


@contextlib.contextmanager
def joined_helpers(frame: int, connections: int = 1,
                   sockets: list[tuple[int, int]] | None = None) -> Iterator[tuple[Any, int, int]]:
    """(the helper library, sender, receiver): two helpers cutting frames of ``frame`` bytes, joined by
    ``connections`` socket pairs; their job announcements go to a pipe nobody reads (never blocking a writer).
    ``sockets`` gets each pair's descriptors (sender's end, receiver's end), the helpers' own: to look at only
    (:func:`unread_bytes`), while they are open."""
    lib: Any = native_pool()
    r, w = os.pipe()
    os.set_blocking(w, False)
    a, b = lib.adt_net_new(w, None, 0, frame), lib.adt_net_new(w, None, 0, frame)
    for _ in range(connections):
        left, right = socket.socketpair()
        if sockets is not None:
            sockets.append((left.fileno(), right.fileno()))
        assert lib.adt_net_attach(a, left.detach()) == 0
        assert lib.adt_net_attach(b, right.detach()) == 0
    try:
        yield lib, a, b
    finally:
        for net in (a, b):
            lib.adt_net_close(net)
        for net in (a, b):
            lib.adt_net_free(net)
        os.close(r)
        os.close(w)


_ZERO_BASE = np.zeros(1, np.uint64)


def send_spans(lib: Any, net: int, key: int, addr: Any, length: Any) -> int:
    """The module's ``net_send`` of a list of spans (numpy uint64 arrays): a grid of one tensor at 0."""
    return int(native_extension().net_send(net, key, _ZERO_BASE, addr, length) or 0)


def set_destination_spans(lib: Any, net: int, job: int, addr: Any, length: Any) -> int:
    """The module's ``net_set_destination`` of a list of spans (as :func:`send_spans`): 0 or an errno."""
    return int(native_extension().net_set_destination(net, job, _ZERO_BASE, addr, length))


def job_state(lib: Any, net: int, job: int) -> int:
    err, status = ctypes.c_int(0), ctypes.c_int(0)
    return int(lib.adt_net_job_state(net, job, ctypes.byref(err), ctypes.byref(status)))


def unread_bytes(fd: int) -> int:
    """Bytes that arrived on socket ``fd`` and were not read yet (``FIONREAD``)."""
    count = ctypes.c_int(0)
    if fcntl.ioctl(fd, termios.FIONREAD, count) != 0:
        raise OSError("FIONREAD failed")
    return count.value


def wait_job_state(lib: Any, net: int, job: int, within: float = 10.0) -> int:
    """The job's state once it is no longer running, or RUNNING after ``within`` seconds."""
    deadline = time.monotonic() + within
    while (state := job_state(lib, net, job)) == JobState.RUNNING and time.monotonic() < deadline:
        time.sleep(0.0005)
    return state
