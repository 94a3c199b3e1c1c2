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
    """The deadlines of one event loop and the one timer that expires them (it holds no reference to its loop:
    :data:`_timers` must not keep a finished loop alive)."""

    def __init__(self) -> None:
        self._pending: dict[deadline, None] = {}
        self._handle: weakref.ref[asyncio.TimerHandle] | None = None  # (a handle holds its loop; the loop, it)
        self._at = math.inf

    def add(self, entry: deadline, loop: asyncio.AbstractEventLoop) -> None:
        self._pending[entry] = None
        if entry.when < self._at:
            self._arm(entry.when, loop)

    def remove(self, entry: deadline) -> None:
        # The timer stays armed: when it fires it finds nothing due and re-arms for what is left, if anything.
        self._pending.pop(entry, None)

    def _arm(self, when: float, loop: asyncio.AbstractEventLoop) -> None:
        armed = self._handle() if self._handle is not None else None
        if armed is not None:
            armed.cancel()
        self._handle = weakref.ref(loop.call_at(when, self._fire))
        self._at = when

    def _fire(self) -> None:
        self._handle, self._at = None, math.inf
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = [entry for entry in self._pending if entry.when <= now]
        for entry in due:
            del self._pending[entry]
            entry.expire()
        if self._pending:
            self._arm(min(entry.when for entry in self._pending), loop)


_timers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Timer] = weakref.WeakKeyDictionary()


class deadline:
    """``with deadline(seconds):`` (or ``async with``) raises ``TimeoutError`` if the block runs longer than
    ``seconds``.  Entering and leaving never wait, so the plain ``with`` form spares the two coroutines an
    ``async with`` costs."""

    __slots__ = ("_cancelling", "_delay", "_expired", "_task", "_timer", "when")

    def __init__(self, seconds: float) -> None:
        self._delay = seconds
        self._expired = False
        self.when = math.inf

    def __enter__(self) -> Self:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("deadline() must be used inside a task")
        timer = _timer_of(loop)
        self._task, self._timer = task, timer
        self._cancelling = task.cancelling()
        self.when = loop.time() + self._delay
        timer.add(self, loop)
        return self

    def expire(self) -> None:
        """Called by the loop's timer once the deadline passed: cancel the task."""
        self._expired = True
        self._task.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._timer.remove(self)
        if self._expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)


_last: tuple[weakref.ref[asyncio.AbstractEventLoop], _Timer] | None = None


def _timer_of(loop: asyncio.AbstractEventLoop) -> _Timer:
    """The loop's timer (the last one looked up is kept at hand: a process has one loop, or one per thread)."""
    global _last
    last = _last
    if last is not None and last[0]() is loop:
        return last[1]
    timer = _timers.get(loop)
    if timer is None:
        timer = _timers[loop] = _Timer()
    _last = (weakref.ref(loop), timer)
    return timer
