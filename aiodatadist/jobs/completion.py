"""How the event loop learns that the native helper's threads finished jobs: :class:`NotifyPipe`, and
:class:`Polling` for the jobs that end within microseconds.

Bulk work runs on threads (the copy pools, the TCP planes' I/O threads) while its waiters run on an event loop:
the helper's threads write the handles of finished jobs into a pipe the loop watches.  Settling a job's future
and waiting through cancellation are generic asyncio helpers (:mod:`aiodatadist._aio`).
"""

from __future__ import annotations

import asyncio
import os
import time
import types
from collections.abc import Callable, Generator

from ..settings.environment import env_knobs

__all__ = ["HANDLE_BYTES", "NotifyPipe", "Polling"]

HANDLE_BYTES = 8  # one finished job's handle in the notify pipe (a uint64; writes this small are atomic)
READ_HANDLES = 4096  # handles taken from the pipe per wake-up of the event loop
MAX_POLL_SKIP = 1024
MAX_POLLERS = 4  # tasks polling for their own jobs at once, per loop (see _ShortWaits)


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
        for handle in memoryview(data)[:whole].cast("Q").tolist():  # (native uint64s, as the helper wrote them)
            self._on_handle(handle)

    def close(self) -> None:
        try:
            if not self.loop.is_closed():
                self.loop.remove_reader(self.read_fd)
        finally:
            os.close(self.read_fd)
            os.close(self.fd)


class Polling:
    """Which jobs of one executor or plane are polled for instead of awaited with the event loop asleep: those
    expected to end within ``AIODATADIST_POLL_US`` (default 300 us; 0: none) at ``rate`` bytes/s, read once, at
    creation.

    A sleeping loop learns of a pipe write only after the kernel woke its thread on another CPU, and that thread
    resumes with cold caches: on a 2-vCPU VM that cost 60-90 us of a 4 KiB one-sided TCP pull (210 -> 140 us when
    polled), more than such a job takes.  A polled job's waiter instead asks the job itself whether it ended
    (:meth:`poll`), once per iteration of the loop, for up to twice the budget: the loop's selector does not block
    meanwhile (its other callbacks and tasks run as usual), and the waiter goes on in the step that finds the job
    ended, with no pipe read or future wake-up in between.  A job is never waited for by polling alone: past the
    window its waiter awaits its future, which the job's announcement settles as always, so a polled job ends
    exactly as an unpolled one, cancellation included."""

    __slots__ = ("budget", "limit")

    def __init__(self, rate: float) -> None:
        self.budget = env_knobs().poll_us * 1e-6  # seconds
        self.limit = rate * self.budget  # bytes

    def polls(self, nbytes: int) -> bool:
        """Whether a job of ``nbytes`` is polled for."""
        return self.budget > 0 and nbytes <= self.limit

    async def poll(self, ended: Callable[[], bool]) -> None:
        """Call ``ended`` (whether the job ended; when it returns True it has settled the job's future) between
        iterations of the running loop until it returns True or the window is over.  The caller awaits the job's
        future next, either way (past the window its announcement settles it).  A cancellation meanwhile
        propagates at once, as from the future: the caller stops the job as usual."""
        waits = _short_waits(asyncio.get_running_loop())
        if not waits.admit():
            return
        until = time.monotonic() + 2 * self.budget
        waits.pollers += 1
        try:
            while not ended():
                if time.monotonic() >= until:
                    waits.overran()
                    return
                await _next_iteration()
            waits.in_time()
        finally:
            waits.pollers -= 1


@types.coroutine
def _next_iteration() -> Generator[None, None, None]:
    """Let the loop run one iteration (what ``asyncio.sleep(0)`` does, one frame less)."""
    yield


class _ShortWaits:
    """One event loop's polled waits: at most :data:`MAX_POLLERS` tasks poll at once (each costs a step of its task
    per iteration; the others' announcements are read at once meanwhile, the selector not blocking).  Where the
    CPUs are busy the polling loop can take the CPU the job's threads need: a wait that outlasts its window
    leaves the next ones unpolled, twice as many each time (up to MAX_POLL_SKIP); one that ends within its window
    resets that."""

    __slots__ = ("_backoff", "_skip", "pollers")

    def __init__(self) -> None:
        self._skip = 0  # waits left to leave unpolled
        self._backoff = 0  # how many the next wait that outlasts its window leaves unpolled
        self.pollers = 0  # tasks in Polling.poll

    def admit(self) -> bool:
        """Whether the next wait is polled for (not while waits are left unpolled after one outlasted its window,
        nor beyond MAX_POLLERS polling tasks)."""
        if self._skip:
            self._skip -= 1
            return False
        return self.pollers < MAX_POLLERS

    def overran(self) -> None:
        """A polled wait outlasted its window: leave the next ones unpolled."""
        self._backoff = min(MAX_POLL_SKIP, max(1, 2 * self._backoff))
        self._skip = self._backoff

    def in_time(self) -> None:
        """A polled wait ended within its window."""
        self._backoff = 0


_by_loop: dict[asyncio.AbstractEventLoop, _ShortWaits] = {}


def _short_waits(loop: asyncio.AbstractEventLoop) -> _ShortWaits:
    waits = _by_loop.get(loop)
    if waits is None:
        for closed in [other for other in list(_by_loop) if other.is_closed()]:  # (a copy: loops of other threads)
            _by_loop.pop(closed, None)
        waits = _by_loop[loop] = _ShortWaits()
    return waits
