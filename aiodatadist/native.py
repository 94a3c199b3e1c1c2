"""Native copy primitives: batched span copies within this process and across processes.

All functions take numpy ``uint64`` arrays of addresses and lengths and run without the GIL (ctypes foreign
calls release it), so they belong in worker threads, never on the event loop.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "IOV_MAX",
    "copy_local",
    "native_available",
    "populate",
    "process_vm_read",
    "process_vm_write",
]

log = logging.getLogger("aiodatadist.native")
UInt64Array = npt.NDArray[np.uint64]
IOV_MAX: Final = 1024


def _load_native() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("aiodatadist._native")
    if spec is None or spec.origin is None:
        log.info("native span copier not built; using ctypes.memmove per span")
        return None
    lib = ctypes.CDLL(spec.origin)
    fn = lib.adt_copy_spans
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


_NATIVE = _load_native()
_libc = ctypes.CDLL(None, use_errno=True)


def native_available() -> bool:
    """Whether the compiled span copier is in use (else a slower ctypes fallback is)."""
    return _NATIVE is not None


def _ptr(array: UInt64Array) -> int:
    return int(array.ctypes.data)


def copy_local(src: UInt64Array, dst: UInt64Array, length: UInt64Array, streaming: bool = False) -> None:
    """Copy spans between addresses mapped in this process (``memmove`` semantics per span)."""
    n = len(length)
    if n == 0:
        return
    src = np.ascontiguousarray(src, dtype=np.uint64)
    dst = np.ascontiguousarray(dst, dtype=np.uint64)
    length = np.ascontiguousarray(length, dtype=np.uint64)
    if _NATIVE is not None:
        _NATIVE.adt_copy_spans(_ptr(dst), _ptr(src), _ptr(length), n, 1 if streaming else 0)
        return
    move = ctypes.memmove
    for s, d, k in zip(src.tolist(), dst.tolist(), length.tolist()):
        move(d, s, k)


_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23


def populate(address: int, length: int, *, write: bool) -> bool:
    """Pre-fault the page tables of a mapping (``MADV_POPULATE_*``, Linux >= 5.14) without holding the GIL.

    Returns False where the kernel does not support it (pages then fault in lazily on first touch).
    """
    advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
    return bool(_libc.madvise(address, length, advice) == 0)


_libc.process_vm_readv.argtypes = [
    ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong
]
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = _libc.process_vm_readv.argtypes
_libc.process_vm_writev.restype = ctypes.c_ssize_t


def _iovecs(base: UInt64Array, length: UInt64Array) -> UInt64Array:
    """``struct iovec[]`` as an (n, 2) uint64 array: the layout is {void *base; size_t len}."""
    iov = np.empty((len(length), 2), dtype=np.uint64)
    iov[:, 0] = base
    iov[:, 1] = length
    return iov


def _process_vm(call: Any, pid: int, local: UInt64Array, remote: UInt64Array,
                length: UInt64Array) -> None:
    total = int(length.sum())
    local_iov = _iovecs(local, length)
    remote_iov = _iovecs(remote, length)
    for lo in range(0, len(length), IOV_MAX):
        hi = min(lo + IOV_MAX, len(length))
        want = int(length[lo:hi].sum())
        done = call(pid, _ptr(local_iov[lo:hi]), hi - lo, _ptr(remote_iov[lo:hi]), hi - lo, 0)
        if done < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{call.__name__}(pid={pid}): {os.strerror(err)}")
        if done != want:
            # Partial transfers happen only when a remote range is unmapped: report it, never retry blindly.
            raise OSError(0, f"{call.__name__}(pid={pid}) moved {done} of {want} bytes ({total} in the batch)")


def process_vm_read(pid: int, remote_src: UInt64Array, local_dst: UInt64Array, length: UInt64Array) -> None:
    """Copy spans from process ``pid`` into this process (``process_vm_readv``, 1024 spans per call)."""
    _process_vm(_libc.process_vm_readv, pid, local_dst, remote_src, length)


def process_vm_write(pid: int, local_src: UInt64Array, remote_dst: UInt64Array, length: UInt64Array) -> None:
    """Copy spans from this process into process ``pid`` (``process_vm_writev``, 1024 spans per call)."""
    _process_vm(_libc.process_vm_writev, pid, local_src, remote_dst, length)
