"""Timing awaited calls, progress lines and SIGTERM handling, for the benchmarks."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

__all__ = ["exit_on_sigterm", "interleaved_times", "stderr_progress", "times"]


def stderr_progress(quiet: bool = False, started: float | None = None) -> Callable[[str], None]:
    """A progress callback writing ``[seconds since started] line`` to stderr (nothing when ``quiet``)."""
    origin = time.perf_counter() if started is None else started

    def progress(line: str) -> None:
        if not quiet:
            sys.stderr.write(f"[{time.perf_counter() - origin:6.1f} s] {line}\n")
            sys.stderr.flush()

    return progress


def exit_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM handler that raises ``SystemExit``, so that ``finally`` clauses stop servers and engines."""
    raise SystemExit(128 + signum)


async def times(fn: Callable[[], Awaitable[Any]], repeat: int, warmup: int = 1, *,
                idle: float | None = None) -> list[float]:
    """Seconds per call of ``fn``, ``repeat`` calls after ``warmup`` ones; ``idle``: the event loop sleeps this many
    seconds before each call (not timed)."""
    for _ in range(warmup):
        await fn()
    out = []
    for _ in range(repeat):
        if idle is not None:
            await asyncio.sleep(idle)
        start = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - start)
    return out


async def interleaved_times(fns: Sequence[Callable[[], Awaitable[Any]]], repeat: int, warmup: int = 1
                            ) -> list[list[float]]:
    """Seconds per call of each of ``fns``, called in turn ``repeat`` times after ``warmup`` turns: the machine's
    minute-to-minute noise falls on every one alike, so their differences hold where their levels move."""
    for _ in range(warmup):
        for fn in fns:
            await fn()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, samples in zip(fns, out):
            start = time.perf_counter()
            await fn()
            samples.append(time.perf_counter() - start)
    return out
