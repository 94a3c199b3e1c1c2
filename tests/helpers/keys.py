"""Owner-side key resolution as a peer's BEGIN does it, for tests that look a user key up in a registry."""

from __future__ import annotations

from aiodatadist.registry.caches import CacheEntry, CacheRegistry
from aiodatadist.types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex


def resolve(registry: CacheRegistry, key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey) -> tuple[CacheEntry, int]:
    """``(entry, batch slot)`` that ``key`` names on this owner right now (``LLM_KV_CACHE_NOT_EXIST`` if none)."""
    if isinstance(key, CacheKeyByIdAndIndex):
        return registry.resolve_wire("id", key.cache_id, key.batch_index)
    if isinstance(key, BlocksCacheKey):
        return registry.resolve_wire("blocks", key.model_id, 0)
    return registry.resolve_wire(*key.index_key())
