"""Prometheus export of transfer statistics (optional extra ``metrics``: ``pip install 'aiodatadist[metrics]'``).

``register_prometheus(dd)`` adds a collector that reads ``dd.stats()`` at every scrape, so nothing is recorded
twice and the export costs nothing between scrapes.  ``prometheus_client`` is imported only here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .datadist import LLMDataDist

__all__ = ["register_prometheus"]


def register_prometheus(dd: LLMDataDist, registry: Any = None, prefix: str = "aiodatadist") -> Any:
    """Export ``dd``'s statistics to a ``prometheus_client`` registry (the default one if None).

    Metrics, labelled by local and remote cluster id, direction (``pull``/``push``) and data plane:
    ``<prefix>_transfers_total``, ``<prefix>_transfers_succeeded_total``, ``<prefix>_transfer_bytes_total``,
    ``<prefix>_transfer_failures_total`` (also by status ``code``) and ``<prefix>_transfer_latency_ms`` (by
    ``quantile``: 0.5, 0.9, 0.99, 1 = max of the recent window); ``<prefix>_notifications_sent_total``,
    ``<prefix>_notifications_received_total`` and ``<prefix>_notifications_dropped_total``, labelled by local and
    remote cluster id.  The same transfer metrics prefixed ``<prefix>_served_`` count what peers requested of this
    instance's caches (``StatsSnapshot.served``; ``direction`` is the peer's operation).  Returns the collector, for
    ``registry.unregister``.  Raises ``ImportError`` when ``prometheus_client`` is not installed.
    """
    from prometheus_client import REGISTRY
    from prometheus_client.core import CounterMetricFamily

    class StatsCollector:
        def collect(self) -> Iterator[Any]:
            snapshot = dd.stats()
            yield from _transfer_families(prefix, "", "", dd.cluster_id, snapshot.links)
            yield from _transfer_families(prefix, "served_", "requested of this instance's caches: ",
                                          dd.cluster_id, snapshot.served)
            note_labels = ["cluster", "remote_cluster"]
            notes = [CounterMetricFamily(f"{prefix}_notifications_{what}", f"Notifications {what}", labels=note_labels)
                     for what in ("sent", "received", "dropped")]
            for note in snapshot.notifications:
                values = [str(dd.cluster_id), str(note.remote_cluster_id)]
                for family, count in zip(notes, (note.sent, note.received, note.dropped), strict=True):
                    family.add_metric(values, count)
            yield from notes

    collector = StatsCollector()
    (registry if registry is not None else REGISTRY).register(collector)
    return collector


def _transfer_families(prefix: str, kind: str, about: str, cluster: int, entries: Any) -> Iterator[Any]:
    """The transfer metrics of ``entries`` (``LinkStats``), named ``<prefix>_<kind>transfers_total`` etc."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["cluster", "remote_cluster", "direction", "plane"]
    ops = CounterMetricFamily(f"{prefix}_{kind}transfers", f"Transfers {about}started", labels=labels)
    done = CounterMetricFamily(f"{prefix}_{kind}transfers_succeeded", f"Transfers {about}succeeded", labels=labels)
    moved = CounterMetricFamily(f"{prefix}_{kind}transfer_bytes", f"Bytes moved by successful transfers {about}",
                                labels=labels)
    failed = CounterMetricFamily(f"{prefix}_{kind}transfer_failures", f"Failed transfers {about}by status code",
                                 labels=[*labels, "code"])
    latency = GaugeMetricFamily(f"{prefix}_{kind}transfer_latency_ms", f"Transfer latency {about}recent window",
                                labels=[*labels, "quantile"])
    for entry in entries:
        values = [str(cluster), str(entry.remote_cluster_id), entry.direction, entry.plane]
        ops.add_metric(values, entry.operations)
        done.add_metric(values, entry.succeeded)
        moved.add_metric(values, entry.bytes)
        for code, count in entry.failures.items():
            failed.add_metric([*values, code], count)
        for quantile, value in (("0.5", entry.latency_p50_ms), ("0.9", entry.latency_p90_ms),
                                ("0.99", entry.latency_p99_ms), ("1", entry.latency_max_ms)):
            latency.add_metric([*values, quantile], value)
    yield from (ops, done, moved, failed, latency)
