"""Test bytes for caches, defined once for the whole suite.

The bytes themselves come from the public :mod:`aiodatadist.testing` helpers (re-exported here, so that tests
import every data helper from this module):

    ``pattern(seed, tensor, nbytes)``  deterministic bytes, never 0.
    ``fill_pattern(cache, seed)``      fill every tensor of a host or device cache; returns flat copies.
    ``tensor_bytes(cache)``            flat host copies of every tensor of a host or device cache.
    ``write_tensor(cache, i, data)``   overwrite one tensor.

Two views per slot (contiguous cache) or per block (blocks cache), for host caches, are added here:

    ``row_views(cache)``        live ``uint8`` views shaped ``(shape[0], bytes per slot/block)``.
    ``fill_rows(cache, seed)``  :func:`fill_pattern`, with the copies shaped like :func:`row_views`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aiodatadist import Cache
from aiodatadist.testing import fill_pattern, pattern, tensor_bytes, write_tensor

__all__ = ["blocks", "fill_pattern", "fill_rows", "pattern", "row_views", "tensor_bytes", "write_tensor"]


def row_views(cache: Cache) -> list[np.ndarray[Any, Any]]:
    """Live ``uint8`` views of a host cache's tensors, shaped ``(shape[0], bytes per slot/block)``.

    Writing into them writes into the cache; use ``.copy()`` (or :func:`tensor_bytes`) for snapshots.
    """
    rows = int(cache.cache_desc.shape[0])
    return [t.reshape(-1).view(np.uint8).reshape(rows, -1) for t in cache.tensors]


def fill_rows(cache: Cache, seed: int) -> list[np.ndarray[Any, Any]]:
    """Fill every tensor of a host cache with :func:`pattern` bytes of ``seed`` (never 0) and return copies
    shaped like :func:`row_views`, so that slot/block ``i`` of tensor ``t`` is ``copies[t][i]``.

    Because no byte is 0, a freshly allocated (zeroed) region can always be told apart from a copied one.
    """
    rows = int(cache.cache_desc.shape[0])
    return [data.reshape(rows, -1) for data in fill_pattern(cache, seed)]


def blocks(cache: Any, indices: list[int]) -> list[np.ndarray[Any, Any]]:
    """Copies of blocks ``indices`` of every tensor of a host blocks cache (``uint8``, one row per block)."""
    return [t.view(np.uint8).reshape(cache.cache_desc.shape[0], -1)[indices].copy() for t in cache.tensors]
