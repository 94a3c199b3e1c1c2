"""``LLMDataDist``: one instance of the KV-cache transfer service (a cluster), asyncio-native."""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

from ._checks import check_int, check_isinstance
from .cache_manager import CacheManager
from .errors import LLMNotInitializedError
from .executor import release_shared_executor, shared_executor
from .options import Settings, parse_options
from .types import LLMRole

__all__ = ["LLMDataDist"]

log = logging.getLogger("aiodatadist.datadist")


class LLMDataDist:
    """A cluster: owns its caches, its links and its background tasks.

    Several instances may live in one process and one event loop.  ``async with LLMDataDist(role, id) as dd``
    finalizes on exit; call ``await dd.init(options)`` inside.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_isinstance("role", role, LLMRole)
        self._role = role
        self._cluster_id = check_int("cluster_id", cluster_id, "uint64")
        self._settings: Settings | None = None
        self._cache_manager: CacheManager | None = None

    # -- properties ------------------------------------------------------------------------------------------
    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def role(self) -> LLMRole:
        return self._role

    @property
    def is_initialized(self) -> bool:
        return self._settings is not None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            raise LLMNotInitializedError()
        return self._settings

    @property
    def cache_manager(self) -> CacheManager:
        """The :class:`CacheManager` of this instance (requires ``init``)."""
        if self._cache_manager is None:
            raise LLMNotInitializedError()
        return self._cache_manager

    # -- lifetime --------------------------------------------------------------------------------------------
    async def init(self, options: dict[str, str]) -> None:
        """Initialize from an option dict (see :meth:`LLMConfig.generate_options`); a second call is a no-op."""
        if self._settings is not None:
            return
        settings = parse_options(options)
        executor = shared_executor()
        try:
            self._cache_manager = CacheManager(self, executor)
        except BaseException:
            release_shared_executor()
            raise
        self._settings = settings
        log.debug("cluster %d initialized as %s", self._cluster_id, self._role)

    async def finalize(self) -> None:
        """Stop transfers, release every cache and the worker threads; a no-op when not initialized."""
        if self._settings is None:
            return
        manager, self._cache_manager = self._cache_manager, None
        self._settings = None
        try:
            if manager is not None:
                await manager.close()
        finally:
            release_shared_executor()
        log.debug("cluster %d finalized", self._cluster_id)

    async def __aenter__(self) -> LLMDataDist:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.finalize()

    def __repr__(self) -> str:
        state = "initialized" if self.is_initialized else "not initialized"
        return f"LLMDataDist(role={self._role}, cluster_id={self._cluster_id}, {state})"

    def _describe(self) -> dict[str, Any]:
        return {"cluster_id": self._cluster_id, "role": str(self._role)}
