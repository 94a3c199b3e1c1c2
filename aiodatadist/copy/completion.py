"""How the event loop learns that the native helper's threads finished jobs: :class:`NotifyPipe`.

Bulk work runs on threads (the copy pools, the TCP planes' I/O threads) while its waiters run on an event loop:
the helper's threads write the handles of finished jobs into a pipe the loop watches.  Settling a job's future
and waiting through cancellation are generic asyncio helpers (:mod:`aiodatadist._aio`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import numpy as np

__all__ = ["HANDLE_BYTES", "NotifyPipe"]

HANDLE_BYTES = 8  # one finished job's handle in the notify pipe (a uint64; writes this small are atomic)
READ_HANDLES = 4096  # handles taken from the pipe per wake-up of the event loop


class NotifyPipe:
    """A pipe the native helper's threads write finished jobs' handles into (:data:`HANDLE_BYTES` each),
    read on the event loop: ``on_handle`` is called there once per handle, in the order they were written.

    ``fd`` is the write end to give the helper.  :meth:`close` stops watching and closes both ends: call it
    once no thread can write any more.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_handle: Callable[[int], None]) -> None:
        self.read_fd, self.fd = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self.read_fd, False)
        self.loop = loop
        self._on_handle = on_handle
        loop.add_reader(self.read_fd, self._on_ready)

    def _on_ready(self) -> None:
        try:
            data = os.read(self.read_fd, HANDLE_BYTES * READ_HANDLES)
        except BlockingIOError:
            return
        whole = len(data) - len(data) % HANDLE_BYTES
        for handle in np.frombuffer(data[:whole], dtype=np.uint64).tolist():
            self._on_handle(handle)

    def close(self) -> None:
        try:
            if not self.loop.is_closed():
                self.loop.remove_reader(self.read_fd)
        finally:
            os.close(self.read_fd)
            os.close(self.fd)
