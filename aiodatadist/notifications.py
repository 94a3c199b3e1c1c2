"""Notifications: small messages a linked peer receives, with a transfer or on their own.

A transfer started with ``notify=b"..."`` (``pull_cache``/``pull_blocks``/``push_cache``/``push_blocks``) delivers
that message to the OWNER of the remote cache (the other side) once the transfer completed successfully, and never
for a failed, cancelled or timed-out one; ``await dd.notify(cluster_id, message)`` sends one directly over a link.
The receiver reads them with ``async for n in dd.notifications()`` (or, blocking, ``aiodatadist.sync``).

Each instance queues at most :data:`MAX_QUEUED_NOTIFICATIONS`; what arrives while the queue is full is dropped
(counted in ``dd.stats()``, a warning logged once per instance), so that a consumer that falls behind never blocks
the control plane.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from .protocol.messages import MAX_NOTE_BYTES
from .stats import StatsRecorder

__all__ = ["MAX_NOTIFICATION_BYTES", "MAX_QUEUED_NOTIFICATIONS", "Notification", "NotificationInbox",
           "check_notification"]

log = logging.getLogger("aiodatadist.notifications")

MAX_NOTIFICATION_BYTES = MAX_NOTE_BYTES
"""Size limit of one notification's message (4 KiB)."""
MAX_QUEUED_NOTIFICATIONS = 1024
"""Notifications an instance queues for its consumer; more are dropped (and counted) until it catches up."""


@dataclass(frozen=True, slots=True)
class Notification:
    """A notification received from linked cluster ``cluster_id``."""

    cluster_id: int
    message: bytes


def check_notification(name: str, value: Any, *, allow_none: bool = True) -> bytes | None:
    """``TypeError`` unless ``value`` is ``bytes`` (or None when allowed), ``ValueError`` if it is longer than
    :data:`MAX_NOTIFICATION_BYTES`."""
    if value is None and allow_none:
        return None
    if type(value) is not bytes:
        allowed = "['bytes', 'NoneType']" if allow_none else "['bytes']"
        raise TypeError(f"{name} only support {allowed}, but got {type(value)}.")
    if len(value) > MAX_NOTIFICATION_BYTES:
        raise ValueError(f"{name} has {len(value)} bytes, more than the limit of {MAX_NOTIFICATION_BYTES}.")
    return value


class NotificationInbox:
    """The notifications one initialized instance received and its consumers have not taken yet (event loop
    thread only).  :meth:`close` (``finalize``) ends every iterator, after what was queued."""

    def __init__(self, stats: StatsRecorder, capacity: int = MAX_QUEUED_NOTIFICATIONS) -> None:
        self._stats = stats
        self._capacity = capacity
        self._queue: collections.deque[Notification] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._warned = False
        self.closed = False

    def __len__(self) -> int:
        return len(self._queue)

    def deliver(self, cluster_id: int, message: bytes) -> bool:
        """Queue a notification that arrived from ``cluster_id`` (never blocks); False if it was dropped."""
        if self.closed or len(self._queue) >= self._capacity:
            self._stats.notification_dropped(cluster_id)
            if not self.closed and not self._warned:
                self._warned = True
                log.warning("the notification queue is full (%d): notifications are dropped until the consumer of "
                            "notifications() catches up (counted in stats())", self._capacity)
            return False
        self._queue.append(Notification(cluster_id, message))
        self._stats.notification_received(cluster_id)
        self._wake_one()
        return True

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def get(self) -> Notification | None:
        """The next notification, waiting for one; None once the inbox is closed and empty."""
        while True:
            if self._queue:
                return self._queue.popleft()
            if self.closed:
                return None
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then cancelled: another consumer gets the notification
                else:
                    waiter.cancel()
                raise

    async def iterate(self) -> AsyncIterator[Notification]:
        """Every notification, in arrival order, until :meth:`close` (consumers share the queue)."""
        while True:
            notification = await self.get()
            if notification is None:
                return
            yield notification

    def close(self) -> None:
        """No more notifications are queued; consumers get what is queued, then their iterators end."""
        self.closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
