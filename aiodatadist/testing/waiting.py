"""Waiting for a fault's effect instead of sleeping: :func:`wait_until` (any condition, with a timeout),
:func:`wait_unlinked` and :func:`wait_linked` (an instance's link table).

A test that kills a prompt, cuts its connections or stops it learns when the decoder has noticed by waiting for
the link to leave ``dd.links()``; ``FaultInjector.taken_effect(decoder)`` is :func:`wait_unlinked` for the
injector's server.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

if TYPE_CHECKING:
    from ..datadist import LLMDataDist
    from ..errors import LinkDropReason

__all__ = ["DEFAULT_TIMEOUT_S", "wait_linked", "wait_unlinked", "wait_until"]

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 10.0
"""How long the helpers wait by default: above the ~6 s a decoder takes to drop the link to a peer that went
silent (1 s heartbeats, 5 s timeout), so that a stopped or stalled peer is noticed within it."""


@overload
async def wait_until(predicate: Callable[[], Awaitable[T | None]], timeout: float = ..., *, interval: float = ...,
                     what: str | None = ...) -> T: ...


@overload
async def wait_until(predicate: Callable[[], T | None], timeout: float = ..., *, interval: float = ...,
                     what: str | None = ...) -> T: ...


async def wait_until(predicate: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT_S, *,
                     interval: float = 0.01, what: str | None = None) -> Any:
    """Call ``predicate`` (a function, or an async function: its result is awaited) until it returns something
    true, and return that; it is called at once, then every ``interval`` seconds, letting the event loop run in
    between.  ``TimeoutError`` (naming ``what``, or the predicate) when ``timeout`` seconds passed first, also
    while an async predicate still runs; an exception of the predicate propagates."""
    if not timeout > 0 or not interval > 0:
        raise ValueError(f"timeout and interval must be > 0 seconds, not {timeout!r} and {interval!r}")
    try:
        async with asyncio.timeout(timeout):
            while True:
                result = predicate()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return result
                await asyncio.sleep(interval)
    except TimeoutError:
        name = what or getattr(predicate, "__qualname__", repr(predicate))
        raise TimeoutError(f"wait_until: {name} not true within {timeout:g} s") from None


def _linked(dd: LLMDataDist, cluster_id: int) -> bool:
    return any(link.get("remote_cluster_id") == cluster_id for link in dd.links())


async def wait_unlinked(dd: LLMDataDist, cluster_id: int,
                        timeout: float = DEFAULT_TIMEOUT_S) -> LinkDropReason | None:
    """Return once ``dd`` has no link to ``cluster_id`` (at once if it has none): the link dropped (its peer
    died, went silent, or a connection of it was cut) or was unlinked.  Returns why the link went away
    (:class:`~aiodatadist.errors.LinkDropReason`, as later calls to that cluster raise it), or None when the
    instance does not know (it never linked to that cluster, or it is linked again already).  Call it on
    ``dd``'s event loop; ``TimeoutError`` after ``timeout`` seconds."""
    await wait_until(lambda: not _linked(dd, cluster_id), timeout,
                     what=f"{dd!r} dropping its link to cluster {cluster_id}")
    return await _drop_reason(dd, cluster_id)


async def _drop_reason(dd: LLMDataDist, cluster_id: int) -> LinkDropReason | None:
    from ..errors import LLMException, LLMLinkError

    if _linked(dd, cluster_id):
        return None
    try:
        # Not linked: raises at once what a call to that cluster raises now (once the drop's reason is known).
        await dd.check_link_status(cluster_id)
    except LLMLinkError as exc:
        return exc.reason
    except LLMException:
        return None
    return None


async def wait_linked(dd: LLMDataDist, cluster_id: int, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Return ``dd``'s link to ``cluster_id`` (its entry of ``dd.links()``) once it has one: for code under test
    that links in the background.  Call it on ``dd``'s event loop; ``TimeoutError`` after ``timeout``
    seconds."""

    def link() -> dict[str, Any] | None:
        return next((dict(entry) for entry in dd.links() if entry.get("remote_cluster_id") == cluster_id), None)

    return await wait_until(link, timeout, what=f"{dd!r} linked to cluster {cluster_id}")
