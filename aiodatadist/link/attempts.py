"""Link attempts in progress, one per remote cluster, shared by every caller that asks for that cluster meanwhile.

A router links on demand: many requests for one new peer call ``link_clusters`` at once.  The first call starts
the attempt; the others join it and get its result (``LLM_SUCCESS`` when it linked), never ``LLM_ALREADY_LINK``
for a link that does not exist yet.  The attempt is given up only when every caller waiting for it was cancelled:
it then tears down whatever it built (on both ends) before the last cancelled caller's ``CancelledError``
surfaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from .._aio import wait_through_cancellation
from ..errors import LLMStatusCode

__all__ = ["LinkAttempts"]

S = LLMStatusCode
Spawn = Callable[[Coroutine[Any, Any, LLMStatusCode], str], "asyncio.Task[LLMStatusCode]"]
Undo = Callable[[int], Awaitable[None]]


@dataclass(eq=False)
class _Attempt:
    task: asyncio.Task[LLMStatusCode]
    waiters: int = 0
    delivered: bool = False  # a caller got the result


class LinkAttempts:
    """The link attempts in progress, by remote cluster id (a ``Collection[int]`` of those ids).

    ``spawn(coro, name)`` runs an attempt as a task of the instance (cancelled at ``finalize``); ``undo(cluster)``
    unlinks a link that an attempt made although every caller of it was cancelled (the attempt ended in the same
    loop iteration as their cancellation)."""

    def __init__(self, spawn: Spawn, undo: Undo) -> None:
        self._spawn = spawn
        self._undo = undo
        self._running: dict[int, _Attempt] = {}

    def __contains__(self, cluster: object) -> bool:
        return cluster in self._running

    def __iter__(self) -> Iterator[int]:
        return iter(self._running)

    def __len__(self) -> int:
        return len(self._running)

    async def start(self, cluster: int, attempt: Coroutine[Any, Any, LLMStatusCode]) -> LLMStatusCode:
        """Run ``attempt`` (a link to ``cluster``, bounded by its own timeout) and wait for its code."""
        assert cluster not in self._running
        entry = _Attempt(self._spawn(attempt, f"link-{cluster}"))
        self._running[cluster] = entry
        entry.task.add_done_callback(functools.partial(self._ended, cluster, entry))
        return await self._wait(cluster, entry, None)

    async def join(self, cluster: int, timeout_s: float) -> LLMStatusCode:
        """Wait for the attempt in progress to ``cluster``, at most ``timeout_s`` seconds (then
        ``LLM_LINK_FAILED``; the attempt goes on for its other callers)."""
        return await self._wait(cluster, self._running[cluster], timeout_s)

    def _ended(self, cluster: int, entry: _Attempt, _: object) -> None:
        if self._running.get(cluster) is entry:
            del self._running[cluster]

    async def _wait(self, cluster: int, entry: _Attempt, timeout_s: float | None) -> LLMStatusCode:
        entry.waiters += 1
        counted = True
        try:
            async with asyncio.timeout(timeout_s):
                code = await asyncio.shield(entry.task)
            entry.delivered = True
            return code
        except TimeoutError:
            if entry.task.done() and not entry.task.cancelled() and entry.task.exception() is not None:
                raise  # the attempt itself failed with it (a bug): not this caller's deadline
            return S.LLM_LINK_FAILED  # this caller's own timeout, shorter than the attempt's
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and not current.cancelling():
                return S.LLM_LINK_FAILED  # the attempt was cancelled (finalize), not this caller
            entry.waiters -= 1
            counted = False
            if entry.waiters == 0:
                await self._abandon(cluster, entry)
            raise
        finally:
            if counted:
                entry.waiters -= 1

    async def _abandon(self, cluster: int, entry: _Attempt) -> None:
        """Every caller of ``entry`` was cancelled: stop it and wait until it left nothing behind."""
        if not entry.task.done():
            entry.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await wait_through_cancellation(entry.task)
        elif (not entry.delivered and not entry.task.cancelled() and entry.task.exception() is None
              and entry.task.result() == S.LLM_SUCCESS):
            with contextlib.suppress(Exception):
                await wait_through_cancellation(self._undo(cluster))
