"""``Cache``: the handle of an allocated or registered cache."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import numpy as np

from ._checks import check_int_list, check_isinstance, require
from .errors import LLMException, LLMStatusCode
from .types import CacheDesc, Placement

if TYPE_CHECKING:
    from .memory import SharedSegment

__all__ = ["Cache"]


class Cache:
    """A cache known to a :class:`CacheManager` (users get it from allocate/register calls).

    After ``deallocate_*``/``unregister_cache`` the handle is invalid: ``tensor_addrs`` is ``[]`` and
    ``tensors`` raises ``LLM_KV_CACHE_NOT_EXIST``.
    """

    __slots__ = ("_cache_desc", "_cache_id", "_is_blocks_cache", "_owner", "_segment", "_tensor_addrs")

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        tensor_addrs: list[int],
        is_blocks_cache: bool,
        *,
        segment: SharedSegment | None = None,
        owner: object | None = None,
    ) -> None:
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = list(tensor_addrs)
        self._is_blocks_cache = is_blocks_cache
        self._segment = segment  # the shared memory of an allocated host cache
        self._owner = owner

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int]) -> Cache:
        """A host blocks cache over caller-owned memory, for ``swap_blocks`` (``cache_id`` is -1)."""
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        addr_list = check_int_list("addrs", addrs, "uint64")
        require(cache_desc.placement == Placement.HOST, "create_cpu_cache requires placement HOST.")
        require(len(addr_list) == cache_desc.num_tensors,
                f"len(addrs) {len(addr_list)} != num_tensors {cache_desc.num_tensors}.")
        require(all(a != 0 for a in addr_list), "addrs must not contain 0.")
        return cls(-1, cache_desc.copy(), addr_list, True)

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        return self._cache_desc

    @property
    def tensor_addrs(self) -> list[int]:
        return list(self._tensor_addrs)

    @property
    def is_blocks_cache(self) -> bool:
        return self._is_blocks_cache

    @property
    def tensors(self) -> list[np.ndarray[Any, Any]]:
        """Numpy views of a host cache's tensors (``cache_desc.shape``, ``data_type.np_dtype``)."""
        if not self._tensor_addrs:
            raise LLMException(f"cache {self._cache_id} was released", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        desc = self._cache_desc
        if desc.placement != Placement.HOST:
            raise LLMException("tensors are only available for HOST caches",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        shape = tuple(int(d) for d in desc.shape)
        dtype = desc.data_type.np_dtype
        if self._segment is not None:
            whole, base = self._segment.array(), self._segment.address
            return [
                whole[a - base: a - base + desc.size]
                .view(dtype).reshape(shape)
                for a in self._tensor_addrs
            ]
        return [
            np.frombuffer(memoryview((ctypes.c_char * desc.size).from_address(a)).cast("B"),
                          dtype=dtype).reshape(shape)
            for a in self._tensor_addrs
        ]

    def _invalidate(self) -> None:
        self._tensor_addrs = []
        self._segment = None

    def __repr__(self) -> str:
        return (f"Cache(cache_id={self._cache_id}, is_blocks_cache={self._is_blocks_cache}, "
                f"cache_desc={self._cache_desc!r})")
