"""Host memory a process already owns (an engine's KV tensors), made shareable where it lies.

Same-host peers reach shared memory with a plain ``memcpy``; memory that is only the process's own (anonymous
pages from ``malloc``) they can reach only through ``process_vm_readv``/``writev``, which costs about twice as
much on the copies of a KV transfer (pinning the peer's pages on every call).  :class:`InPlaceSegment` turns such
memory into shared memory without moving it: the whole pages inside each range are copied into a ``memfd`` and
mapped over themselves (``MAP_FIXED | MAP_SHARED``), so every pointer into them stays valid and the content is
unchanged.

* Only whole pages inside a range are shared: the partial pages at its ends may hold other data of the process,
  which must not be exposed nor, worse, lost to a concurrent write during the switch.  The bytes of a tensor
  that fall into those edges are not in the segment: :meth:`InPlaceSegment.window` tells the byte window of a
  cache's tensors that is, and a peer copies anything outside it the unshared way.
* The file mirrors the address range from the first shared page to the last (file offset = address - base), so
  a peer translates addresses with one offset exactly as for memory aiodatadist allocated; the gaps between
  ranges are holes of the file, which cost no memory (peers pre-fault only the file's data extents).  Ranges
  scattered across the address space would still make a peer's mapping far larger than the memory shared, so
  they are refused (``LLM_PARAM_INVALID``).
* Nothing may write the memory while it is being switched (a write between the copy and the remap would be
  lost): engines call this right after allocating their KV pool, before serving.  Afterwards the memory behaves
  as before for the process, with one difference: a ``fork`` shares it with the child instead of copying it.
* Closing the segment only closes its descriptor: the process keeps its memory (now unshared for new peers).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from ..errors import LLMException, LLMStatusCode
from ..native.syscalls import libc, populate
from ..protocol.identity import SegmentIdentity
from ..settings.environment import usable_cpus
from .segment import MemfdBacked, sealed_memfd

__all__ = ["MAX_HOLE_FRACTION", "InPlaceSegment"]

PAGE = mmap.PAGESIZE
MAX_HOLE_FRACTION = 8.0
"""Refused when the holes between the ranges exceed this fraction of the shared pages (and 64 MiB)."""
_MAX_HOLE_FLOOR = 64 << 20
SWITCH_PIECE = 64 << 20  # bytes a thread copies or pre-faults at a time while switching
_MAP_FAILED = ctypes.c_void_p(-1).value

libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mmap.restype = ctypes.c_void_p


def _invalid(message: str) -> LLMException:
    return LLMException(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


class InPlaceSegment(MemfdBacked):
    """Ranges ``(address, size)`` of this process's host memory, shared in place (see the module).

    Quacks like :class:`~aiodatadist.memory.SharedSegment` for the transports: ``fd``, ``identity``,
    ``address`` (the base: the first shared page), ``size`` (to the end of the last shared page), ``closed``,
    :meth:`close`."""

    def __init__(self, ranges: Sequence[tuple[int, int]], name: str = "aiodatadist-in-place") -> None:
        starts = np.array([int(a) for a, _ in ranges], dtype=np.uint64)
        sizes = np.array([int(n) for _, n in ranges], dtype=np.uint64)
        if len(starts) == 0 or (sizes == 0).any():
            raise _invalid("share_host_memory needs at least one range, each of size > 0.")
        order = np.argsort(starts, kind="stable")
        self._starts, self._ends = starts[order], starts[order] + sizes[order]
        if (self._starts[1:] < self._ends[:-1]).any():
            raise _invalid("share_host_memory: the ranges overlap.")
        page = np.uint64(PAGE)
        lows = (self._starts + page - np.uint64(1)) // page * page
        highs = self._ends // page * page
        whole = highs > lows
        if not whole.any():
            raise _invalid("share_host_memory: no range holds a whole page, nothing can be shared.")
        self._lows, self._highs = lows, highs  # each range's shared pages (empty where high <= low)
        self.address = int(lows[whole].min())
        self.size = int(highs[whole].max()) - self.address
        shared = int((highs[whole] - lows[whole]).sum())
        if self.size - shared > max(_MAX_HOLE_FLOOR, MAX_HOLE_FRACTION * shared):
            raise _invalid(f"share_host_memory: the ranges are scattered ({self.size - shared} bytes between "
                           f"{shared} bytes to share); allocate the memory with allocate_host_memory instead.")
        self._lock = threading.Lock()
        self._fd: int | None = self._switch(name, lows[whole], highs[whole])
        st = os.fstat(self._fd)
        self.identity = SegmentIdentity(os.getpid(), self._fd, st.st_ino, st.st_dev, self.size)

    def _switch(self, name: str, lows: npt.NDArray[np.uint64], highs: npt.NDArray[np.uint64]) -> int:
        """Copy each range's whole pages into a new memfd and map it over them; returns the memfd.  The copies and
        the pre-faulting run in pieces on up to one thread per CPU (a GiB takes about 0.65 s on one)."""
        fd = sealed_memfd(name, self.size)
        ranges = list(zip(lows.tolist(), highs.tolist(), strict=True))
        pieces = [(at, min(at + SWITCH_PIECE, high)) for low, high in ranges for at in range(low, high, SWITCH_PIECE)]
        threads = min(len(pieces), usable_cpus())
        pool = ThreadPoolExecutor(threads, thread_name_prefix="aiodatadist-share") if threads > 1 else None
        run = pool.map if pool is not None else map
        try:
            # The file's pages get the current content (the kernel copies; the GIL is released).
            list(run(lambda piece: self._write(fd, *piece), pieces))
            for low, high in ranges:
                self._map_over(fd, low, high - low)
            # The new mappings' page tables: no first-touch faults later.
            list(run(lambda piece: populate(piece[0], piece[1] - piece[0], write=True), pieces))
        except BaseException:
            os.close(fd)  # pages switched already stay mapped (same content): the process loses nothing
            raise
        finally:
            if pool is not None:
                pool.shutdown()
        return fd

    def _write(self, fd: int, low: int, high: int) -> None:
        view = memoryview((ctypes.c_char * (high - low)).from_address(low)).cast("B")
        done, offset = 0, low - self.address
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)

    def _map_over(self, fd: int, address: int, length: int) -> None:
        got = libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | 0x10, fd,
                        address - self.address)
        if got in (None, _MAP_FAILED) or got != address:  # 0x10: MAP_FIXED
            err = ctypes.get_errno()
            raise LLMException(f"cannot share host memory at {address:#x} in place: {os.strerror(err)}",
                               status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)

    # -- what registrations ask ------------------------------------------------------------------------------
    def _range_of(self, addrs: npt.NDArray[np.uint64], tensor_size: int) -> npt.NDArray[np.intp] | None:
        """Index of the range holding each ``[addr, addr + tensor_size)``, or None if one lies outside all."""
        index = np.searchsorted(self._starts, addrs, side="right").astype(np.intp) - 1
        if (index < 0).any():
            return None
        if (addrs + np.uint64(tensor_size) > self._ends[index]).any():
            return None
        return index

    def contains(self, addrs: npt.NDArray[np.uint64], tensor_size: int) -> bool:
        """Whether every tensor lies inside one of the ranges, with some of its bytes shared."""
        return self.window(addrs, tensor_size) is not None

    def window(self, addrs: npt.NDArray[np.uint64], tensor_size: int) -> tuple[int, int] | None:
        """The bytes ``[low, high)`` of every tensor that the segment holds (None: a tensor lies outside the ranges,
        or no byte range is shared by all of them)."""
        values = np.asarray(addrs, dtype=np.uint64)
        if self._fd is None or len(values) == 0:
            return None
        index = self._range_of(values, tensor_size)
        if index is None:
            return None
        lows = self._lows[index].astype(np.int64) - values.astype(np.int64)
        highs = self._highs[index].astype(np.int64) - values.astype(np.int64)
        low, high = max(0, int(lows.max())), min(int(tensor_size), int(highs.min()))
        return (low, high) if low < high else None

    # -- the SharedSegment interface -------------------------------------------------------------------------
    def array(self) -> np.ndarray:
        raise LLMException("memory shared in place has no view of its own: use the tensors it holds",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)

    def close(self) -> None:
        """Close the descriptor (new peers can no longer map it); the memory stays the process's, as it is."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
