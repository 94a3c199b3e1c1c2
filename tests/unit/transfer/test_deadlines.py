"""``_deadlines.deadline``: the per-transfer ``asyncio.timeout``, with one shared timer per loop; it must expire,
cancel and nest exactly as ``asyncio.timeout`` does."""

from __future__ import annotations

import asyncio

import pytest

from aiodatadist._deadlines import _timers, deadline


async def test_a_block_that_ends_in_time_is_left_alone() -> None:
    async with deadline(5):
        await asyncio.sleep(0.001)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0.01)  # no stray cancellation arrives later


async def test_an_expired_block_raises_timeout_error_and_the_task_goes_on() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError):
        async with deadline(0.02):
            await asyncio.sleep(10)
    assert 0.015 <= loop.time() - start < 5  # expired, not slept out (on a loaded machine, late)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0.001)  # still usable


@pytest.mark.parametrize("delay", [0, -1])
async def test_a_deadline_already_past_expires_at_the_first_await(delay: float) -> None:
    with pytest.raises(TimeoutError):
        async with deadline(delay):
            await asyncio.sleep(1)


async def test_an_outside_cancellation_stays_a_cancellation() -> None:
    entered = asyncio.Event()

    async def body() -> None:
        async with deadline(10):
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(body())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_many_deadlines_expire_in_their_own_order_with_one_timer() -> None:
    """Deadlines entered in any order, some left early: each block ends at its own deadline, none early.  (The
    blocks left early leave seconds before their deadlines: a loop held up for a while on a loaded machine,
    then finding a block's sleep and its deadline both due, expires it, as ``asyncio.timeout`` would.)"""
    loop = asyncio.get_running_loop()
    delays = [9.0, 0.03, 0.06, 0.12, 0.015, 8.0]
    ended: dict[float, float] = {}

    async def body(delay: float, leave_after: float | None) -> None:
        start = loop.time()
        try:
            async with deadline(delay):
                await asyncio.sleep(leave_after if leave_after is not None else 10)
        except TimeoutError:
            ended[delay] = loop.time() - start

    leaving = {9.0: 0.01, 8.0: 0.02}  # these finish before their deadline (the first one armed the timer)
    await asyncio.gather(*(body(d, leaving.get(d)) for d in delays))
    assert set(ended) == set(delays) - set(leaving)
    for delay, took in ended.items():
        assert took >= delay - 0.002, (delay, took)
    timer = _timers[loop]
    assert not timer._pending  # every entry left


async def test_nested_deadlines_the_inner_one_expiring() -> None:
    async with deadline(10):
        with pytest.raises(TimeoutError):
            async with deadline(0.01):
                await asyncio.sleep(10)
        await asyncio.sleep(0.001)


async def test_nested_deadlines_the_outer_one_expiring() -> None:
    with pytest.raises(TimeoutError):
        async with deadline(0.01):
            try:
                async with deadline(10):
                    await asyncio.sleep(10)
            except TimeoutError:
                pytest.fail("the inner deadline did not expire")


async def test_the_plain_with_form_expires_and_nests_as_the_async_one() -> None:
    with pytest.raises(TimeoutError), deadline(10):
        with deadline(0.02):
            await asyncio.sleep(10)
        raise AssertionError("the inner deadline's TimeoutError must leave the outer block")
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    with deadline(5):
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)  # no stray cancellation arrives later


def test_a_finished_loop_is_not_kept_alive_by_its_deadlines() -> None:
    """The per-loop timers are keyed weakly by loop and hold none themselves: a loop that used deadlines and
    ended is collected (a loop keeps its selector and every callback it knew)."""
    import gc
    import weakref

    async def use() -> None:
        with deadline(5):
            await asyncio.sleep(0)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(use())
    loop.close()
    ref = weakref.ref(loop)
    del loop
    gc.collect()
    assert ref() is None
