"""The copy executors: span copies on worker threads, in bounded chunks, fairly across transfers.

* :mod:`.spans`: how spans are cut into pieces and chunks, and the copier for a local transfer;
* :mod:`.completion`: the pipe the native helper's threads signal finished jobs through (shared with TCP);
* :mod:`.base`: :class:`~.base.ExecutorBase` and the job contract every executor follows;
* :mod:`.python_pool`: :class:`~.python_pool.CopyExecutor`, Python threads (the fallback);
* :mod:`.native_pool`: :class:`~.native_pool.NativeExecutor`, the compiled helper's threads.

This module picks one (:func:`make_executor`) and holds the one every instance of the process shares
(:func:`shared_executor` / :func:`release_shared_executor`); neither pool imports the other.
"""

from __future__ import annotations

import threading

from .._aio import in_thread
from ..native import native_pool as native_helper  # not `native_pool`: that name is our submodule here
from ..settings.environment import env_knobs
from .native_pool import NativeExecutor
from .python_pool import CopyExecutor

__all__ = ["make_executor", "release_shared_executor", "shared_executor"]


def make_executor() -> CopyExecutor | NativeExecutor:
    """The native executor where the helper is built (unless ``AIODATADIST_EXECUTOR=python``)."""
    if native_helper() is not None and env_knobs().executor != "python":
        return NativeExecutor()
    return CopyExecutor()


_shared: CopyExecutor | NativeExecutor | None = None
_users = 0
_shared_lock = threading.Lock()


def shared_executor() -> CopyExecutor | NativeExecutor:
    """The process-wide executor; each call must be paired with :func:`release_shared_executor`."""
    global _shared, _users
    with _shared_lock:
        if _shared is None:
            _shared = make_executor()
        _users += 1
        return _shared


async def release_shared_executor() -> None:
    """Drop one user; the last one joins the worker threads (in a helper thread, off the event loop)."""
    global _shared, _users
    with _shared_lock:
        _users -= 1
        if _users > 0 or _shared is None:
            return
        executor, _shared = _shared, None
    await in_thread(executor.shutdown)
