"""Test bytes: deterministic random patterns, and reading or writing the tensors of a host or device cache.

``pattern(seed, t, nbytes)`` is what ``fill_pattern(cache, seed)`` writes into tensor ``t``, here or in a peer
process (``PromptServer.fill``), so a test knows the bytes a transfer must deliver without moving them;
``assert_blocks_landed`` checks that they arrived, naming the first byte that did not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..cache import Cache
from ..errors import LLMException, LLMStatusCode
from ..types import Placement

__all__ = ["ExpectedBytes", "assert_blocks_landed", "block_rows", "fill_pattern", "pattern", "tensor_bytes",
           "write_tensor"]


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
    return owner._device().runtime


def write_tensor(cache: Cache, index: int, data: np.ndarray) -> None:
    """Overwrite tensor ``index`` of a cache (host or device) with ``data`` (its bytes, ``cache_desc.size``)."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.nbytes != cache.cache_desc.size:
        raise ValueError(f"{raw.nbytes} bytes for a tensor of {cache.cache_desc.size}")
    if cache.cache_desc.placement == Placement.DEVICE:
        _device_of(cache).copy_to_device(cache.tensor_addrs[index], raw.ctypes.data, raw.nbytes)
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
        device.copy_to_host(buf.ctypes.data, addr, size)
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


@runtime_checkable
class ExpectedBytes(Protocol):
    """A source that knows its blocks' bytes, such as a :class:`~aiodatadist.testing.PromptServer`."""

    def expected(self, name: str = ..., blocks: Sequence[int] | None = ...) -> list[np.ndarray]:
        """Rows ``blocks`` of each tensor of cache ``name``: one ``(len(blocks), block bytes)`` array each."""
        ...


def _rows_of(cache: Cache, blocks: Sequence[int], what: str) -> list[np.ndarray]:
    """Rows ``blocks`` of each tensor of ``cache`` (host: read through ``cache.tensors``; device: copied)."""
    rows = int(cache.cache_desc.shape[0])
    index = np.asarray([int(b) for b in blocks], dtype=np.int64)
    wrong = [int(b) for b in index if not 0 <= b < rows]
    if wrong:
        raise ValueError(f"{what} {wrong} are outside the cache's {rows} blocks")
    flats = tensor_bytes(cache) if cache.cache_desc.placement == Placement.DEVICE else \
        [t.view(np.uint8).reshape(-1) for t in cache.tensors]
    return [flat.reshape(rows, -1)[index] for flat in flats]


def assert_blocks_landed(cache: Cache, blocks: Sequence[int],
                         source: Cache | ExpectedBytes | Sequence[np.ndarray],
                         source_blocks: Sequence[int] | None = None, *, name: str = "kv") -> None:
    """Assert that blocks ``blocks`` of ``cache`` hold exactly the source's blocks, byte for byte, in every
    tensor (a block is one of the ``cache_desc.shape[0]`` rows of each tensor: a block of a blocks cache, a
    slot of a contiguous one).  The source is

    * another :class:`~aiodatadist.Cache` (host or device), its blocks ``source_blocks``;
    * a :class:`~aiodatadist.testing.PromptServer` (anything with ``expected(name, blocks)``), its cache
      ``name``'s blocks ``source_blocks``: the bytes it was filled with;
    * the expected rows themselves, one ``(len(blocks), block bytes)`` array per tensor (then no
      ``source_blocks``).

    ``source_blocks`` defaults to ``blocks``.  ``AssertionError`` names the first block (in the order of
    ``blocks``), the first tensor of it and the first byte offset that differ, with both bytes, and how many
    blocks differ; ``ValueError`` when ``blocks`` is empty, the two sides do not have the same shape (tensors,
    blocks, block bytes) or a block index is out of range.
    """
    blocks = [int(b) for b in blocks]
    if not blocks:
        raise ValueError("no blocks to compare")
    have = _rows_of(cache, blocks, "blocks")
    want, origin = _source_rows(source, blocks, source_blocks, name)
    if len(want) != len(have):
        raise ValueError(f"the cache has {len(have)} tensors, the source {len(want)}")
    for t, (h, w) in enumerate(zip(have, want, strict=True)):
        if h.shape != w.shape:
            raise ValueError(f"tensor {t}: {h.shape[0]} blocks of {h.shape[1]} bytes here, {w.shape[0]} of "
                             f"{w.shape[1]} in the source")
    differ = [h != w for h, w in zip(have, want, strict=True)]
    bad = np.array([d.any(axis=1) for d in differ])  # (tensors, blocks): that block of that tensor differs
    if bad.any():
        raise AssertionError(_difference(blocks, origin, have, want, differ, bad))


def _source_rows(source: Cache | ExpectedBytes | Sequence[np.ndarray], blocks: list[int],
                 source_blocks: Sequence[int] | None, name: str) -> tuple[list[np.ndarray], list[str]]:
    """The source's rows (one ``(len(blocks), block bytes)`` ``uint8`` array per tensor), and where each row
    comes from, for the message."""
    if isinstance(source, (Cache, ExpectedBytes)):
        src_blocks = blocks if source_blocks is None else [int(b) for b in source_blocks]
        if len(src_blocks) != len(blocks):
            raise ValueError(f"{len(blocks)} blocks and {len(src_blocks)} source_blocks")
        rows = _rows_of(source, src_blocks, "source_blocks") if isinstance(source, Cache) \
            else source.expected(name, src_blocks)
        origin = [f"source block {b}" for b in src_blocks]
    else:
        if source_blocks is not None:
            raise ValueError("source_blocks goes with a source cache or server, not with the expected rows")
        rows = list(source)
        origin = [f"row {i} of the expected rows" for i in range(len(blocks))]
    return [np.ascontiguousarray(r).view(np.uint8).reshape(len(blocks), -1) for r in rows], origin


def _difference(blocks: list[int], origin: list[str], have: list[np.ndarray], want: list[np.ndarray],
                differ: list[np.ndarray], bad: np.ndarray) -> str:
    """The message of :func:`assert_blocks_landed`: the first byte that differs, and how many blocks do."""
    per_block = bad.any(axis=0)
    i = int(np.argmax(per_block))  # the first block (in the order given) where a tensor differs
    t = int(np.argmax(bad[:, i]))  # its first tensor that differs
    offset = int(np.argmax(differ[t][i]))
    row_bytes = int(have[t].shape[1])
    return (f"blocks did not land: block {blocks[i]} ({origin[i]}) of tensor {t} differs at byte offset {offset} "
            f"of the block (offset {blocks[i] * row_bytes + offset} of the tensor): "
            f"0x{int(have[t][i, offset]):02x}, expected 0x{int(want[t][i, offset]):02x} "
            f"({int(differ[t][i].sum())} of {row_bytes} bytes of that block differ); "
            f"{int(per_block.sum())} of {len(blocks)} blocks differ, in {int(bad.any(axis=1).sum())} of "
            f"{len(have)} tensors")
