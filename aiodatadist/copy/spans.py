"""How host copies are made: which copier suits a local transfer of a given size (streaming stores past the
shared cache), and small plans copied on the calling thread.  How spans are cut into pieces and chunks is in
:mod:`aiodatadist.jobs.chunks` (the GPU executor cuts them the same way).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from ..jobs.chunks import as_u64
from ..layout.plans import CopyPlan
from ..native import CopySpec, local_copier, native_extension, native_pool

__all__ = [
    "INLINE_BYTES",
    "PROBE_MAX",
    "STREAMING_THRESHOLD",
    "copier_for_local",
    "copy_grid_now",
    "measured_streaming_share",
    "streaming_share",
]



def _cpu0_caches(root: str = "/sys/devices/system/cpu/cpu0/cache") -> dict[int, int]:
    """CPU 0's data and unified caches (Linux sysfs): bytes by level; empty where unknown."""
    sizes: dict[int, int] = {}
    try:
        entries = os.listdir(root)
    except OSError:
        return sizes
    for entry in entries:
        try:
            with open(f"{root}/{entry}/level", encoding="ascii") as f:
                level = int(f.read())
            with open(f"{root}/{entry}/size", encoding="ascii") as f:
                text = f.read().strip().upper()
        except (OSError, ValueError):
            continue
        try:
            with open(f"{root}/{entry}/type", encoding="ascii") as f:
                kind = f.read().strip()
        except OSError:
            kind = "Unified"
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if kind != "Instruction" and digits.isdigit():
            sizes[level] = int(digits) * scale
    return sizes


def _last_level_cache_bytes() -> int:
    """The size of CPU 0's last-level cache, 0 where unknown."""
    caches = _cpu0_caches()
    return caches[max(caches)] if caches else 0


def _level2_cache_bytes() -> int:
    """The size of CPU 0's level-2 cache (a core's own, or a few cores' on some CPUs), 0 where unknown."""
    return _cpu0_caches().get(2, 0)


STREAMING_THRESHOLD = max(1 << 20, (_last_level_cache_bytes() or 8 << 20) // 8)
"""Transfers this large bypass the CPU caches (non-temporal stores); smaller ones stay in the last-level cache,
where whoever reads the bytes next (the engine) finds them: an eighth of that cache (4 MiB with 32 MiB), at
least 1 MiB.  The native pool streams smaller jobs too where each worker's share is too big for its core's cache
(:func:`streaming_share`) or where the jobs queued together reach this size."""


PROBE_MAX = 16 << 20
"""The largest level-2 cache :func:`streaming_share` measures against (two buffers of its size, copied eight
times): a bigger one is not a core's own cache, and its shares stay plain."""

_share_lock = threading.Lock()
_share: int | None = None  # streaming_share(), once measured


def _new_share_lock() -> None:
    global _share_lock
    _share_lock = threading.Lock()  # a child forked mid-measurement must not inherit the lock held


os.register_at_fork(after_in_child=_new_share_lock)


def streaming_share() -> int:
    """Bytes of a local copy job per worker from which its stores stream, whatever its size: half the level-2
    cache (source and destination then fill it), where this machine's streaming stores copy that much faster than
    its caches do (measured once per process, on the calling thread: ``adt_streaming_beats_cache``, about 2 ms);
    0 (never) elsewhere.  :func:`measured_streaming_share` says whether it is known yet.

    Such a share spills out of the core's private cache into the shared one anyway; where that cache is slow (a
    server CPU's mesh) its stores gain nothing from staying cached, and they evict the rest of the core's cache,
    the event loop's working set included (the loop's CPU copies a share too where every CPU has a worker): on a
    2-vCPU VM of such a CPU, a 2 MiB pull (1 MiB a worker) took 119-126 us with plain stores and 102-104 us with
    streaming ones, the Python around the copy 10-15 us faster.  Where the shared cache is fast, plain stores copy
    such a share faster by half, and stay."""
    global _share
    with _share_lock:
        if _share is None:
            l2 = _level2_cache_bytes()
            lib = native_pool()
            beats = lib is not None and 0 < l2 <= PROBE_MAX and lib.adt_streaming_beats_cache(l2) == 1
            _share = l2 // 2 if beats else 0
        return _share


def measured_streaming_share() -> int | None:
    """:func:`streaming_share` if it was measured already in this process, else None (never measures)."""
    return _share


INLINE_BYTES = 64 << 10
"""Host copies up to this size run on the calling thread, in one native call (:func:`copy_grid_now`): waking a copy
worker and reading its announcement back on the event loop costs tens of microseconds, copying 64 KiB a few."""


def copy_grid_now(plan: CopyPlan, src_addrs: Any, dst_addrs: Any, copier: CopySpec) -> bool:
    """Copy a host plan of at most :data:`INLINE_BYTES` on this thread, in one native call (the grid's spans are
    walked, merged and copied in C); False, having copied nothing, when the plan is bigger or the native helper is
    not built.  Raises ``OSError`` as a copy job would fail (e.g. ``EFAULT``: a remote range is not mapped)."""
    if plan.total_bytes > INLINE_BYTES or _copy_grid is None:
        return False
    runs = plan.runs
    err = _copy_grid(as_u64(src_addrs), as_u64(dst_addrs), plan.src_tensor, plan.dst_tensor, runs.src_offset,
                     runs.dst_offset, runs.length, copier.src_delta, copier.dst_delta, int(copier.mode), copier.pid)
    if err:
        raise OSError(err, f"copy failed: {os.strerror(err)}")
    return True


_copy_grid: Callable[..., int] | None = getattr(native_extension(), "copy_grid", None)


def copier_for_local(total_bytes: int) -> CopySpec:
    """The copier for spans mapped in this process; large transfers bypass the CPU caches."""
    return local_copier(streaming=total_bytes >= STREAMING_THRESHOLD)
