"""A result set once from any thread and awaited from any event loop (the plumbing of :class:`PeerProcess`).

``asyncio`` futures belong to one loop; a peer process outlives the loop that started it when a module- or
session-scoped fixture starts it and function-scoped tests use it.  :class:`OneShot` keeps its waiters per loop
and wakes each one on its own loop (``call_soon_threadsafe``); a waiter whose loop has closed meanwhile is
skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Generic, TypeVar

__all__ = ["OneShot"]

T = TypeVar("T")


class OneShot(Generic[T]):
    """A value or an exception, set once from any thread; :meth:`wait` from any loop (or none: :meth:`done`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._value: T | None = None
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def done(self) -> bool:
        return self._set

    def set_result(self, value: T) -> bool:
        """Set the value; False (and nothing changes) if it was set already."""
        return self._settle(value, None)

    def set_exception(self, error: BaseException) -> bool:
        """Set the exception; False (and nothing changes) if it was set already."""
        return self._settle(None, error)

    def _settle(self, value: T | None, error: BaseException | None) -> bool:
        with self._lock:
            if self._set:
                return False
            self._set, self._value, self._error = True, value, error
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits there any more
                loop.call_soon_threadsafe(_wake, future)
        return True

    def result(self) -> T:
        """The value (raises the exception); only once :meth:`done`."""
        if not self._set:
            raise asyncio.InvalidStateError("not set yet")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    async def wait(self) -> T:
        """Wait (on the running loop, whichever it is) until set; returns the value or raises the exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if not self._set:
                self._waiters.append((loop, future))
            else:
                future.set_result(None)
        try:
            await future
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove((loop, future))
        return self.result()


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
