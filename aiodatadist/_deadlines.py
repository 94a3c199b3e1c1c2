"""``deadline(seconds)``: ``asyncio.timeout`` for the per-transfer path, at a fraction of its cost.

``asyncio.timeout`` schedules and cancels a timer for every use (about 4 us a use here, 15 % of a small transfer's
call). A transfer's deadline almost never expires, so the deadlines of one event loop share a single timer instead:
entering one is a dict insertion, leaving it a removal, and the timer runs only when the earliest deadline still
registered may have passed (then it expires those due and re-arms for the next). Expiry behaves as
``asyncio.timeout``'s: the task is cancelled, and the ``CancelledError`` leaving the block becomes a
``TimeoutError``, unless someone else cancelled the task as well (then it stays a cancellation).
"""

from __future__ import annotations

import asyncio
import math
import weakref
from types import TracebackType
from typing import Self

__all__ = ["deadline"]


class _Timer:
    """The deadlines of one event loop and the one timer that expires them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: dict[deadline, None] = {}
        self._handle: asyncio.TimerHandle | None = None
        self._at = math.inf

    def add(self, entry: deadline) -> None:
        self._pending[entry] = None
        if entry.when < self._at:
            self._arm(entry.when)

    def remove(self, entry: deadline) -> None:
        # The timer stays armed: when it fires it finds nothing due and re-arms for what is left, if anything.
        self._pending.pop(entry, None)

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_at(when, self._fire)
        self._at = when

    def _fire(self) -> None:
        self._handle, self._at = None, math.inf
        now = self._loop.time()
        due = [entry for entry in self._pending if entry.when <= now]
        for entry in due:
            del self._pending[entry]
            entry.expire()
        if self._pending:
            self._arm(min(entry.when for entry in self._pending))


_timers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Timer] = weakref.WeakKeyDictionary()


class deadline:
    """``async with deadline(seconds):`` raises ``TimeoutError`` if the block runs longer than ``seconds``."""

    __slots__ = ("_cancelling", "_delay", "_expired", "_task", "_timer", "when")

    def __init__(self, seconds: float) -> None:
        self._delay = seconds
        self._expired = False
        self.when = math.inf

    async def __aenter__(self) -> Self:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("deadline() must be used inside a task")
        timer = _timers.get(loop)
        if timer is None:
            timer = _timers[loop] = _Timer(loop)
        self._task, self._timer = task, timer
        self._cancelling = task.cancelling()
        self.when = loop.time() + self._delay
        timer.add(self)
        return self

    def expire(self) -> None:
        """Called by the loop's timer once the deadline passed: cancel the task."""
        self._expired = True
        self._task.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._timer.remove(self)
        if self._expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc
