"""Transfer statistics: per remote cluster and direction, recorded by the requesting side.

``LLMDataDist.stats()`` returns a :class:`StatsSnapshot`: frozen values that later transfers do not change.
Latency percentiles come from the most recent :data:`LATENCY_WINDOW` transfers of each entry.  Only the side
that calls ``pull_*``/``push_*`` records a transfer (a same-host transfer by an already-resolved key does not
involve the owner at all).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

__all__ = ["LATENCY_WINDOW", "LinkStats", "StatsRecorder", "StatsSnapshot"]

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
class StatsSnapshot:
    """Statistics of one ``LLMDataDist`` at one moment."""

    links: tuple[LinkStats, ...] = ()

    def get(self, remote_cluster_id: int, direction: str) -> LinkStats | None:
        """The entry of one remote cluster and direction, if it moved anything yet."""
        for entry in self.links:
            if entry.remote_cluster_id == remote_cluster_id and entry.direction == direction:
                return entry
        return None

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
        return StatsSnapshot(tuple(out))
