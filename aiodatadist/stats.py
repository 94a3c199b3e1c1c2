"""Transfer statistics: per remote cluster and direction, recorded by the requesting side.

``LLMDataDist.stats()`` returns a :class:`StatsSnapshot`: frozen values that later transfers do not change.
Latency percentiles come from the most recent :data:`LATENCY_WINDOW` transfers of each entry.  Only the side
that calls ``pull_*``/``push_*`` records a transfer (a same-host transfer by an already-resolved key does not
involve the owner at all).  Notifications (see :mod:`aiodatadist.notifications`) are counted per remote cluster
on both sides: sent by the sender, received or dropped (queue full, or arriving during ``finalize``) by the
receiver.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

__all__ = ["LATENCY_WINDOW", "LinkStats", "NotificationStats", "StatsRecorder", "StatsSnapshot"]

LATENCY_WINDOW = 4096


@dataclass(frozen=True, slots=True)
class LinkStats:
    """One remote cluster and direction (``"pull"``: bytes came in, ``"push"``: bytes went out)."""

    remote_cluster_id: int
    direction: str
    plane: str  # the link's data plane at the last transfer: "shm" or "tcp"
    operations: int  # transfers started
    succeeded: int
    bytes: int  # bytes moved by transfers that succeeded
    failures: Mapping[str, int]  # status code name (or "CANCELLED") -> count
    latency_p50_ms: float  # of the last LATENCY_WINDOW transfers, failed ones included
    latency_p90_ms: float
    latency_p99_ms: float
    latency_max_ms: float


@dataclass(frozen=True, slots=True)
class NotificationStats:
    """Notifications exchanged with one remote cluster: ``sent`` to it (handed to the link: with a successful
    transfer, or by ``notify``), ``received`` from it (queued for ``notifications()``) and ``dropped`` (arrived
    while the queue was full, or during ``finalize``)."""

    remote_cluster_id: int
    sent: int = 0
    received: int = 0
    dropped: int = 0


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """Statistics of one ``LLMDataDist`` at one moment."""

    links: tuple[LinkStats, ...] = ()
    notifications: tuple[NotificationStats, ...] = ()

    def get(self, remote_cluster_id: int, direction: str) -> LinkStats | None:
        """The entry of one remote cluster and direction, if it moved anything yet."""
        for entry in self.links:
            if entry.remote_cluster_id == remote_cluster_id and entry.direction == direction:
                return entry
        return None

    def notifications_of(self, remote_cluster_id: int) -> NotificationStats:
        """The notifications exchanged with one remote cluster (all zero if none yet)."""
        for entry in self.notifications:
            if entry.remote_cluster_id == remote_cluster_id:
                return entry
        return NotificationStats(remote_cluster_id)

    @property
    def total_bytes(self) -> int:
        return sum(entry.bytes for entry in self.links)


@dataclass(eq=False)
class _Entry:
    plane: str = ""
    operations: int = 0
    succeeded: int = 0
    bytes: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    latencies: np.ndarray = field(default_factory=lambda: np.zeros(LATENCY_WINDOW))
    recorded: int = 0


class StatsRecorder:
    """Accumulates transfers of one instance (event loop thread only)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], _Entry] = {}
        self._notes: dict[int, list[int]] = {}  # remote cluster -> [sent, received, dropped]

    def _note(self, remote_cluster_id: int, which: int) -> None:
        counts = self._notes.get(remote_cluster_id)
        if counts is None:
            counts = self._notes[remote_cluster_id] = [0, 0, 0]
        counts[which] += 1

    def notification_sent(self, remote_cluster_id: int) -> None:
        self._note(remote_cluster_id, 0)

    def notification_received(self, remote_cluster_id: int) -> None:
        self._note(remote_cluster_id, 1)

    def notification_dropped(self, remote_cluster_id: int) -> None:
        self._note(remote_cluster_id, 2)

    def record(self, remote_cluster_id: int, direction: str, plane: str, seconds: float, nbytes: int,
               failure: str | None) -> None:
        """One finished transfer: ``failure`` None = success (``nbytes`` moved), else a status code name."""
        entry = self._entries.get((remote_cluster_id, direction))
        if entry is None:
            entry = self._entries[(remote_cluster_id, direction)] = _Entry()
        entry.plane = plane
        entry.operations += 1
        if failure is None:
            entry.succeeded += 1
            entry.bytes += nbytes
        else:
            entry.failures[failure] = entry.failures.get(failure, 0) + 1
        entry.latencies[entry.recorded % LATENCY_WINDOW] = seconds * 1e3
        entry.recorded += 1

    def snapshot(self) -> StatsSnapshot:
        out = []
        for (cluster, direction), entry in sorted(self._entries.items()):
            window = entry.latencies[: min(entry.recorded, LATENCY_WINDOW)]  # never empty: created by record
            p50, p90, p99 = (float(v) for v in np.percentile(window, [50, 90, 99]))
            worst = float(window.max())
            out.append(LinkStats(cluster, direction, entry.plane, entry.operations, entry.succeeded, entry.bytes,
                                 MappingProxyType(dict(entry.failures)), p50, p90, p99, worst))
        notes = tuple(NotificationStats(cluster, *counts) for cluster, counts in sorted(self._notes.items()))
        return StatsSnapshot(tuple(out), notes)
