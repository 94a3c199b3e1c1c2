"""The notification inbox and argument checks, without links (the wire forms are in test_protocol_messages.py, the
deliveries with real links in integration/test_notifications.py)."""

from __future__ import annotations

import asyncio

import pytest

from aiodatadist.notifications import (
    MAX_NOTIFICATION_BYTES,
    MAX_QUEUED_NOTIFICATIONS,
    Notification,
    NotificationInbox,
    check_notification,
)
from aiodatadist.protocol.messages import MAX_NOTE_BYTES
from aiodatadist.stats import NotificationStats, StatsRecorder


def test_checks() -> None:
    assert MAX_NOTIFICATION_BYTES == MAX_NOTE_BYTES == 4096 and MAX_QUEUED_NOTIFICATIONS == 1024
    assert check_notification("notify", None) is None
    assert check_notification("notify", b"") == b""
    assert check_notification("notify", b"x" * 4096) == b"x" * 4096
    with pytest.raises(ValueError, match="4097 bytes"):
        check_notification("notify", b"x" * 4097)
    for bad in ("x", bytearray(b"x"), memoryview(b"x"), 1, [b"x"]):
        with pytest.raises(TypeError, match="notify only support"):
            check_notification("notify", bad)
    with pytest.raises(TypeError):
        check_notification("message", None, allow_none=False)


async def test_the_inbox_queues_in_order_drops_when_full_and_ends_on_close() -> None:
    stats = StatsRecorder()
    inbox = NotificationInbox(stats, capacity=3)
    assert [inbox.deliver(5, b"%d" % i) for i in range(5)] == [True, True, True, False, False]
    inbox.deliver(6, b"other")
    assert stats.snapshot().notifications == (NotificationStats(5, 0, 3, 2), NotificationStats(6, 0, 0, 1))
    assert await inbox.get() == Notification(5, b"0")
    waiting = asyncio.ensure_future(asyncio.gather(inbox.get(), inbox.get(), inbox.get()))
    await asyncio.sleep(0)
    assert inbox.deliver(6, b"late")
    got = await waiting
    assert got == [Notification(5, b"1"), Notification(5, b"2"), Notification(6, b"late")]
    consumers = [asyncio.ensure_future(_drain(inbox)) for _ in range(2)]
    await asyncio.sleep(0)
    inbox.deliver(7, b"a")
    await asyncio.sleep(0)
    inbox.close()
    results = await asyncio.wait_for(asyncio.gather(*consumers), 10)
    assert sorted(results, key=len) == [[], [Notification(7, b"a")]]
    assert not inbox.deliver(7, b"after close")  # dropped and counted, no warning
    assert stats.snapshot().notifications_of(7) == NotificationStats(7, 0, 1, 1)
    assert await inbox.get() is None


async def test_a_cancelled_consumer_passes_its_notification_on() -> None:
    inbox = NotificationInbox(StatsRecorder())
    first = asyncio.ensure_future(inbox.get())
    second = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    inbox.deliver(1, b"x")  # wakes the first consumer ...
    first.cancel()  # ... which is cancelled before it runs: the second one gets it
    assert await asyncio.wait_for(second, 10) == Notification(1, b"x")


async def _drain(inbox: NotificationInbox) -> list[Notification]:
    return [n async for n in inbox.iterate()]
