"""How a list of spans is copied: :class:`CopySpec` (within this process, or from/into another one), the stop flag
copies poll, and the per-chunk runners of the Python executor.

The runners take numpy ``uint64`` arrays of addresses and lengths and run without the GIL (ctypes foreign calls
release it), so they belong in worker threads, never on the event loop.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, NamedTuple

import numpy as np

from .._arrays import UInt64Array
from .bindings import CopyMode, load
from .syscalls import IOVEC_BYTES, data_address, iovecs, libc

if TYPE_CHECKING:
    from ..layout.plans import Spans

__all__ = [
    "PVM_SPANS_PER_CALL",
    "ChunkRunner",
    "CopyMode",
    "CopySpec",
    "StopFlag",
    "bind_runner",
    "local_copier",
    "pvm_copier",
]

ChunkRunner = Callable[[int, int, "StopFlag"], None]
"""Copies spans ``[lo, hi)`` of a bound span list, stopping early once the flag is set."""

PVM_SPANS_PER_CALL: Final = 64  # process_vm_* cannot poll a flag: bound each call instead


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


class CopySpec(NamedTuple):
    """How to execute spans: ``mode`` :attr:`~CopyMode.MEMCPY` copies within this process,
    :attr:`~CopyMode.PVM_READ` reads from process ``pid`` (``process_vm_readv``), :attr:`~CopyMode.PVM_WRITE`
    writes into it (``process_vm_writev``).  ``src_delta``/``dst_delta`` translate addresses first (a peer's
    segment mapped here).  A named tuple: cheap to build (see :class:`~aiodatadist.layout.TransferParams`)."""

    mode: CopyMode = CopyMode.MEMCPY
    pid: int = 0
    streaming: bool = False
    src_delta: int = 0
    dst_delta: int = 0

    def translate(self, spans: Spans) -> Spans:
        if not self.src_delta and not self.dst_delta:
            return spans
        from ..layout.plans import Spans as _Spans

        return _Spans(spans.src + np.uint64(self.src_delta), spans.dst + np.uint64(self.dst_delta), spans.length)


def local_copier(streaming: bool = False) -> CopySpec:
    """Spans whose both ends are mapped in this process."""
    return CopySpec(CopyMode.MEMCPY, streaming=streaming)


def pvm_copier(pid: int, *, remote_is_src: bool) -> CopySpec:
    """Spans whose source (pull) or destination (push) lies in process ``pid``."""
    return CopySpec(CopyMode.PVM_READ if remote_is_src else CopyMode.PVM_WRITE, pid=pid)


def bind_runner(spec: CopySpec, spans: Spans) -> ChunkRunner:
    """A per-chunk runner for the Python executor (the native pool runs a :class:`CopySpec` itself)."""
    spans = spec.translate(spans)
    src = np.ascontiguousarray(spans.src, dtype=np.uint64)
    dst = np.ascontiguousarray(spans.dst, dtype=np.uint64)
    length = np.ascontiguousarray(spans.length, dtype=np.uint64)
    if spec.mode != CopyMode.MEMCPY:
        return _pvm_runner(spec, src, dst, length)
    lib = load()
    if lib is None:
        triples = list(zip(dst.tolist(), src.tolist(), length.tolist()))

        def run_fallback(lo: int, hi: int, stop: StopFlag) -> None:
            for d, s, n in triples[lo:hi]:
                if stop.is_set():
                    return
                ctypes.memmove(d, s, n)

        return run_fallback
    fn, ps, pd, pl = lib.adt_copy_spans, data_address(src), data_address(dst), data_address(length)
    flag = int(spec.streaming)

    def run(lo: int, hi: int, stop: StopFlag) -> None:
        # One native call for the whole chunk; the arrays stay alive through this closure.
        _keep = (src, dst, length)
        fn(pd + 8 * lo, ps + 8 * lo, pl + 8 * lo, hi - lo, flag, stop.address)

    return run


def _pvm_runner(spec: CopySpec, src: UInt64Array, dst: UInt64Array, length: UInt64Array) -> ChunkRunner:
    remote_is_src = spec.mode == CopyMode.PVM_READ
    call = libc.process_vm_readv if remote_is_src else libc.process_vm_writev
    local, remote = (dst, src) if remote_is_src else (src, dst)
    local_iov, remote_iov = iovecs(local, length), iovecs(remote, length)
    ends = np.concatenate(([0], np.cumsum(length, dtype=np.uint64))).tolist()
    pli, pri, pid = data_address(local_iov), data_address(remote_iov), spec.pid

    def run(lo: int, hi: int, stop: StopFlag) -> None:
        _keep = (local_iov, remote_iov)
        for a in range(lo, hi, PVM_SPANS_PER_CALL):
            if stop.is_set():
                return
            b = min(a + PVM_SPANS_PER_CALL, hi)
            done = call(pid, pli + IOVEC_BYTES * a, b - a, pri + IOVEC_BYTES * a, b - a, 0)
            if done < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"{call.__name__}(pid={pid}): {os.strerror(err)}")
            if done != ends[b] - ends[a]:
                raise OSError(0, f"{call.__name__}(pid={pid}) moved {done} of {ends[b] - ends[a]} bytes")

    return run
