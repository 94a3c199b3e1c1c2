"""The shared completion mechanisms (settle, wait through cancellation, the notify pipe) and TaskSet's ownership
of its tasks' failures: no sockets, no peers."""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from aiodatadist._aio import settle, wait_through_cancellation
from aiodatadist.control.channel import TaskSet
from aiodatadist.jobs.completion import NotifyPipe


async def test_settle_once() -> None:
    loop = asyncio.get_running_loop()
    ok, failed = loop.create_future(), loop.create_future()
    settle(ok)
    settle(ok, RuntimeError("late"))  # already done: ignored
    settle(failed, ValueError("boom"))
    assert ok.result() is None
    with pytest.raises(ValueError, match="boom"):
        failed.result()
    cancelled = loop.create_future()
    cancelled.cancel()
    settle(cancelled, RuntimeError("after its waiter went"))  # no InvalidStateError
    assert cancelled.cancelled()


async def test_wait_through_cancellation_outlasts_cancellations() -> None:
    done = asyncio.Event()
    log: list[str] = []

    async def guarded() -> int:
        await done.wait()
        log.append("guarded ended")
        return 7

    waiter = asyncio.ensure_future(wait_through_cancellation(guarded()))
    for _ in range(3):  # any number of cancellations: the waiter still waits for the end
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.sleep(0)
        assert not waiter.done()
    done.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert log == ["guarded ended"]  # ended before the cancellation surfaced


async def test_wait_through_cancellation_result_error_and_timeout() -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()
    loop.call_later(0.01, future.set_result, 3)
    assert await wait_through_cancellation(future) == 3

    async def fails() -> None:
        raise ValueError("its own error")

    with pytest.raises(ValueError, match="its own error"):
        await wait_through_cancellation(fails())

    # asyncio.timeout still becomes TimeoutError, after the guarded work ended (no swallowed cancellation)
    slow: asyncio.Future[None] = loop.create_future()
    started = loop.time()  # (before the timer is armed: a lower bound however late this thread runs)
    loop.call_later(0.05, settle, slow, ValueError("failed too"))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await wait_through_cancellation(slow)
    assert slow.done() and loop.time() - started >= 0.04


async def test_an_anyio_shield_does_not_stop_asyncio_cancellation() -> None:
    """Why wait_through_cancellation is not ``anyio.CancelScope(shield=True)``: asyncio.timeout (and
    Task.cancel) go through it."""
    finished = False

    async def shielded() -> None:
        nonlocal finished
        with anyio.CancelScope(shield=True):
            await asyncio.sleep(0.1)
            finished = True

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await shielded()
    assert not finished


async def test_notify_pipe_delivers_handles_in_order() -> None:
    loop = asyncio.get_running_loop()
    seen: list[int] = []
    got = asyncio.Event()

    def on_handle(handle: int) -> None:
        seen.append(handle)
        if len(seen) == 3:
            got.set()

    pipe = NotifyPipe(loop, on_handle)
    try:
        os.write(pipe.fd, struct.pack("<Q", 5) + struct.pack("<Q", 2**64 - 1))
        os.write(pipe.fd, struct.pack("<Q", 1))
        await asyncio.wait_for(got.wait(), 5)
        assert seen == [5, 2**64 - 1, 1]
    finally:
        pipe.close()
    with pytest.raises(OSError):
        os.fstat(pipe.read_fd)


