"""The few Linux system calls the copy paths make directly through libc: ``madvise`` (huge pages, pre-faulting)
and ``process_vm_readv``/``writev`` (spans of another process)."""

from __future__ import annotations

import ctypes
import os
from typing import Any, Final

import numpy as np

from .._arrays import UInt64Array

__all__ = [
    "IOVEC_BYTES",
    "IOV_MAX",
    "advise_hugepages",
    "data_address",
    "iovecs",
    "libc",
    "populate",
    "process_vm_read",
]

IOV_MAX: Final = 1024
"""Spans per ``process_vm_*`` call (the kernel's ``UIO_MAXIOV``)."""

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.madvise.restype = ctypes.c_int
libc.process_vm_readv.argtypes = [
    ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong
]
libc.process_vm_readv.restype = ctypes.c_ssize_t
libc.process_vm_writev.argtypes = libc.process_vm_readv.argtypes
libc.process_vm_writev.restype = ctypes.c_ssize_t

# <asm-generic/mman-common.h>
MADV_HUGEPAGE: Final = 14
MADV_POPULATE_READ: Final = 22
MADV_POPULATE_WRITE: Final = 23


def data_address(array: UInt64Array) -> int:
    """Where an array's data is (for a foreign call)."""
    return int(array.ctypes.data)


def advise_hugepages(address: int, length: int) -> bool:
    """``MADV_HUGEPAGE``: lets the kernel back the range with huge pages where its THP policy allows it."""
    return bool(libc.madvise(address, length, MADV_HUGEPAGE) == 0)


def populate(address: int, length: int, *, write: bool) -> bool:
    """Pre-fault the page tables of a mapping (``MADV_POPULATE_*``, Linux >= 5.14) without holding the GIL.

    Returns False where the kernel does not support it (pages then fault in lazily on first touch).
    """
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    return bool(libc.madvise(address, length, advice) == 0)


IOVEC_BYTES: Final = 16  # sizeof(struct iovec): a row of iovecs()


def iovecs(base: UInt64Array, length: UInt64Array) -> UInt64Array:
    """``struct iovec[]`` as an (n, 2) uint64 array: the layout is {void *base; size_t len}."""
    iov = np.empty((len(length), 2), dtype=np.uint64)
    iov[:, 0] = base
    iov[:, 1] = length
    return iov


def _process_vm(call: Any, pid: int, local: UInt64Array, remote: UInt64Array,
                length: UInt64Array) -> None:
    total = int(length.sum())
    local_iov = iovecs(local, length)
    remote_iov = iovecs(remote, length)
    for lo in range(0, len(length), IOV_MAX):
        hi = min(lo + IOV_MAX, len(length))
        want = int(length[lo:hi].sum())
        done = call(pid, data_address(local_iov[lo:hi]), hi - lo, data_address(remote_iov[lo:hi]), hi - lo, 0)
        if done < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{call.__name__}(pid={pid}): {os.strerror(err)}")
        if done != want:
            # Partial transfers happen only when a remote range is unmapped: report it, never retry blindly.
            raise OSError(0, f"{call.__name__}(pid={pid}) moved {done} of {want} bytes ({total} in the batch)")


def process_vm_read(pid: int, remote_src: UInt64Array, local_dst: UInt64Array, length: UInt64Array) -> None:
    """Copy spans from process ``pid`` into this process (``process_vm_readv``, 1024 spans per call)."""
    _process_vm(libc.process_vm_readv, pid, local_dst, remote_src, length)
