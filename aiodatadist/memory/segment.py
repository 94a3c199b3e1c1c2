"""Anonymous shared memory (``memfd``) for host caches.

A segment has no name anywhere in the file system, so nothing is left behind when its owner exits, even by
SIGKILL: the kernel frees it with the last descriptor and mapping.  A peer process on the same host maps it
through ``/proc/<pid>/fd/<fd>`` and checks the inode it got against the identity the owner announced, so a
recycled descriptor number can never alias another file.  Size seals make the mapping safe from truncation.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading

import numpy as np

from ..errors import LLMException, LLMStatusCode
from ..native import advise_hugepages, populate
from ..segment_identity import SegmentIdentity

__all__ = ["PAGE", "MemfdBacked", "SegmentIdentity", "SharedSegment", "map_peer_segment", "map_segment_fd", "sealed_memfd"]

PAGE = mmap.PAGESIZE
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0x0002) | getattr(fcntl, "F_SEAL_GROW", 0x0004) | getattr(
    fcntl, "F_SEAL_SEAL", 0x0001
)
_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)


def sealed_memfd(name: str, size: int) -> int:
    """A new ``memfd`` of ``size`` bytes (holes until written), its size sealed where the kernel allows;
    ``LLM_OUT_OF_MEMORY`` if it cannot be created."""
    flags = getattr(os, "MFD_CLOEXEC", 1) | getattr(os, "MFD_ALLOW_SEALING", 2)
    try:
        fd = os.memfd_create(name, flags)
    except (AttributeError, OSError) as exc:
        raise LLMException(f"cannot create shared memory: {exc}", status_code=LLMStatusCode.LLM_OUT_OF_MEMORY) from exc
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        os.close(fd)
        raise LLMException(f"cannot allocate {size} bytes of shared memory: {exc}",
                           status_code=LLMStatusCode.LLM_OUT_OF_MEMORY) from exc
    try:
        fcntl.fcntl(fd, _ADD_SEALS, _SEALS)
    except OSError:
        pass  # sealing is a safety net, not a requirement
    return fd


class MemfdBacked:
    """What every segment a peer may map has: its ``memfd`` (``fd``), until ``close`` gives it up (``closed``)."""

    _fd: int | None

    @property
    def fd(self) -> int | None:
        """The memfd (None once closed): what :mod:`aiodatadist.transport.fd_passing` hands to peers."""
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd is None


class SharedSegment(MemfdBacked):
    """A pre-faulted, zero-filled, sealed ``memfd`` mapping owned by this process."""

    def __init__(self, size: int, name: str = "aiodatadist") -> None:
        if size <= 0:
            raise ValueError("segment size must be > 0")
        self.size = (size + PAGE - 1) // PAGE * PAGE
        fd = sealed_memfd(name, self.size)
        try:
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        except OSError as exc:
            os.close(fd)
            raise LLMException(
                f"cannot allocate {self.size} bytes of shared memory: {exc}",
                status_code=LLMStatusCode.LLM_OUT_OF_MEMORY,
            ) from exc
        self._fd: int | None = fd
        st = os.fstat(fd)
        self.identity = SegmentIdentity(os.getpid(), fd, st.st_ino, st.st_dev, self.size)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._lock = threading.Lock()
        # Pre-fault (and so zero-fill) every page now, not during the first transfer; madvise releases the
        # GIL, unlike MAP_POPULATE inside mmap.mmap.
        advise_hugepages(self.address, self.size)  # effective where shmem THP is set to "advise"
        if not populate(self.address, self.size, write=True):
            self.array()[::PAGE] = 0

    def array(self) -> np.ndarray:
        """A uint8 view of the whole segment; the mapping stays alive while any view does."""
        return np.frombuffer(self._map, dtype=np.uint8)

    def close(self) -> None:
        """Release the descriptor and unmap; views still held by the user keep the pages until they die."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        os.close(fd)
        try:
            self._map.close()
        except BufferError:
            pass  # numpy views exist: CPython unmaps when the last one is released


def map_peer_segment(identity: SegmentIdentity, *, writable: bool = True) -> mmap.mmap:
    """Map a segment owned by another process on this host, verifying it is the announced one.

    The mapping is lazy (cheap at any size); see :func:`aiodatadist.native.populate` to pre-fault it.
    """
    path = f"/proc/{identity.pid}/fd/{identity.fd}"
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot open peer segment {path}: {exc.strerror}") from exc
    try:
        return map_segment_fd(fd, identity, writable=writable, what=path)
    finally:
        os.close(fd)


def map_segment_fd(fd: int, identity: SegmentIdentity, *, writable: bool = True, what: str = "") -> mmap.mmap:
    """Map a peer's segment from a descriptor of it (opened here, or handed over by the peer), verifying it is
    the announced one; the caller keeps ``fd``."""
    st = os.fstat(fd)
    if (st.st_ino, st.st_dev) != (identity.inode, identity.device) or st.st_size < identity.size:
        raise OSError(0, f"peer segment {what or fd} is not the announced one (released or recycled)")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, identity.size, flags=mmap.MAP_SHARED, prot=prot)
