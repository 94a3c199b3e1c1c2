"""Timing awaited calls, for the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["times"]


async def times(fn: Callable[[], Awaitable[Any]], repeat: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn``, ``repeat`` calls after ``warmup`` ones."""
    for _ in range(warmup):
        await fn()
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - start)
    return out
