"""Transfer statistics: per remote cluster and direction, recorded by the requesting side and by the owner.

``LLMDataDist.stats()`` returns a :class:`StatsSnapshot`: frozen values that later transfers do not change.
Latency percentiles come from the most recent :data:`LATENCY_WINDOW` transfers of each entry.  ``links`` are
the transfers this instance requested (``pull_*``/``push_*``); ``served`` those its peers requested of its
caches, with ``direction`` the peer's operation (``"pull"``: bytes went out).  The owner sees a transfer that
asked it (``BEGIN`` to ``END``: latency from its side, failures by status code, ``REQUESTER_FAILED`` when the
requester ended it unsuccessfully, ``LINK_CLOSED`` when the link went first) and the one-sided TCP reads and
writes its I/O threads served (operations and bytes, no latency; refused ones as ``STALE_READ``/``STALE_WRITE``;
a one-sided write counts each frame).  Same-host transfers of a
published cache (the requester maps or reads the owner's memory itself) and NIXL reads never reach the owner and
are counted by the requester only.  Notifications (see :mod:`aiodatadist.notifications`) are counted per remote cluster
on both sides: sent by the sender, received or dropped (queue full, or arriving during ``finalize``) by the
receiver.  Control-plane messages (:class:`MessageStats`) are counted per remote cluster and message kind as
the links' channels send and receive them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

__all__ = ["LATENCY_WINDOW", "LinkStats", "MessageCounter", "MessageStats", "NotificationStats", "StagingStats",
           "StatsRecorder", "StatsSnapshot"]

LATENCY_WINDOW = 4096
OneSided = tuple[int, int, int, int, int, int]
"""One-sided transfers a link's I/O threads served: reads (accepted, bytes, refused), then writes the same."""
NO_ONE_SIDED: OneSided = (0, 0, 0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class LinkStats:
    """One remote cluster and direction (``"pull"``: bytes came in, ``"push"``: bytes went out)."""

    remote_cluster_id: int
    direction: str
    plane: str  # the link's data plane at the last transfer: "shm", "tcp" or "nixl"; for a device cache with its
    # device path: "shm/device-direct" (CUDA IPC), "tcp/device-staged" (through page-locked memory)
    operations: int  # transfers started
    succeeded: int
    bytes: int  # bytes moved by transfers that succeeded
    failures: Mapping[str, int]  # status code name (or "CANCELLED") -> count
    latency_p50_ms: float  # of the last LATENCY_WINDOW transfers, failed ones included
    latency_p90_ms: float
    latency_p99_ms: float
    latency_max_ms: float


@dataclass(frozen=True, slots=True)
class StagingStats:
    """This process's budget of page-locked memory for staging device caches over TCP
    (``AIODATADIST_STAGING_BYTES``), shared by its instances: what the staging rings hold of it, how many rings
    there are, and, once it is spent, how many shared rings and how many links use them (see ``links()`` for
    each link's rings)."""

    budget_bytes: int
    used_bytes: int = 0
    rings: int = 0
    shared_rings: int = 0
    shared_ring_users: int = 0


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
class MessageStats:
    """Control-plane messages exchanged with one remote cluster over its links (and link attempts) so far, by
    message kind (the protocol's names: ``"begin"``, ``"end"``, ``"reply"``, ``"notify"``, ...): ``sent`` to it
    and ``received`` from it.  A server's handshake runs before the link's channel exists: the client counts its
    ``"hello"`` requests, the server neither them nor its answers to refused ones."""

    remote_cluster_id: int
    sent: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    received: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def total_sent(self) -> int:
        """Messages of every kind sent."""
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        """Messages of every kind received."""
        return sum(self.received.values())


class MessageCounter:
    """The control messages of one remote cluster, counted by kind by its links' channels as they send and
    receive them (a dict increment each; event loop thread only)."""

    __slots__ = ("received", "sent")

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.received: dict[str, int] = {}

    def frozen(self, remote_cluster_id: int) -> MessageStats:
        return MessageStats(remote_cluster_id, MappingProxyType({str(k): n for k, n in self.sent.items()}),
                            MappingProxyType({str(k): n for k, n in self.received.items()}))


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """Statistics of one ``LLMDataDist`` at one moment."""

    links: tuple[LinkStats, ...] = ()
    notifications: tuple[NotificationStats, ...] = ()
    served: tuple[LinkStats, ...] = ()  # what peers requested of this instance's caches (see the module doc)
    messages: tuple[MessageStats, ...] = ()  # control-plane messages, per remote cluster
    staging: StagingStats | None = None  # the process's staging budget, once this instance staged over TCP

    def get(self, remote_cluster_id: int, direction: str) -> LinkStats | None:
        """The entry of one remote cluster and direction, if it moved anything yet."""
        for entry in self.links:
            if entry.remote_cluster_id == remote_cluster_id and entry.direction == direction:
                return entry
        return None

    def served_of(self, remote_cluster_id: int, direction: str) -> LinkStats | None:
        """What one remote cluster requested of this instance's caches (``direction``: its operation)."""
        for entry in self.served:
            if entry.remote_cluster_id == remote_cluster_id and entry.direction == direction:
                return entry
        return None

    def notifications_of(self, remote_cluster_id: int) -> NotificationStats:
        """The notifications exchanged with one remote cluster (all zero if none yet)."""
        for entry in self.notifications:
            if entry.remote_cluster_id == remote_cluster_id:
                return entry
        return NotificationStats(remote_cluster_id)

    def messages_of(self, remote_cluster_id: int) -> MessageStats:
        """The control-plane messages exchanged with one remote cluster (none if no link to it yet)."""
        for entry in self.messages:
            if entry.remote_cluster_id == remote_cluster_id:
                return entry
        return MessageStats(remote_cluster_id)

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

    def add(self, plane: str, seconds: float | None, nbytes: int, failure: str | None, count: int = 1) -> None:
        """``count`` finished transfers (``seconds``: the latency of one, None: not timed)."""
        self.plane = plane
        self.operations += count
        if failure is None:
            self.succeeded += count
            self.bytes += nbytes
        else:
            self.failures[failure] = self.failures.get(failure, 0) + count
        if seconds is not None:
            self.latencies[self.recorded % LATENCY_WINDOW] = seconds * 1e3
            self.recorded += 1

    def frozen(self, cluster: int, direction: str) -> LinkStats:
        window = self.latencies[: min(self.recorded, LATENCY_WINDOW)]
        p50, p90, p99 = (float(v) for v in np.percentile(window, [50, 90, 99])) if len(window) else (0.0,) * 3
        worst = float(window.max()) if len(window) else 0.0
        return LinkStats(cluster, direction, self.plane, self.operations, self.succeeded, self.bytes,
                         MappingProxyType(dict(self.failures)), p50, p90, p99, worst)


class StatsRecorder:
    """Accumulates transfers of one instance (event loop thread only)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], _Entry] = {}
        self._served: dict[tuple[int, str], _Entry] = {}
        self._one_sided: dict[int, tuple[str, OneSided]] = {}  # closed links' one-sided reads and writes, summed
        self._notes: dict[int, list[int]] = {}  # remote cluster -> [sent, received, dropped]
        self._messages: dict[int, MessageCounter] = {}  # remote cluster -> its control messages, by kind
        self.staged = False  # a link of this instance staged a device cache over TCP (see StatsSnapshot.staging)

    def mark_staged(self) -> None:
        """A link of this instance set up a staging ring: its stats report the process's staging budget."""
        self.staged = True

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

    def messages(self, remote_cluster_id: int) -> MessageCounter:
        """The counter of the control messages exchanged with ``remote_cluster_id`` (one for all its links)."""
        counter = self._messages.get(remote_cluster_id)
        if counter is None:
            counter = self._messages[remote_cluster_id] = MessageCounter()
        return counter

    def record(self, remote_cluster_id: int, direction: str, plane: str, seconds: float, nbytes: int,
               failure: str | None) -> None:
        """One finished transfer: ``failure`` None = success (``nbytes`` moved), else a status code name."""
        _entry(self._entries, remote_cluster_id, direction).add(plane, seconds, nbytes, failure)

    def served(self, remote_cluster_id: int, direction: str, plane: str, seconds: float | None, nbytes: int,
               failure: str | None) -> None:
        """A transfer a peer requested of this instance's caches ended (owner side)."""
        _entry(self._served, remote_cluster_id, direction).add(plane, seconds, nbytes, failure)

    def one_sided_closed(self, remote_cluster_id: int, plane: str, counts: OneSided) -> None:
        """A link closed: keep the one-sided reads and writes its I/O threads served."""
        _, before = self._one_sided.get(remote_cluster_id, (plane, NO_ONE_SIDED))
        self._one_sided[remote_cluster_id] = (plane, _sum(before, counts))

    def snapshot(self, one_sided: dict[int, tuple[str, OneSided]] | None = None,
                 staging: StagingStats | None = None) -> StatsSnapshot:
        """The statistics now; ``one_sided``: the live links' one-sided reads and writes served (remote ->
        plane, counts); ``staging``: the process's staging budget."""
        out = tuple(entry.frozen(cluster, direction) for (cluster, direction), entry in sorted(self._entries.items()))
        served = {key: _copy(entry) for key, entry in self._served.items()}
        totals = dict(self._one_sided)
        for cluster, (plane, counts) in (one_sided or {}).items():
            _, before = totals.get(cluster, (plane, NO_ONE_SIDED))
            totals[cluster] = (plane, _sum(before, counts))
        for cluster, (plane, counts) in totals.items():
            for direction, (accepted, nbytes, refused), stale in (("pull", counts[:3], "STALE_READ"),
                                                                  ("push", counts[3:], "STALE_WRITE")):
                if accepted or refused:
                    entry = _entry(served, cluster, direction)
                    entry.add(plane, None, nbytes, None, accepted)
                    if refused:
                        entry.add(plane, None, 0, stale, refused)
        notes = tuple(NotificationStats(cluster, *counts) for cluster, counts in sorted(self._notes.items()))
        messages = tuple(counter.frozen(cluster) for cluster, counter in sorted(self._messages.items()))
        return StatsSnapshot(out, notes, tuple(entry.frozen(c, d) for (c, d), entry in sorted(served.items())),
                             messages, staging)


def _entry(table: dict[tuple[int, str], _Entry], cluster: int, direction: str) -> _Entry:
    entry = table.get((cluster, direction))
    if entry is None:
        entry = table[(cluster, direction)] = _Entry()
    return entry


def _sum(a: OneSided, b: OneSided) -> OneSided:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], a[4] + b[4], a[5] + b[5]


def _copy(entry: _Entry) -> _Entry:
    return _Entry(entry.plane, entry.operations, entry.succeeded, entry.bytes, dict(entry.failures),
                  entry.latencies.copy(), entry.recorded)
