"""Short jobs are awaited with the event loop polling instead of sleeping in its selector (``Polling``): for
a bounded window, and a wait that outlasts it (the job's threads had no CPU, or it was slower than expected)
leaves the next ones unpolled, more each time.  The waiter asks its job whether it ended, in its own task
(``Polling.poll``), at most ``MAX_POLLERS`` at a time.  Every job still completes through its announcement, polled
or not."""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiodatadist.copy.native_pool import NativeExecutor, NativeJob
from aiodatadist.jobs.completion import MAX_POLL_SKIP, MAX_POLLERS, Polling, _short_waits
from aiodatadist.layout.plans import Spans
from aiodatadist.native import CopySpec, native_available
from aiodatadist.settings.environment import env_knobs_cache_clear


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


@pytest.fixture
def long_windows(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Windows of 2 x 100 ms: a polled wait outlasts its window only if the job's thread got no CPU for that long,
    however busy the machine is (with 300 us, a loaded machine leaves most waits unpolled)."""
    monkeypatch.setenv("AIODATADIST_POLL_US", "100000")
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


def test_the_loop_does_not_sleep_while_a_short_wait_is_polled_for(poll_us: None) -> None:
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        selector = loop._selector  # type: ignore[attr-defined]
        future = loop.create_future()
        before = len(selector.timeouts)
        polling = Polling(2e9)
        polling.budget = 10.0  # a window longer than the wait
        set_later(future, 0.03)  # settled by another thread, as a job's announcement settles its future
        await polling.poll(future.done)
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


def test_the_backoff_doubles_up_to_its_bound_and_a_wait_in_time_resets_it(poll_us: None) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        polling = Polling(2e9)
        waits = _short_waits(loop)
        expected = 0
        for _ in range(14):
            polling.budget = 0.0  # the window is over at once
            waits._skip = 0
            await polling.poll(lambda: False)
            expected = min(MAX_POLL_SKIP, max(1, 2 * expected))
            assert waits._backoff == waits._skip == expected
        assert expected == MAX_POLL_SKIP
        polling.budget = 10.0
        waits._skip = 0
        await polling.poll(lambda: True)
        assert waits._backoff == 0

    run(main)


def test_only_jobs_expected_to_end_within_the_budget_are_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv("AIODATADIST_POLL_US", "300")
        env_knobs_cache_clear()
        assert Polling(2e9).polls(600_000) and not Polling(2e9).polls(600_001)
        monkeypatch.setenv("AIODATADIST_POLL_US", "0")
        env_knobs_cache_clear()
        assert not Polling(2e9).polls(1)
    finally:
        env_knobs_cache_clear()


class Countdown:
    """A job's ``ended`` that says True at its ``n``-th call, settling the job's future then."""

    def __init__(self, future: asyncio.Future[None], n: int) -> None:
        self.future, self.left, self.calls = future, n, 0

    def __call__(self) -> bool:
        self.calls += 1
        self.left -= 1
        if self.left > 0:
            return False
        if not self.future.done():
            self.future.set_result(None)
        return True


def test_a_polling_waiter_asks_its_job_every_iteration_and_never_lets_the_loop_sleep(poll_us: None) -> None:
    async def main() -> tuple[int, list[float | None]]:
        loop = asyncio.get_running_loop()
        selector = loop._selector  # type: ignore[attr-defined]
        future = loop.create_future()
        ended = Countdown(future, 50)
        before = len(selector.timeouts)
        polling = Polling(2e9)
        polling.budget = 10.0  # a window longer than the wait (50 iterations outlast 600 us on a loaded machine)
        await polling.poll(ended)
        assert future.done() and _short_waits(loop).pollers == 0
        return ended.calls, selector.timeouts[before:]

    (calls, timeouts), _ = run(main)
    assert calls == 50
    assert len(timeouts) == 49 and all(t == 0 for t in timeouts)  # one iteration between two questions


def test_a_poll_whose_window_runs_out_returns_and_leaves_the_next_waits_unpolled(poll_us: None) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        polling = Polling(2e9)
        polling.budget = 0.0  # every window is over at once
        waits = _short_waits(loop)
        stuck = loop.create_future()
        never = Countdown(stuck, 10**9)
        await polling.poll(never)
        assert never.calls == 1 and not stuck.done()  # asked once, then left to its future
        assert (waits._backoff, waits._skip, waits.pollers) == (1, 1, 0)
        skipped = Countdown(loop.create_future(), 10**9)
        await polling.poll(skipped)
        assert skipped.calls == 0 and waits._skip == 0  # not polled for: left to its future
        polling.budget = 10.0
        ok = Countdown(loop.create_future(), 3)
        await polling.poll(ok)
        assert ok.calls == 3 and waits._backoff == 0  # polled, and in time: the backoff is reset

    run(main)


class Gate:
    """A job's ``ended`` that says True once opened, settling the job's future then."""

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future, self.open, self.calls = future, False, 0

    def __call__(self) -> bool:
        self.calls += 1
        if self.open and not self.future.done():
            self.future.set_result(None)
        return self.open


def test_at_most_max_pollers_tasks_poll_at_once(poll_us: None) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        polling = Polling(2e9)
        polling.budget = 10.0  # windows longer than the test (five iterations may outlast 600 us)
        gates = [Gate(loop.create_future()) for _ in range(MAX_POLLERS + 3)]
        tasks = [asyncio.create_task(polling.poll(gate)) for gate in gates]
        for _ in range(5):
            await asyncio.sleep(0)
        assert _short_waits(loop).pollers == MAX_POLLERS
        assert sum(gate.calls > 1 for gate in gates) == MAX_POLLERS  # the others were asked once, then left
        assert sum(task.done() for task in tasks) == 3
        for gate in gates:
            gate.open = True
        await asyncio.gather(*tasks)
        assert _short_waits(loop).pollers == 0 and all(gate.future.done() for gate in gates[:MAX_POLLERS])

    run(main)


def test_a_cancelled_poll_lets_go_of_its_place(poll_us: None) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate = Gate(loop.create_future())
        polling = Polling(2e9)
        polling.budget = 10.0  # a window longer than the test (three iterations may outlast 600 us)
        task = asyncio.create_task(polling.poll(gate))
        for _ in range(3):
            await asyncio.sleep(0)
        assert _short_waits(loop).pollers == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _short_waits(loop).pollers == 0 and not gate.future.done()

    run(main)


@pytest.mark.skipif(not native_available(), reason="the native helper is not built")
def test_polled_and_unpolled_copy_jobs_land_every_byte(poll_us: None) -> None:
    rng = np.random.default_rng(5)
    big_src, big_dst = rng.integers(1, 256, 64 << 20, dtype=np.uint8), np.zeros(64 << 20, dtype=np.uint8)
    src = rng.integers(1, 256, (3, 256 << 10), dtype=np.uint8)
    dst = np.zeros_like(src)
    executor = NativeExecutor(workers=1)  # reads the budget (the fixture set it)
    executor.cpus = 2  # a CPU left for the polling loop, on any machine (with one, no job is polled)

    def spans(a: np.ndarray, b: np.ndarray) -> Spans:
        return Spans(np.array([a.ctypes.data], dtype=np.uint64), np.array([b.ctypes.data], dtype=np.uint64),
                     np.array([a.nbytes], dtype=np.uint64))

    async def main() -> None:
        copier = CopySpec(pid=os.getpid())
        waits = _short_waits(asyncio.get_running_loop())
        assert executor.polling is not None
        assert executor.polling.polls(src[0].nbytes) and not executor.polling.polls(big_src.nbytes)
        busy = executor.start(spans(big_src, big_dst), copier, chunk_bytes=64 << 20)  # the only worker
        assert not busy.polled  # too big to be polled for
        jobs = [executor.start(spans(src[i], dst[i]), copier) for i in range(3)]  # queued behind it
        assert all(job.polled for job in jobs)  # their windows run out behind `busy`: their futures end them
        await asyncio.gather(executor.wait(busy), *(executor.wait(job) for job in jobs))
        assert np.array_equal(dst, src) and np.array_equal(big_dst, big_src)
        assert waits.pollers == 0

    try:
        run(main)
    finally:
        executor.shutdown()


@pytest.mark.skipif(not native_available(), reason="the native helper is not built")
def test_polled_jobs_one_after_another_each_land_before_their_wait_returns(long_windows: None,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A polled job is reaped by its waiter; its announcement is read later, when the helper may have handed the
    same address to the next job: that job must not be taken for ended before it is."""
    rng = np.random.default_rng(6)
    executor = NativeExecutor(workers=1)
    executor.cpus = 2  # a CPU left for the polling loop, on any machine (with one, no job is polled)
    asked = NativeJob.ended
    by_waiter = 0

    def ended(job: NativeJob) -> bool:
        nonlocal by_waiter
        done = asked(job)
        by_waiter += done
        return done

    monkeypatch.setattr(NativeJob, "ended", ended)

    async def main() -> None:
        copier = CopySpec(pid=os.getpid())
        for round_ in range(300):
            src = rng.integers(1, 256, 64 << 10, dtype=np.uint8)
            dst = np.zeros_like(src)
            job: NativeJob = executor.start(Spans(np.array([src.ctypes.data], dtype=np.uint64),
                                                  np.array([dst.ctypes.data], dtype=np.uint64),
                                                  np.array([src.nbytes], dtype=np.uint64)), copier)
            assert job.polled
            await executor.wait(job)
            assert job.stopped.is_set() and np.array_equal(dst, src), round_
            assert not executor._notifiers[asyncio.get_running_loop()].jobs  # reaped, whoever did it

    try:
        run(main)
        assert by_waiter > 0  # some were reaped by their waiters, before their announcement was read
    finally:
        executor.shutdown()


@pytest.mark.skipif(not native_available(), reason="the native helper is not built")
def test_a_polled_wait_cancelled_returns_only_once_the_pool_let_go_of_the_job(poll_us: None) -> None:
    executor = NativeExecutor(workers=1)
    executor.cpus = 2  # a CPU left for the polling loop, on any machine (with one, no job is polled)
    rng = np.random.default_rng(7)
    src = rng.integers(1, 256, (64, 32 << 10), dtype=np.uint8)
    dst = np.zeros_like(src)

    async def main() -> None:
        spans = Spans(np.array([row.ctypes.data for row in src], dtype=np.uint64),
                      np.array([row.ctypes.data for row in dst], dtype=np.uint64),
                      np.full(len(src), src.shape[1], dtype=np.uint64))
        for round_ in range(50):
            job: NativeJob = executor.start(spans, CopySpec(pid=os.getpid()))
            assert job.polled
            waiter = asyncio.create_task(executor.wait(job))
            for _ in range(1 + round_ % 4):  # cut short while polling, at different points of the copy
                await asyncio.sleep(0)
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
            assert job.stopped.is_set() and job.handle is None  # no worker touches dst any more
            dst[:] = 0
            await asyncio.sleep(0.001)
            assert not dst.any(), round_  # nothing of it lands after the wait returned

    try:
        run(main)
    finally:
        executor.shutdown()
