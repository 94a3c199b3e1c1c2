"""Benchmark hooks: what the benchmarks (``benchmarks/`` in the repository, ``aiodatadist_benchmarks``) need of
the library beyond its public API, each through one function here (``docs/testing.md``, "Benchmark hooks").

A benchmark compares the library with the machine's own limits and looks inside a copy to say where the time
goes: the copy threads and the native streaming copy give the same-host limit, the GPU handle the device's own
copy rates, and the GPU hooks the phases of a device copy and the copy kernel alone.  The library's internals
can then move without the benchmarks following them.  These hooks are for measuring, not for serving: they may
change with any release.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

if TYPE_CHECKING:
    from ..cuda.driver import Device
    from ..cuda.executor import CudaExecutor
    from ..datadist import LLMDataDist

__all__ = ["GpuCopyTimes", "StreamCopyFn", "copy_threads", "cuda_status", "gpu", "gpu_copy_times",
           "native_available", "stream_copy_function", "time_copy_kernel"]

StreamCopyFn = Callable[[int, int, int, int], int]
"""``(dst, src, nbytes, threads) -> 0``: ``nbytes`` copied by ``threads`` threads with streaming stores."""


def native_available() -> bool:
    """Whether the native helper (span copier, copy pool, TCP I/O threads) is built and loads."""
    from ..native import native_available as available

    return available()


def copy_threads() -> int:
    """The copy threads the instances of this process use (``AIODATADIST_COPY_THREADS``, else the default)."""
    from ..settings.environment import env_knobs

    return env_knobs().copy_threads


def stream_copy_function() -> StreamCopyFn | None:
    """The native helper's streaming copy (how the copy pool copies: non-temporal stores, each thread's share
    cut into the lanes that run together), the same-host limit a transfer is compared with; None without the
    native helper."""
    from ..native import native_pool

    lib = native_pool()
    copy: StreamCopyFn | None = getattr(lib, "adt_stream_copy_limit", None) if lib is not None else None
    return copy


def cuda_status() -> str:
    """One line: the CUDA driver's version and devices, or why CUDA cannot be used (as ``aiodatadist info``)."""
    from ..copy.device_runtime import runtime_status as status

    return status()


def gpu(ordinal: int = 0) -> Device:
    """The library's handle of CUDA device ``ordinal`` (shared by the process), for a benchmark's own copies:
    ``alloc``/``free``, ``alloc_pinned``/``free_pinned``, ``memset``, ``copy_dtod``/``copy_htod``/``copy_dtoh``,
    ``synchronize``, ``name``, ``sm_count``, ``driver.path``.  Raises ``LLM_FEATURE_NOT_ENABLED`` saying why
    when CUDA cannot be used."""
    from ..cuda import get_device

    return get_device(ordinal)


@dataclass(frozen=True, slots=True)
class GpuCopyTimes:
    """The timestamps of one GPU copy (``time.perf_counter()`` seconds; 0.0 where not known): before its first
    driver call, once it was enqueued, once the event loop saw it complete, and its time on the GPU between
    timed events around it."""

    launch_at: float
    enqueued_at: float
    seen_at: float
    gpu_seconds: float


@contextlib.contextmanager
def gpu_copy_times(dd: LLMDataDist) -> Iterator[Callable[[], GpuCopyTimes | None]]:
    """While inside, every GPU copy of ``dd`` runs between timed events; yields a function that returns the
    timestamps of the latest awaitable copy (None before the first).  Raises ``LLM_FEATURE_NOT_ENABLED`` when
    ``dd`` cannot use its GPU."""
    executor = _gpu_executor(dd)

    def latest() -> GpuCopyTimes | None:
        job = executor.last_job
        if job is None:
            return None
        return GpuCopyTimes(job.launch_at, job.enqueued_at, job.seen_at, job.gpu_seconds)

    executor.time_copies = True
    try:
        yield latest
    finally:
        executor.time_copies = False


def time_copy_kernel(dd: LLMDataDist, table: np.ndarray, spans: int, longest: int, nbytes: int, *, block: int,
                     grid: int, runs: int) -> list[float]:
    """Seconds on the GPU of ``runs`` launches, one at a time on ``dd``'s stream, of the copy kernel alone over a
    descriptor table of ``spans`` spans (``table``: their sources, then destinations, then lengths, as uint64
    device addresses and byte counts; ``longest``: the longest; ``nbytes``: their sum), with ``block`` threads
    per CTA and ``grid`` CTAs.  The first launch also stages the table."""
    from ..cuda.kernel_timing import time_kernel

    return time_kernel(_gpu_executor(dd), table, spans, longest, nbytes, block=block, grid=grid, runs=runs)


def _gpu_executor(dd: LLMDataDist) -> CudaExecutor:
    return cast("CudaExecutor", dd.cache_manager._device().executor)  # (the CUDA runtime's executor)
