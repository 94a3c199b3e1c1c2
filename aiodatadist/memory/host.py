"""``HostMemory``: shareable host memory an engine allocates through aiodatadist for its own KV tensors, or memory it
allocated itself, shared in place.

The memory is a :class:`~aiodatadist.memory.SharedSegment` (``memfd``, on huge pages where the system has them free
(``AIODATADIST_HUGE_PAGES``), pre-faulted), exactly
like an allocated cache's, or an :class:`~aiodatadist.memory.in_place.InPlaceSegment` (:meth:`HostMemory.in_place`).  Caches registered with ``register_cache`` / ``register_blocks_cache`` whose tensors
all lie inside one such block are published like allocated caches: same-host peers map the segment and copy
with their own threads, never through ``process_vm_readv``/``writev`` nor the owner's event loop on repeat
transfers.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from ..errors import LLMException, LLMStatusCode
from .in_place import InPlaceSegment
from .segment import SharedSegment, cache_segment

__all__ = ["HostMemory"]


class HostMemory:
    """Shareable host memory from :meth:`aiodatadist.CacheManager.allocate_host_memory`.

    ``address``/``size`` (at least the requested bytes, whole pages), :meth:`array` (a numpy view, zero-copy),
    :meth:`close` (or use it as a context manager).  Closing while caches are registered inside it raises
    ``LLMException(LLM_PARAM_INVALID)``: unregister them first.  ``finalize`` of the instance closes it.  Views
    handed out earlier keep the pages alive (never a dangling pointer), but the memory is no longer shared.
    """

    def __init__(self, nbytes: int, name: str = "aiodatadist-host", *,
                 segment: SharedSegment | InPlaceSegment | None = None) -> None:
        self._segment: SharedSegment | InPlaceSegment | None = (
            segment if segment is not None else cache_segment(nbytes, name))
        self.address: int = self._segment.address
        self.size: int = self._segment.size
        self._registered: set[object] = set()  # the registry's live entries inside it (owner's event loop only)

    @classmethod
    def in_place(cls, ranges: Sequence[tuple[int, int]], name: str = "aiodatadist-in-place") -> HostMemory:
        """Ranges ``(address, size)`` of memory this process owns, shared where they lie (see
        :mod:`aiodatadist.memory.in_place`)."""
        segment = InPlaceSegment(ranges, name=name)
        return cls(segment.size, name, segment=segment)

    @property
    def is_in_place(self) -> bool:
        """True for memory the process allocated itself, shared in place (:meth:`in_place`)."""
        return isinstance(self._segment, InPlaceSegment)

    @property
    def closed(self) -> bool:
        return self._segment is None

    @property
    def segment(self) -> SharedSegment | InPlaceSegment:
        if self._segment is None:
            raise LLMException("the host memory is closed", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        return self._segment

    @property
    def registrations(self) -> int:
        """How many live registered caches lie inside this memory."""
        return len(self._registered)

    def contains(self, addrs: npt.NDArray[np.uint64] | list[int], tensor_size: int) -> bool:
        """Whether every ``[addr, addr + tensor_size)`` lies inside this (open) memory."""
        if self._segment is None or len(addrs) == 0:
            return False
        values = np.asarray(addrs, dtype=np.uint64)
        if isinstance(self._segment, InPlaceSegment):
            return self._segment.contains(values, tensor_size)
        low, high = int(values.min()), int(values.max()) + int(tensor_size)
        return self.address <= low and high <= self.address + self.size

    def window(self, addrs: npt.NDArray[np.uint64], tensor_size: int) -> tuple[int, int] | None:
        """The bytes ``[low, high)`` of each tensor (all inside this memory) that peers reach through the segment:
        None for all of them; memory shared in place leaves out the partial pages at its ranges' ends."""
        if isinstance(self._segment, InPlaceSegment):
            return self._segment.window(addrs, tensor_size)
        return None

    def array(self, dtype: Any = np.uint8) -> np.ndarray:
        """A zero-copy numpy view of the whole memory as ``dtype`` (its size must divide ``size``); memory shared in
        place has none (``LLM_PARAM_INVALID``)."""
        return self.segment.array().view(dtype)

    def close(self) -> None:
        """Release the memory (idempotent); raises ``LLM_PARAM_INVALID`` while caches are registered in it."""
        if self._segment is None:
            return
        if self._registered:
            raise LLMException(f"{len(self._registered)} cache(s) are still registered in this host memory: "
                               "unregister them before closing it", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        segment, self._segment = self._segment, None
        segment.close()

    def _force_close(self) -> None:
        """``finalize``: every registration is gone already."""
        self._registered.clear()
        self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.registrations} registered"
        return f"HostMemory(address={self.address:#x}, size={self.size}, {state})"
