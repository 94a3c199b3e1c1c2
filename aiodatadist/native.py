"""Native copy primitives: batched span copies within this process and across processes.

All functions take numpy ``uint64`` arrays of addresses and lengths and run without the GIL (ctypes foreign
calls release it), so they belong in worker threads, never on the event loop.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from .layout import Spans

ChunkRunner = Callable[[int, int, "StopFlag"], None]
"""Copies spans ``[lo, hi)`` of the spans a :data:`Copier` was bound to, stopping early once the flag is set."""
Copier = Callable[["Spans"], ChunkRunner]
"""Binds a span list once (pointers, iovecs) and returns the per-chunk runner used by worker threads."""

__all__ = [
    "IOV_MAX",
    "StopFlag",
    "ChunkRunner",
    "Copier",
    "local_copier",
    "pvm_copier",
    "copy_local",
    "native_available",
    "populate",
    "advise_hugepages",
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
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                   ctypes.c_void_p]
    fn.restype = ctypes.c_long
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
        _NATIVE.adt_copy_spans(_ptr(dst), _ptr(src), _ptr(length), n, 1 if streaming else 0, None)
        return
    move = ctypes.memmove
    for s, d, k in zip(src.tolist(), dst.tolist(), length.tolist()):
        move(d, s, k)


class StopFlag:
    """A flag that native copies poll between spans (an int32 in memory, set from any thread)."""

    __slots__ = ("_word", "address")

    def __init__(self) -> None:
        self._word = np.zeros(1, dtype=np.int32)
        self.address = int(self._word.ctypes.data)

    def set(self) -> None:
        self._word[0] = 1

    def is_set(self) -> bool:
        return bool(self._word[0])


PVM_SPANS_PER_CALL = 64  # process_vm_* cannot poll a flag: bound each call instead


def local_copier(streaming: bool = False) -> Copier:
    """A :data:`Copier` for spans whose both ends are mapped in this process."""

    def bind(spans: Spans) -> ChunkRunner:
        src = np.ascontiguousarray(spans.src, dtype=np.uint64)
        dst = np.ascontiguousarray(spans.dst, dtype=np.uint64)
        length = np.ascontiguousarray(spans.length, dtype=np.uint64)
        if _NATIVE is None:
            triples = list(zip(dst.tolist(), src.tolist(), length.tolist()))

            def run_fallback(lo: int, hi: int, stop: StopFlag) -> None:
                for d, s, n in triples[lo:hi]:
                    if stop.is_set():
                        return
                    ctypes.memmove(d, s, n)

            return run_fallback
        fn, ps, pd, pl, flag = _NATIVE.adt_copy_spans, _ptr(src), _ptr(dst), _ptr(length), int(streaming)

        def run(lo: int, hi: int, stop: StopFlag) -> None:
            # One native call for the whole chunk; the arrays stay alive through this closure.
            _keep = (src, dst, length)  # noqa: F841
            fn(pd + 8 * lo, ps + 8 * lo, pl + 8 * lo, hi - lo, flag, stop.address)

        return run

    return bind


def pvm_copier(pid: int, *, remote_is_src: bool) -> Copier:
    """A :data:`Copier` for spans whose source (pull) or destination (push) lies in process ``pid``."""
    call = _libc.process_vm_readv if remote_is_src else _libc.process_vm_writev

    def bind(spans: Spans) -> ChunkRunner:
        local, remote = (spans.dst, spans.src) if remote_is_src else (spans.src, spans.dst)
        local_iov, remote_iov = _iovecs(local, spans.length), _iovecs(remote, spans.length)
        ends = np.concatenate(([0], np.cumsum(spans.length, dtype=np.uint64))).tolist()
        pli, pri = _ptr(local_iov), _ptr(remote_iov)

        def run(lo: int, hi: int, stop: StopFlag) -> None:
            _keep = (local_iov, remote_iov)  # noqa: F841
            for a in range(lo, hi, PVM_SPANS_PER_CALL):
                if stop.is_set():
                    return
                b = min(a + PVM_SPANS_PER_CALL, hi)
                done = call(pid, pli + 16 * a, b - a, pri + 16 * a, b - a, 0)
                if done < 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"{call.__name__}(pid={pid}): {os.strerror(err)}")
                if done != ends[b] - ends[a]:
                    raise OSError(0, f"{call.__name__}(pid={pid}) moved {done} of {ends[b] - ends[a]} bytes")

        return run

    return bind


_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23


def advise_hugepages(address: int, length: int) -> bool:
    """``MADV_HUGEPAGE``: lets the kernel back the range with huge pages where its THP policy allows it."""
    return bool(_libc.madvise(address, length, 14) == 0)


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
