"""Owner-side key resolution as a peer's BEGIN does it, for tests that look a user key up in a registry."""

from __future__ import annotations

from aiodatadist.registry.caches import CacheEntry, CacheRegistry
from aiodatadist.transfer.requester import wire_key
from aiodatadist.types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex


def resolve(registry: CacheRegistry, key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey) -> tuple[CacheEntry, int]:
    """``(entry, batch slot)`` that ``key`` names on this owner right now (``LLM_KV_CACHE_NOT_EXIST`` if none):
    the key as the requester sends it (``wire_key``), resolved as the owner resolves it."""
    return registry.resolve_wire(*wire_key(key))
