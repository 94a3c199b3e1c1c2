"""Generic asyncio helpers of the package (a leaf: it imports nothing of the package).

* :func:`settle`: settle a job's future from its outcome, once (a late or repeated completion is a no-op);
* :func:`in_thread`: ``asyncio.to_thread``, or the call itself while the interpreter is exiting (:func:`exiting`:
  from Python 3.12 it refuses to start a thread in exit hooks too, where unfinalized instances are finalized);
* :func:`drop_cancellation`: a done callback for long-lived tasks: a cancelled one lets go of its
  ``CancelledError`` (and so of the frames of whoever cancelled it);
* :func:`wait_through_cancellation`: await something to its end even if the caller is cancelled meanwhile,
  then re-raise the cancellation.  Used where the end means "no thread touches this memory any more" (or "the
  peer confirmed that"): returning earlier would let a cancelled caller free or reuse memory that is still
  written to.  ``anyio.CancelScope(shield=True)`` cannot do this: it shields only from anyio's own cancel
  scopes, not from ``asyncio.timeout`` or ``Task.cancel()``, which is how our callers cancel (see
  ``docs/design.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["drop_cancellation", "exiting", "in_thread", "settle", "wait_through_cancellation"]

T = TypeVar("T")


def settle(future: asyncio.Future[None], error: BaseException | None = None) -> None:
    """Finish ``future`` with ``error`` (or with success) unless it is done already (e.g. its waiter was
    cancelled, which cancels the future it awaited)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)


def drop_cancellation(task: asyncio.Future[Any]) -> None:
    """Done callback: a cancelled task keeps the ``CancelledError`` it ended with until someone asks for it, and
    with it its traceback's frames, those of whoever cancelled it (``asyncio.run``'s cancel-all holds every task
    of the loop): anything that keeps the task would keep all of that alive.  Asking for it hands it over."""
    if task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            task.result()


def exiting() -> bool:
    """Whether the interpreter is shutting down its threads (exit hooks run then): from Python 3.12 it refuses to
    start a thread at that point, and an executor's ``submit`` that fails to start its worker has already queued
    the call, which a worker may run later (twice, with a fallback): so ask first."""
    return bool(getattr(threading, "_SHUTTING_DOWN", False)) or sys.is_finalizing()


async def in_thread(fn: Callable[..., T], /, *args: Any) -> T:
    """``await asyncio.to_thread(fn, *args)``; while the interpreter is exiting (:func:`exiting`), ``fn`` runs here
    instead, blocking the loop: the process is then finalizing what is left, and nothing else waits on the loop."""
    if exiting():
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


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
