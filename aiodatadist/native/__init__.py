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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from ..layout import Spans

ChunkRunner = Callable[[int, int, "StopFlag"], None]
"""Copies spans ``[lo, hi)`` of a bound span list, stopping early once the flag is set."""

__all__ = [
    "IOV_MAX",
    "ChunkRunner",
    "CopySpec",
    "StopFlag",
    "advise_hugepages",
    "bind_runner",
    "local_copier",
    "native_available",
    "native_pool",
    "populate",
    "process_vm_read",
    "pvm_copier",
]

log = logging.getLogger("aiodatadist.native")
UInt64Array = npt.NDArray[np.uint64]
IOV_MAX: Final = 1024


def _load_native() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("aiodatadist.native._native")
    if spec is None or spec.origin is None:
        log.info("native span copier not built; using ctypes.memmove per span")
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        fn = lib.adt_copy_spans
        lib.adt_net_read  # noqa: B018 - a stale build without it is not used
    except (OSError, AttributeError) as exc:
        log.warning("native helper %s unusable (%s); using the Python fallback", spec.origin, exc)
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                   ctypes.c_void_p]
    fn.restype = ctypes.c_long
    return lib


_NATIVE = _load_native()


def _bind_pool(lib: ctypes.CDLL) -> None:
    vp, c_int, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.adt_pool_new.argtypes, lib.adt_pool_new.restype = [c_int, c_int, ctypes.c_uint64], vp
    lib.adt_pool_free.argtypes, lib.adt_pool_free.restype = [vp], None
    lib.adt_job_submit.argtypes = [vp, vp, vp, vp, vp, sz, c_int, c_int, c_int, c_int]
    lib.adt_job_submit.restype = vp
    u64 = ctypes.c_uint64
    lib.adt_job_submit_grid.argtypes = [vp, vp, vp, sz, vp, vp, vp, sz, u64, u64, u64, u64, c_int, c_int, c_int,
                                        c_int]
    lib.adt_job_submit_grid.restype = vp
    lib.adt_send_frame.argtypes = [c_int, vp, sz, vp, vp, ctypes.c_int64, ctypes.c_int64]
    lib.adt_send_frame.restype = c_int
    lib.adt_recv_frame.argtypes = [c_int, vp, vp, vp, sz, u64, u64, vp, vp, sz]
    lib.adt_recv_frame.restype = ctypes.c_long
    i64, pi = ctypes.c_int64, ctypes.POINTER(c_int)
    lib.adt_dir_withdraw.argtypes, lib.adt_dir_withdraw.restype = [vp, i64], None
    lib.adt_net_new.argtypes, lib.adt_net_new.restype = [c_int, vp, sz, u64], vp
    lib.adt_net_attach.argtypes, lib.adt_net_attach.restype = [vp, c_int], c_int
    lib.adt_net_send.argtypes, lib.adt_net_send.restype = [vp, u64, vp, vp, sz], vp
    lib.adt_net_receive.argtypes, lib.adt_net_receive.restype = [vp, u64], vp
    lib.adt_net_set_destination.argtypes, lib.adt_net_set_destination.restype = [vp, vp, vp, vp, sz], c_int
    lib.adt_net_read.argtypes = [vp, u64, i64, u64, u64, i64, vp, vp, sz, vp, vp, sz]
    lib.adt_net_read.restype = vp
    lib.adt_net_cancel.argtypes, lib.adt_net_cancel.restype = [vp, vp, c_int], None
    lib.adt_net_job_state.argtypes, lib.adt_net_job_state.restype = [vp, vp, pi, pi], c_int
    lib.adt_net_job_free.argtypes, lib.adt_net_job_free.restype = [vp], None
    lib.adt_net_connections.argtypes, lib.adt_net_connections.restype = [vp], c_int
    lib.adt_net_close.argtypes, lib.adt_net_close.restype = [vp], None
    lib.adt_net_free.argtypes, lib.adt_net_free.restype = [vp], None
    lib.adt_job_cancel.argtypes, lib.adt_job_cancel.restype = [vp, vp], None
    lib.adt_job_state.argtypes, lib.adt_job_state.restype = [vp, vp, ctypes.POINTER(c_int)], c_int
    lib.adt_job_free.argtypes, lib.adt_job_free.restype = [vp], None