async def test_taskset_close_cancels_everything_and_raises_unhandled_failures() -> None:
    tasks = TaskSet()
    handled: list[BaseException] = []

    async def fail(error: Exception) -> None:
        raise error

    async def forever() -> None:
        await asyncio.Event().wait()

    async def spawns_on_cancel() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            tasks.spawn(forever(), name="spawned-while-closing")

    tasks.spawn(fail(LookupError("expected")), name="handled", on_error=handled.append)
    tasks.spawn(fail(ValueError("a bug")), name="unhandled")
    tasks.spawn(fail(KeyError("bad handler")), name="bad-handler", on_error=lambda exc: 1 / 0)
    running = [tasks.spawn(forever(), name="forever"), tasks.spawn(spawns_on_cancel(), name="spawner")]
    await asyncio.sleep(0.01)
    assert [type(e) for e in handled] == [LookupError]
    with pytest.raises(ExceptionGroup) as raised:
        await tasks.close()
    assert sorted(type(e).__name__ for e in raised.value.exceptions) == ["ValueError", "ZeroDivisionError"]
    assert all(t.done() for t in running)
    assert not tasks._tasks  # the task spawned while closing was cancelled and awaited too
    await tasks.close()  # the failures were raised once


async def test_taskset_close_without_failures_returns() -> None:
    tasks = TaskSet()
    tasks.spawn(asyncio.sleep(10), name="sleeper")
    tasks.spawn(asyncio.sleep(0), name="quick")
    await asyncio.sleep(0.01)
    await tasks.close()


_ENDED_JUST_BEFORE = """
import asyncio
from aiodatadist.control.channel import TaskSet

async def main():
    tasks = TaskSet()
    gate = asyncio.get_running_loop().create_future()
    async def waits() -> None:
        await gate

    ended = tasks.spawn(waits(), name="ends-just-before")
    await asyncio.sleep(0)  # it runs up to the gate
    gate.set_result(None)
    await asyncio.sleep(0)  # the task ends in this iteration; its done callback runs in the next one
    assert ended.done() and ended in tasks._tasks
    await tasks.close()
    assert not tasks._tasks

asyncio.run(main())
print("closed")
"""


def test_taskset_close_returns_when_a_task_ended_just_before_it() -> None:
    """A task that ended but whose done callback has not run yet is still in the set: close() must let the loop
    run that callback (from Python 3.12 a gather of ended tasks returns without yielding, and close() spun
    forever).  In a child process, so that a spinning loop fails the test instead of hanging it."""
    done = subprocess.run([sys.executable, "-c", _ENDED_JUST_BEFORE], check=False, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "closed"


async def test_in_thread_runs_off_the_loop_until_the_interpreter_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Teardown work goes to a thread, except while the interpreter shuts its threads down (exit hooks), when
    Python 3.12+ refuses to start one: then it runs on the loop's own thread, once."""
    import threading

    from aiodatadist import _aio

    calls: list[int] = []

    def work(tag: int) -> int:
        calls.append(threading.get_ident())
        return tag * 2

    assert await _aio.in_thread(work, 21) == 42
    assert calls == [calls[0]] and calls[0] != threading.get_ident()
    monkeypatch.setattr(threading, "_SHUTTING_DOWN", True, raising=False)
    assert _aio.exiting()
    assert await _aio.in_thread(work, 5) == 10
    assert calls[1:] == [threading.get_ident()]


def test_a_cancelled_background_task_lets_go_of_the_frames_that_ran_it() -> None:
    """A task cancelled and kept (its owner's attribute) must not keep the frames of whoever ran the loop when it
    ended: their locals may hold anything (asyncio.run's cancel-all holds every task of the loop, so one
    unfinalized instance kept every other one alive).  The task's ``CancelledError`` is handed over at its end.
    (Python 3.11 does not keep them: this fails without that only on 3.12+.)"""
    import gc
    import weakref

    from aiodatadist.control.channel import TaskSet

    class Held:
        pass

    def run_and_cancel() -> tuple[asyncio.Task[object], weakref.ref[Held]]:
        held = Held()  # a local of the frame that runs the loop when the task ends
        loop = asyncio.new_event_loop()
        tasks = TaskSet()

        async def start() -> asyncio.Task[object]:
            return tasks.spawn(asyncio.Event().wait(), name="kept")

        task = loop.run_until_complete(start())
        task.cancel()
        loop.run_until_complete(asyncio.sleep(0.01))
        loop.close()
        return task, weakref.ref(held)

    task, held = run_and_cancel()
    gc.collect()
    assert task.cancelled()
    assert held() is None
