"""The compiled helper (``src/``: one C file per idea, every shared prototype in ``src/adt.h``) and the copy
primitives built on it: batched span copies within this process and across processes, and the system calls they
need.

* :mod:`.bindings`: loading the helper, its ctypes signatures, and the codes and layouts Python shares with C;
* :mod:`.spans`: :class:`CopySpec`, :class:`StopFlag` and the Python executor's chunk runners;
* :mod:`.syscalls`: ``madvise`` and ``process_vm_readv``/``writev`` through libc.

Everything runs without the GIL (ctypes foreign calls release it), so it belongs in worker threads, never on the
event loop.  Without the helper (not built, or a stale build) copies fall back to ``ctypes.memmove``.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from .bindings import (
    ANY_MODEL,
    DIR_DEVICE,
    DIR_WORDS,
    KEY_FLAG_SHIFT,
    NET_MAGIC,
    STAGE_STATS,
    TID_MASK,
    CopyMode,
    DeviceLane,
    DirWord,
    FrameType,
    JobState,
    Lane,
    OwnerStatus,
    StageSlot,
    Streaming,
    load,
)
from .spans import ChunkRunner, CopySpec, StopFlag, bind_runner, local_copier, pvm_copier
from .syscalls import IOV_MAX, advise_hugepages, populate, process_vm_read

__all__ = [
    "ANY_MODEL",
    "DIR_DEVICE",
    "DIR_WORDS",
    "IOV_MAX",
    "KEY_FLAG_SHIFT",
    "NET_MAGIC",
    "STAGE_STATS",
    "TID_MASK",
    "ChunkRunner",
    "CopyMode",
    "CopySpec",
    "DeviceLane",
    "DirWord",
    "FrameType",
    "JobState",
    "Lane",
    "OwnerStatus",
    "StageSlot",
    "StopFlag",
    "Streaming",
    "advise_hugepages",
    "bind_runner",
    "int_bounds",
    "load",
    "local_copier",
    "native_available",
    "native_extension",
    "native_pool",
    "populate",
    "process_vm_read",
    "pvm_copier",
]

_LIB = load()  # at import, as before: the reason a build is not used is logged once, up front


def native_pool() -> ctypes.CDLL | None:
    """The compiled library with the native worker pool (``adt_pool_*``, ``adt_job_*``) and the TCP data plane
    (``adt_net_*``), if built."""
    return _LIB


def native_available() -> bool:
    """Whether the compiled span copier is in use (else a slower ctypes fallback is)."""
    return _LIB is not None


@functools.cache
def native_extension() -> Any:
    """The helper as a Python module (functions called without ctypes' argument conversion: ``copy_grid``,
    ``submit_grid``, ``reap``, ``int_bounds``), or None where it is not built or predates its source."""
    if _LIB is None:
        return None
    try:
        from . import _native  # type: ignore[attr-defined, unused-ignore]
    except ImportError:
        return None
    return _native if hasattr(_native, "net_send") else None  # (its newest function)


def _no_bounds(values: Any) -> None:
    return None


int_bounds: Any = getattr(native_extension(), "int_bounds", _no_bounds)
"""``int_bounds(values)``: ``(min, max)`` of a non-empty list or tuple of exact ``int`` (no ``bool``) that fit an
int64, else ``None`` (always ``None`` without the helper): the fast path of block-list checks."""
