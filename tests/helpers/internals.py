"""The tests' seam into a :class:`~aiodatadist.CacheManager`'s internals.

The cache manager keeps its registry, copy engine and GPU private: no public name exposes them.  Tests that look
at the bookkeeping (entries, leases, segments) or replace the copy executor reach them through these functions
only, so that a change inside the package is followed here once, not in every test.
"""

from __future__ import annotations

from aiodatadist.cache_manager import CacheManager
from aiodatadist.copy.device import DeviceSupport
from aiodatadist.copy.engine import CopyEngine
from aiodatadist.registry.caches import CacheRegistry

__all__ = ["device_of", "engine_of", "registry_of"]


def registry_of(cm: CacheManager) -> CacheRegistry:
    """The caches of ``cm``: entries by id and key, their leases, jobs and segments."""
    return cm._registry


def engine_of(cm: CacheManager) -> CopyEngine:
    """The copy engine of ``cm`` (its job table and the host executor, ``_executor``)."""
    return cm._engine


def device_of(cm: CacheManager) -> DeviceSupport:
    """The GPU of ``cm`` (``device_id``), set up on first use (``LLM_FEATURE_NOT_ENABLED`` without CUDA)."""
    return cm._device()
