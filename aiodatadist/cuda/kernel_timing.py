"""The copy kernel alone, timed on the GPU: launches of a descriptor table in a chosen geometry, between timed
events on an executor's stream (no host time in the figure).  For the benchmarks' kernel sweep
(``aiodatadist.testing.probes.time_copy_kernel``); transfers never call it.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..errors import LLMException, LLMStatusCode
from .completion import Work
from .executor import CudaExecutor

__all__ = ["time_kernel"]


def time_kernel(executor: CudaExecutor, table: np.ndarray, spans: int, longest: int, nbytes: int, *,
                block: int, grid: int, runs: int) -> list[float]:
    """Seconds on the GPU of each of ``runs`` launches, one at a time, of the copy kernel over ``table`` (``spans``
    sources, then as many destinations, then lengths, uint64; ``longest``: the longest span; ``nbytes``: their
    sum) with ``block`` threads per CTA and ``grid`` CTAs.  The first launch also stages the table."""
    launch = executor.launches.table_launch(nbytes, table.copy(), spans, longest)  # (it makes its table read-only)
    launch.block, launch.grid = block, grid
    driver = executor.device.driver
    start, end = executor._record_event(timed=True), executor._record_event(timed=True)
    try:
        if start is None or end is None:
            raise LLMException("no timed CUDA event could be recorded", status_code=LLMStatusCode.LLM_FAILED)
        seconds = []
        for _ in range(runs):
            work = Work()
            driver.call("cuEventRecord", start, executor._stream)
            executor._submit(launch, work)
            driver.call("cuEventRecord", end, executor._stream)
            work.stopped.wait()
            driver.call("cuEventSynchronize", end)
            work._take_status()
            if work.error is not None:
                raise work.error
            elapsed = ctypes.c_float()
            driver.call("cuEventElapsedTime_v2", ctypes.byref(elapsed), start, end)
            seconds.append(elapsed.value / 1e3)
        return seconds
    finally:
        executor.device.synchronize()
        for event in (start, end):
            if event is not None:
                executor._timed_events.append(event)
