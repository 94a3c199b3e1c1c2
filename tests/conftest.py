"""Shared fixtures and helpers for the aiodatadist test suite.

Fixtures
    ``datadist``       an initialized ``LLMDataDist(LLMRole.PROMPT, <unique id>)``, finalized afterwards.
    ``cache_manager``  the ``CacheManager`` of ``datadist``.

Helpers (import them with ``from conftest import ...``)
    ``fill_random(cache, seed)``  fill every tensor of a host cache with random non-zero bytes.
    ``tensor_bytes(cache)``       live ``uint8`` views of a host cache, ``(shape[0], slot_bytes)`` per tensor.
    ``next_cluster_id()``         a cluster id not used by any other test in this process.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from aiodatadist import Cache, CacheManager, LLMConfig, LLMDataDist, LLMRole

_cluster_ids = itertools.count(10_000 + (os.getpid() % 10_000) * 1_000)


def next_cluster_id() -> int:
    """A cluster id that no other ``datadist`` in this test process has used."""
    return next(_cluster_ids)


def tensor_bytes(cache: Cache) -> list[np.ndarray[Any, Any]]:
    """Live ``uint8`` views of a host cache's tensors, shaped ``(shape[0], bytes per slot/block)``.

    Writing into them writes into the cache; use ``.copy()`` for snapshots.
    """
    rows = int(cache.cache_desc.shape[0])
    return [t.reshape(-1).view(np.uint8).reshape(rows, -1) for t in cache.tensors]


def fill_random(cache: Cache, seed: int) -> list[np.ndarray[Any, Any]]:
    """Fill every tensor of a host cache with random bytes in ``1..255`` (never 0) and return copies.

    The copies are ``uint8`` arrays shaped like :func:`tensor_bytes` (``(shape[0], bytes per slot/block)``),
    so slot/block ``i`` of tensor ``t`` is ``copies[t][i]``.  Because no byte is 0, a freshly allocated
    (zeroed) region can always be told apart from a copied one.
    """
    rng = np.random.default_rng(seed)
    copies = []
    for view in tensor_bytes(cache):
        view[...] = rng.integers(1, 256, size=view.shape, dtype=np.uint8)
        copies.append(view.copy())
    return copies


@pytest.fixture
async def datadist() -> AsyncIterator[LLMDataDist]:
    """An initialized PROMPT instance with a unique cluster id; finalized after the test."""
    dd = LLMDataDist(LLMRole.PROMPT, next_cluster_id())
    await dd.init(LLMConfig().generate_options())
    try:
        yield dd
    finally:
        await dd.finalize()


@pytest.fixture
def cache_manager(datadist: LLMDataDist) -> CacheManager:
    """The cache manager of the ``datadist`` fixture."""
    return datadist.cache_manager
