"""Value types of layer-wise transfer and of the two-sided link: ``LayerSynchronizer``, ``TransferConfig``,
``TransferWithCacheKeyConfig``, ``MemInfo``, ``Memtype``, ``RegisterMemStatus``, as in LLM-DataDist.

The checks and messages are LLM-DataDist's: ``TypeError`` for a wrong type, ``LLM_PARAM_INVALID`` for a wrong
value."""

from __future__ import annotations

import abc
from enum import IntEnum

from ._checks import check_int, check_int_list, check_isinstance, check_layer_range, require
from .types import BlocksCacheKey, CacheKeyByIdAndIndex

__all__ = [
    "LayerSynchronizer",
    "MemInfo",
    "Memtype",
    "RegisterMemStatus",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
]


class Memtype(IntEnum):
    """Where a registered memory region lies (:class:`MemInfo`)."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class RegisterMemStatus(IntEnum):
    """State of a two-sided link (``query_register_mem_status``)."""

    OK = 0
    PREPARING = 1
    FAILED = 2


class MemInfo:
    """A registered memory region: ``MemInfo(mem_type, addr, size)`` (for ``remap_registered_memory``)."""

    __slots__ = ("_addr", "_mem_type", "_size")

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_isinstance("mem_type", mem_type, Memtype)
        self._mem_type = mem_type
        self._addr = check_int("addr", addr, "uint64")
        self._size = check_int("size", size, "uint64")

    @property
    def mem_type(self) -> Memtype:
        return self._mem_type

    @property
    def addr(self) -> int:
        return self._addr

    @property
    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"MemInfo(mem_type={self._mem_type.name}, addr={self._addr:#x}, size={self._size})"


class LayerSynchronizer(abc.ABC):
    """Says when a layer's KV is ready to be sent (implemented by the caller of ``transfer_cache_async``).

    ``synchronize_layer(layer_index, timeout_in_millis)`` blocks until layer ``layer_index`` is computed (an
    event's ``wait()``, say) and returns True, or False on failure.  It is called from a worker thread, never on
    the event loop, once per layer in order; ``timeout_in_millis`` is always None (as in the reference)."""

    @abc.abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Block until layer ``layer_index`` may be sent; False fails the layers' transfers."""


class TransferConfig:
    """A destination of ``transfer_cache_async`` named by raw addresses (the reference's non-remote-accessible
    form): ``dst_cluster_id``, ``dst_addrs`` (two per layer sent), ``src_layer_range``, ``src_batch_index``.

    ``transfer_cache_async`` asks the destination's owner which of its registered, remote-accessible caches
    the addresses are (K and V of consecutive layers at one slot) and sends there; an address in no such cache
    fails the job (a peer never writes raw memory here)."""

    def __init__(self, dst_cluster_id: int, dst_addrs: list[int] | tuple[int, ...],
                 src_layer_range: range | None = None, src_batch_index: int = 0) -> None:
        self._dst_cluster_id = check_int("dst_cluster_id", dst_cluster_id, "uint64")
        self._dst_addrs = check_int_list("dst_addrs", dst_addrs, "uint64")
        self._src_layer_range = check_layer_range("src_layer_range", src_layer_range, allow_empty=False)
        self._src_batch_index = check_int("src_batch_index", src_batch_index, "uint32")
        self.dst_layer_range: range | None = None

    @property
    def dst_cluster_id(self) -> int:
        return self._dst_cluster_id

    @property
    def dst_addrs(self) -> list[int]:
        return list(self._dst_addrs)

    @property
    def src_layer_range(self) -> range | None:
        return self._src_layer_range

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index


class TransferWithCacheKeyConfig:
    """A destination of ``transfer_cache_async`` named by a cache key: a ``BlocksCacheKey`` (a remote blocks
    cache) or a ``CacheKeyByIdAndIndex`` (a slot of a remote contiguous cache), and the source layers
    ``src_layer_range`` sent to its layers ``dst_layer_range`` (both required, same length)."""

    def __init__(self, cache_key: BlocksCacheKey | CacheKeyByIdAndIndex, src_layer_range: range | None = None,
                 dst_layer_range: range | None = None, src_batch_index: int = 0) -> None:
        check_isinstance("cache_key", cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex))
        src = check_layer_range("src_layer_range", src_layer_range, allow_empty=False)
        dst = check_layer_range("dst_layer_range", dst_layer_range, allow_empty=False)
        require(src is not None, "src_layer_range is required.")
        require(dst is not None, "dst_layer_range is required.")
        assert src is not None and dst is not None
        require(len(src) == len(dst), f"src_layer_range {src} and dst_layer_range {dst} must have the same length.")
        batch = check_int("src_batch_index", src_batch_index, "uint32")
        require(batch == 0 or not isinstance(cache_key, BlocksCacheKey),
                "src_batch_index must be 0 when cache_key is a BlocksCacheKey.")
        self._cache_key = cache_key
        self._src_layer_range: range = src
        self._dst_layer_range: range = dst
        self._src_batch_index = batch

    @property
    def cache_key(self) -> BlocksCacheKey | CacheKeyByIdAndIndex:
        return self._cache_key

    @property
    def dst_cluster_id(self) -> int:
        return self._cache_key.cluster_id

    @property
    def src_layer_range(self) -> range:
        return self._src_layer_range

    @property
    def dst_layer_range(self) -> range:
        return self._dst_layer_range

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    def dst_layer_of(self, src_layer: int) -> int:
        """The destination layer that source layer ``src_layer`` (inside ``src_layer_range``) goes to."""
        return self._dst_layer_range.start + (src_layer - self._src_layer_range.start)

    def __repr__(self) -> str:
        return (f"TransferWithCacheKeyConfig({self._cache_key!r}, src_layer_range={self._src_layer_range}, "
                f"dst_layer_range={self._dst_layer_range}, src_batch_index={self._src_batch_index})")
