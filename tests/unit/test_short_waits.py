"""Short jobs are awaited with the event loop polling instead of sleeping in its selector (``Polling``): for
a bounded window, and a window that runs out with waits still pending (the job's threads had no CPU, or it was
slower than expected) leaves the next ones unpolled, more each time.  Every job still completes through its
announcement, polled or not."""

from __future__ import annotations

import asyncio
import os
import selectors
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiodatadist._env_knobs import env_knobs_cache_clear
from aiodatadist.copy import completion
from aiodatadist.copy.completion import MAX_POLL_SKIP, Polling, _short_waits
from aiodatadist.copy.native_pool import NativeExecutor
from aiodatadist.layout import Spans
from aiodatadist.native import CopySpec, native_available


class CountingSelector(selectors.DefaultSelector):
    """The default selector, recording the timeout of every select."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def select(self, timeout: float | None = None) -> Any:
        self.timeouts.append(timeout)
        return super().select(timeout)


@pytest.fixture
def poll_us(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AIODATADIST_POLL_US", "300")
    env_knobs_cache_clear()
    yield
    env_knobs_cache_clear()


def run(main: Any) -> tuple[Any, CountingSelector]:
    selector = CountingSelector()
    loop = asyncio.SelectorEventLoop(selector)
    try:
        return loop.run_until_complete(main()), selector
    finally:
        loop.close()


def set_later(future: asyncio.Future[None], delay: float) -> None:
    loop = future.get_loop()
    timer = threading.Timer(delay, lambda: loop.call_soon_threadsafe(future.set_result, None))
    timer.start()


def test_the_loop_does_not_sleep_while_a_short_wait_is_pending(poll_us: None) -> None:
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        selector = loop._selector  # type: ignore[attr-defined]
        future = loop.create_future()
        _short_waits(loop).watch(future, 10.0)
        before = len(selector.timeouts)
        set_later(future, 0.03)
        await future
        during = selector.timeouts[before:]
        return len(during), sum(1 for t in during if t != 0)

    (polls, sleeps), _ = run(main)
    assert polls > 10 and sleeps == 0


def test_without_a_wait_the_loop_sleeps(poll_us: None) -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        selector = loop._selector  # type: ignore[attr-defined]
        future = loop.create_future()
        before = len(selector.timeouts)
        set_later(future, 0.03)
        await future
        return sum(1 for t in selector.timeouts[before:] if t != 0)

    sleeps, _ = run(main)
    assert sleeps >= 1


def test_a_window_that_runs_out_leaves_the_next_waits_unpolled(poll_us: None) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        waits = _short_waits(loop)
        stuck = loop.create_future()
        waits.watch(stuck, 0.0)  # its window is over at once, the wait still pending
        for _ in range(5):
            await asyncio.sleep(0)
        assert (waits._backoff, waits._skip) == (1, 1)
        skipped = loop.create_future()
        waits.watch(skipped, 10.0)
        assert waits._skip == 0 and waits._pending == 1  # not watched: only `stuck` is
        again = loop.create_future()
        waits.watch(again, 0.0)
        for _ in range(5):
            await asyncio.sleep(0)
        assert (waits._backoff, waits._skip) == (2, 2)
        for future in (stuck, skipped, again):
            future.set_result(None)
        waits._skip = 0
        done = loop.create_future()
        waits.watch(done, 10.0)
        done.set_result(None)
        for _ in range(5):
            await asyncio.sleep(0)
        assert waits._backoff == 0 and waits._pending == 0 and not waits._ticking  # a window where all ended

    run(main)


def test_the_backoff_is_bounded(poll_us: None) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        waits = _short_waits(loop)
        waits._backoff = MAX_POLL_SKIP
        stuck = loop.create_future()
        waits.watch(stuck, 0.0)
        for _ in range(5):
            await asyncio.sleep(0)
        assert waits._backoff == waits._skip == MAX_POLL_SKIP
        stuck.set_result(None)

    run(main)


def test_only_jobs_expected_to_end_within_the_budget_are_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv("AIODATADIST_POLL_US", "300")
        env_knobs_cache_clear()
        assert Polling(2e9).polls(600_000) and not Polling(2e9).polls(600_001)
        monkeypatch.setenv("AIODATADIST_POLL_US", "0")
        env_knobs_cache_clear()
        off = Polling(2e9)
        assert not off.polls(1)

        async def main() -> None:
            future = asyncio.get_running_loop().create_future()
            off.watch(future, 1)
            assert completion._by_loop.get(asyncio.get_running_loop()) is None  # never watched
            future.set_result(None)

        run(main)
    finally:
        env_knobs_cache_clear()


@pytest.mark.skipif(not native_available(), reason="the native helper is not built")
def test_polled_and_unpolled_copy_jobs_land_every_byte(poll_us: None) -> None:
    rng = np.random.default_rng(5)
    big_src, big_dst = rng.integers(1, 256, 64 << 20, dtype=np.uint8), np.zeros(64 << 20, dtype=np.uint8)
    src = rng.integers(1, 256, (3, 256 << 10), dtype=np.uint8)
    dst = np.zeros_like(src)
    executor = NativeExecutor(workers=1)  # reads the budget (the fixture set it)

    def spans(a: np.ndarray, b: np.ndarray) -> Spans:
        return Spans(np.array([a.ctypes.data], dtype=np.uint64), np.array([b.ctypes.data], dtype=np.uint64),
                     np.array([a.nbytes], dtype=np.uint64))

    async def main() -> None:
        copier = CopySpec(pid=os.getpid())
        waits = _short_waits(asyncio.get_running_loop())
        assert executor.polling is not None
        assert executor.polling.polls(src[0].nbytes) and not executor.polling.polls(big_src.nbytes)
        busy = executor.start(spans(big_src, big_dst), copier, chunk_bytes=64 << 20)  # the only worker
        assert waits._pending == 0  # too big to be polled for
        jobs = [executor.start(spans(src[i], dst[i]), copier) for i in range(3)]  # queued behind it
        await asyncio.gather(executor.wait(busy), *(executor.wait(job) for job in jobs))
        assert np.array_equal(dst, src) and np.array_equal(big_dst, big_src)
        assert waits._pending == 0

    try:
        run(main)
    finally:
        executor.shutdown()
