"""``Opening``: what ``start()`` of a test resource returns, to be awaited or used with ``async with``.

``server = await PromptServer.start()`` gives the resource (the caller closes it);
``async with PromptServer.start() as server`` closes it on exit too (``aiohttp``'s request context manager does
the same).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Generator
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Closable", "Opening"]


class Closable(Protocol):
    async def close(self) -> None: ...


R = TypeVar("R", bound=Closable)


class Opening(Awaitable[R], Generic[R]):
    """Await it for the resource, or ``async with`` it (the resource is closed on exit)."""

    def __init__(self, open_: Callable[[], Coroutine[Any, Any, R]]) -> None:
        self._open = open_
        self._resource: R | None = None

    def __await__(self) -> Generator[Any, None, R]:
        return self._open().__await__()

    async def __aenter__(self) -> R:
        self._resource = await self._open()
        return self._resource

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        resource, self._resource = self._resource, None
        if resource is not None:
            await resource.close()
