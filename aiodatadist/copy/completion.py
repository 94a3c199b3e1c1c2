"""How the event loop learns that threads are done with a job, shared by every executor and data plane.

Bulk work runs on threads (the copy pools, the CUDA driver's callback thread, the TCP planes' I/O threads) while
its waiters run on an event loop.  Three mechanisms connect the two, each written once here:

* :func:`settle`: settle a job's future from its outcome, once (a late or repeated completion is a no-op);
* :func:`wait_through_cancellation`: await something to its end even if the caller is cancelled meanwhile,
  then re-raise the cancellation.  Used where the end means "no thread touches this memory any more" (or "the
  peer confirmed that"): returning earlier would let a cancelled caller free or reuse memory that is still
  written to.  ``anyio.CancelScope(shield=True)`` cannot do this: it shields only from anyio's own cancel
  scopes, not from ``asyncio.timeout`` or ``Task.cancel()``, which is how our callers cancel (see
  ``docs/design.md``);
* :class:`NotifyPipe`: the pipe the native helper's threads write the handles of finished jobs into (the copy
  pool's and the TCP plane's), watched by the event loop.

This module sits below :mod:`aiodatadist.copy` and :mod:`aiodatadist.transport` (and is imported by
:mod:`aiodatadist.cuda.executor`); it imports nothing of the package.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np

__all__ = ["HANDLE_BYTES", "NotifyPipe", "settle", "wait_through_cancellation"]

T = TypeVar("T")

HANDLE_BYTES = 8  # one finished job's handle in the notify pipe (a uint64; writes this small are atomic)
READ_HANDLES = 4096  # handles taken from the pipe per wake-up of the event loop


def settle(future: asyncio.Future[None], error: BaseException | None = None) -> None:
    """Finish ``future`` with ``error`` (or with success) unless it is done already (e.g. its waiter was
    cancelled, which cancels the future it awaited)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)


async def wait_through_cancellation(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` (a future, or a coroutine, which then runs as a task) to its end, through any number
    of cancellations of the caller.

    Returns its result or raises its exception; if the caller was cancelled meanwhile, raises
    ``CancelledError`` instead (its exception, if any, is marked retrieved), so that a cancellation (or the
    ``asyncio.timeout`` built on it) is never swallowed.
    """
    future = asyncio.ensure_future(awaitable)
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True  # keep waiting: whatever it guards must end first
        except BaseException:  # noqa: BLE001 - it failed, so it is done: its error is raised below
            break
    if cancelled:
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation takes precedence
        raise asyncio.CancelledError
    return future.result()


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
