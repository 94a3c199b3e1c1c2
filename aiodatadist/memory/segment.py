"""Anonymous shared memory (``memfd``) for host caches.

A segment has no name anywhere in the file system, so nothing is left behind when its owner exits, even by
SIGKILL: the kernel frees it with the last descriptor and mapping.  A peer process on the same host maps it
through ``/proc/<pid>/fd/<fd>`` and checks the inode it got against the identity the owner announced, so a
recycled descriptor number can never alias another file.  Size seals make the mapping safe from truncation.

A segment asked to (``huge_pages``, see :data:`HUGE_PAGE_MODES`) lies on the system's reserved huge pages
(``memfd_create(MFD_HUGETLB)``): 2 MiB pages instead of 4 KiB ones, so copies through it are not slowed by page
walks (the transparent huge pages that private memory gets are not given to shared memory on most systems).
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
from ..protocol.identity import SegmentIdentity
from ..settings.environment import HUGE_PAGE_MODES, env_knobs

__all__ = [
    "HUGE_PAGE_MODES",
    "PAGE",
    "MemfdBacked",
    "SegmentIdentity",
    "SharedSegment",
    "cache_segment",
    "huge_page_bytes",
    "huge_segment_size",
    "map_peer_segment",
    "map_segment_fd",
    "sealed_memfd",
]

PAGE = mmap.PAGESIZE
HUGE_WASTE = 16
"""``try`` puts a segment on huge pages only where rounding it up to whole ones adds at most 1/HUGE_WASTE of its
size (from 32 MiB up with 2 MiB pages, and any exact multiple)."""
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0x0002) | getattr(fcntl, "F_SEAL_GROW", 0x0004) | getattr(
    fcntl, "F_SEAL_SEAL", 0x0001
)
_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)


def sealed_memfd(name: str, size: int, *, hugetlb: bool = False) -> int:
    """A new ``memfd`` of ``size`` bytes (holes until written; ``hugetlb``: on the system's huge pages, ``size`` a
    multiple of theirs), its size sealed where the kernel allows; ``LLM_OUT_OF_MEMORY`` if it cannot be created."""
    flags = getattr(os, "MFD_CLOEXEC", 1) | getattr(os, "MFD_ALLOW_SEALING", 2)
    if hugetlb:
        flags |= getattr(os, "MFD_HUGETLB", 4)
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


def huge_page_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The size of the system's default huge pages (``Hugepagesize``), 0 where unknown."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("Hugepagesize:"):
                    fields = line.split()
                    return int(fields[1]) << 10 if fields[-1] == "kB" else int(fields[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def huge_segment_size(size: int, mode: str, page: int) -> int | None:
    """The bytes a segment of ``size`` takes on huge pages of ``page`` bytes under ``mode``, or None where it stays
    on ordinary pages (``off``, no huge pages, or ``try`` and more than 1/:data:`HUGE_WASTE` of rounding)."""
    if mode == "off" or page <= PAGE:
        return None
    rounded = -(-size // page) * page
    if mode == "try" and (rounded - size) * HUGE_WASTE > size:
        return None
    return rounded


def _huge_pages_failed(size: int, why: str) -> LLMException:
    return LLMException(
        f"cannot allocate {size} bytes of shared memory on huge pages ({why}); AIODATADIST_HUGE_PAGES=on requires "
        "them: reserve them (/proc/sys/vm/nr_hugepages) or set it to 'try'",
        status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)


_Mapping = tuple[int, mmap.mmap, int, int]  # a segment's memfd, its mapping, address and page size


def _mapping(size: int, name: str, page: int) -> _Mapping:
    """A pre-faulted memfd of ``size`` bytes (whole pages of ``page`` bytes: :data:`PAGE`, or the system's huge
    pages), ``LLM_OUT_OF_MEMORY`` if not.  Mapping huge pages reserves them, and pre-faulting with
    ``MADV_POPULATE_WRITE`` reports a shortfall as an error where touching them would raise SIGBUS."""
    hugetlb = page != PAGE
    fd = sealed_memfd(name, size, hugetlb=hugetlb)
    try:
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except OSError as exc:
        os.close(fd)
        raise LLMException(f"cannot allocate {size} bytes of shared memory: {exc}",
                           status_code=LLMStatusCode.LLM_OUT_OF_MEMORY) from exc
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    # Pre-fault (and so zero-fill) every page now, not during the first transfer; madvise releases the GIL, unlike
    # MAP_POPULATE inside mmap.mmap.
    if not hugetlb:
        advise_hugepages(address, size)  # effective where shmem THP is set to "advise"
    if not populate(address, size, write=True):
        if hugetlb:
            mapping.close()
            os.close(fd)
            raise LLMException("cannot pre-fault the huge pages", status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)
        np.frombuffer(mapping, dtype=np.uint8)[::PAGE] = 0
    return fd, mapping, address, page


def _huge_mapping(size: int, name: str, mode: str) -> _Mapping | None:
    """A pre-faulted memfd of ``size`` bytes rounded up to whole huge pages where ``mode`` and the system allow;
    None for ordinary pages (``try``), ``LLM_OUT_OF_MEMORY`` where ``on`` cannot have them."""
    page = huge_page_bytes()
    rounded = huge_segment_size(size, mode, page)
    if rounded is None:
        if mode == "on":
            raise _huge_pages_failed(size, "this system has no huge pages")
        return None
    try:
        return _mapping(rounded, name, page)
    except LLMException as exc:
        if mode == "on":
            raise _huge_pages_failed(rounded, str(exc.__cause__ or exc)) from exc
        return None


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
    """A pre-faulted, zero-filled, sealed ``memfd`` mapping owned by this process.

    ``huge_pages`` (one of :data:`HUGE_PAGE_MODES`, default ``off``) puts it on the system's huge pages;
    ``page_size`` says which pages it got, ``size`` the bytes (whole pages of that size)."""

    def __init__(self, size: int, name: str = "aiodatadist", *, huge_pages: str = "off") -> None:
        if size <= 0:
            raise ValueError("segment size must be > 0")
        if huge_pages not in HUGE_PAGE_MODES:
            raise ValueError(f"huge_pages must be one of {HUGE_PAGE_MODES}, got {huge_pages!r}")
        self._lock = threading.Lock()
        huge = _huge_mapping(size, name, huge_pages) if huge_pages != "off" else None
        fd, self._map, self.address, self.page_size = huge or _mapping((size + PAGE - 1) // PAGE * PAGE, name, PAGE)
        self._fd: int | None = fd
        self.size = len(self._map)
        st = os.fstat(fd)
        self.identity = SegmentIdentity(os.getpid(), fd, st.st_ino, st.st_dev, self.size)

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


def cache_segment(size: int, name: str) -> SharedSegment:
    """The segment of a host cache or host memory allocated through aiodatadist: on huge pages as
    ``AIODATADIST_HUGE_PAGES`` says (``try`` by default)."""
    return SharedSegment(size, name, huge_pages=env_knobs().huge_pages)


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