if _NATIVE is not None:
    _bind_pool(_NATIVE)


def native_pool() -> ctypes.CDLL | None:
    """The compiled library with the native worker pool (``adt_pool_*``, ``adt_job_*``), if built."""
    return _NATIVE
_libc = ctypes.CDLL(None, use_errno=True)


def native_available() -> bool:
    """Whether the compiled span copier is in use (else a slower ctypes fallback is)."""
    return _NATIVE is not None


def _ptr(array: UInt64Array) -> int:
    return int(array.ctypes.data)



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


@dataclass(frozen=True, slots=True)
class CopySpec:
    """How to execute spans: ``mode`` 0 copies within this process, 1 reads from process ``pid``
    (``process_vm_readv``), 2 writes into it (``process_vm_writev``).  ``src_delta``/``dst_delta`` translate
    addresses first (a peer's segment mapped here)."""

    mode: int = 0
    pid: int = 0
    streaming: bool = False
    src_delta: int = 0
    dst_delta: int = 0

    def translate(self, spans: Spans) -> Spans:
        if not self.src_delta and not self.dst_delta:
            return spans
        from ..layout import Spans as _Spans

        return _Spans(spans.src + np.uint64(self.src_delta), spans.dst + np.uint64(self.dst_delta), spans.length)



def local_copier(streaming: bool = False) -> CopySpec:
    """Spans whose both ends are mapped in this process."""
    return CopySpec(0, streaming=streaming)


def pvm_copier(pid: int, *, remote_is_src: bool) -> CopySpec:
    """Spans whose source (pull) or destination (push) lies in process ``pid``."""
    return CopySpec(1 if remote_is_src else 2, pid=pid)


def bind_runner(spec: CopySpec, spans: Spans) -> ChunkRunner:
    """A per-chunk runner for the Python executor (the native pool runs a :class:`CopySpec` itself)."""
    spans = spec.translate(spans)
    src = np.ascontiguousarray(spans.src, dtype=np.uint64)
    dst = np.ascontiguousarray(spans.dst, dtype=np.uint64)
    length = np.ascontiguousarray(spans.length, dtype=np.uint64)
    if spec.mode != 0:
        return _pvm_runner(spec, src, dst, length)
    if _NATIVE is None:
        triples = list(zip(dst.tolist(), src.tolist(), length.tolist()))

        def run_fallback(lo: int, hi: int, stop: StopFlag) -> None:
            for d, s, n in triples[lo:hi]:
                if stop.is_set():
                    return
                ctypes.memmove(d, s, n)

        return run_fallback
    fn, ps, pd, pl, flag = _NATIVE.adt_copy_spans, _ptr(src), _ptr(dst), _ptr(length), int(spec.streaming)

    def run(lo: int, hi: int, stop: StopFlag) -> None:
        # One native call for the whole chunk; the arrays stay alive through this closure.
        _keep = (src, dst, length)
        fn(pd + 8 * lo, ps + 8 * lo, pl + 8 * lo, hi - lo, flag, stop.address)

    return run


def _pvm_runner(spec: CopySpec, src: UInt64Array, dst: UInt64Array, length: UInt64Array) -> ChunkRunner:
    remote_is_src = spec.mode == 1
    call = _libc.process_vm_readv if remote_is_src else _libc.process_vm_writev
    local, remote = (dst, src) if remote_is_src else (src, dst)
    local_iov, remote_iov = _iovecs(local, length), _iovecs(remote, length)
    ends = np.concatenate(([0], np.cumsum(length, dtype=np.uint64))).tolist()
    pli, pri, pid = _ptr(local_iov), _ptr(remote_iov), spec.pid

    def run(lo: int, hi: int, stop: StopFlag) -> None:
        _keep = (local_iov, remote_iov)
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
