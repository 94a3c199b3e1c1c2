"""Test bytes: deterministic random patterns, and reading or writing the tensors of a host or device cache.

``pattern(seed, t, nbytes)`` is what ``fill_pattern(cache, seed)`` writes into tensor ``t``, here or in a peer
process (``PromptServer.fill``), so a test knows the bytes a transfer must deliver without moving them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cache import Cache
from ..errors import LLMException, LLMStatusCode
from ..types import Placement

__all__ = ["block_rows", "fill_pattern", "pattern", "tensor_bytes", "write_tensor"]


def pattern(seed: int, tensor_index: int, nbytes: int) -> np.ndarray:
    """Deterministic random test bytes (never 0) for tensor ``tensor_index`` of a cache filled with ``seed``."""
    # The generator's raw 64-bit words, zeros made ones: four times faster than ``integers(1, 256)`` (tests fill
    # hundreds of MiB this way).
    words = np.random.default_rng([seed, tensor_index]).bit_generator.random_raw(-(-nbytes // 8))
    data = words.view(np.uint8)[:nbytes]
    np.maximum(data, 1, out=data)
    return data


def fill_pattern(cache: Cache, seed: int) -> list[np.ndarray]:
    """Fill every tensor of a cache (host or device) with :func:`pattern` bytes; returns the bytes per tensor."""
    out = [pattern(seed, t, cache.cache_desc.size) for t in range(cache.cache_desc.num_tensors)]
    for t, data in enumerate(out):
        write_tensor(cache, t, data)
    return out


def _device_of(cache: Cache) -> Any:
    owner = cache._owner
    if owner is None or not hasattr(owner, "_device"):
        raise LLMException("not a cache of a CacheManager", status_code=LLMStatusCode.LLM_PARAM_INVALID)
    return owner._device().device


def write_tensor(cache: Cache, index: int, data: np.ndarray) -> None:
    """Overwrite tensor ``index`` of a cache (host or device) with ``data`` (its bytes, ``cache_desc.size``)."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.nbytes != cache.cache_desc.size:
        raise ValueError(f"{raw.nbytes} bytes for a tensor of {cache.cache_desc.size}")
    if cache.cache_desc.placement == Placement.DEVICE:
        _device_of(cache).copy_htod(cache.tensor_addrs[index], raw.ctypes.data, raw.nbytes)
    else:
        cache.tensors[index].view(np.uint8).reshape(-1)[:] = raw


def tensor_bytes(cache: Cache) -> list[np.ndarray]:
    """A host copy of every tensor's bytes (flat ``uint8``), for a host or a device cache."""
    if cache.cache_desc.placement != Placement.DEVICE:
        return [t.view(np.uint8).reshape(-1).copy() for t in cache.tensors]
    device, size = _device_of(cache), cache.cache_desc.size
    out = []
    for addr in cache.tensor_addrs:
        buf = np.empty(size, dtype=np.uint8)
        device.copy_dtoh(buf.ctypes.data, addr, size)
        out.append(buf)
    return out


def block_rows(tensors: Sequence[np.ndarray], rows: int, blocks: Sequence[int]) -> list[np.ndarray]:
    """Rows ``blocks`` of each flat tensor cut into ``rows`` rows (blocks of a blocks cache, slots of a
    contiguous one): one ``(len(blocks), bytes per row)`` ``uint8`` copy per tensor.

    ``block_rows(tensor_bytes(cache), cache.cache_desc.shape[0], dst_blocks)`` is what a pull wrote into
    ``dst_blocks``; compare it with ``PromptServer.expected(name, src_blocks)``.
    """
    index = np.asarray(list(blocks), dtype=np.int64)
    return [np.asarray(t).view(np.uint8).reshape(rows, -1)[index].copy() for t in tensors]
