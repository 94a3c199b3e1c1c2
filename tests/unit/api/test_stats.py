"""Transfer statistics: the recorder and its immutable snapshots (no instance, no link; the counting of real
transfers and messages and the Prometheus export are in ``integration/test_stats_transfers.py``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers.examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.protocol.codec import Kind
from aiodatadist.stats import LATENCY_WINDOW, MessageStats, StatsRecorder


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.integers(0, 1 << 30), st.sampled_from([None, "LLM_TIMEOUT",
                                                                                     "CANCELLED"])),
                min_size=1, max_size=300))
def test_recorder_matches_a_model(records: list[tuple[float, int, str | None]]) -> None:
    recorder = StatsRecorder()
    for seconds, nbytes, failure in records:
        recorder.record(7, "pull", "tcp", seconds, nbytes, failure)
    entry = recorder.snapshot().get(7, "pull")
    assert entry is not None and recorder.snapshot().get(7, "push") is None
    assert entry.operations == len(records)
    assert entry.succeeded == sum(1 for r in records if r[2] is None)
    assert entry.bytes == sum(r[1] for r in records if r[2] is None)
    assert dict(entry.failures) == {f: sum(1 for r in records if r[2] == f) for f in {r[2] for r in records} if f}
    window = np.array([r[0] * 1e3 for r in records][-LATENCY_WINDOW:])
    assert entry.latency_p50_ms == pytest.approx(float(np.percentile(window, 50)))
    assert entry.latency_p99_ms == pytest.approx(float(np.percentile(window, 99)))
    assert entry.latency_max_ms == pytest.approx(float(window.max()))


def test_the_latency_window_keeps_the_most_recent_transfers() -> None:
    recorder = StatsRecorder()
    for _ in range(LATENCY_WINDOW):
        recorder.record(1, "push", "shm", 1.0, 1, None)  # old: 1000 ms
    for _ in range(LATENCY_WINDOW):
        recorder.record(1, "push", "shm", 0.001, 1, None)  # recent: 1 ms
    entry = recorder.snapshot().get(1, "push")
    assert entry is not None and entry.latency_max_ms == pytest.approx(1.0) and entry.operations == 2 * LATENCY_WINDOW


def test_snapshots_are_immutable() -> None:
    recorder = StatsRecorder()
    recorder.record(1, "pull", "shm", 0.01, 10, "LLM_TIMEOUT")
    snapshot = recorder.snapshot()
    entry = snapshot.links[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.bytes = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        entry.failures["LLM_TIMEOUT"] = 0  # type: ignore[index]
    recorder.record(1, "pull", "shm", 0.01, 10, None)
    assert snapshot.links[0].operations == 1 and recorder.snapshot().links[0].operations == 2


def test_control_messages_are_counted_by_kind_per_remote_cluster() -> None:
    recorder = StatsRecorder()
    assert recorder.snapshot().messages_of(3) == MessageStats(3) and recorder.snapshot().messages == ()
    counter = recorder.messages(3)
    assert recorder.messages(3) is counter  # one counter for every link to the cluster, kept past them
    counter.sent[Kind.BEGIN] = 2
    counter.sent[Kind.REPLY] = 1
    counter.received["reply"] = 2
    snapshot = recorder.snapshot()
    entry = snapshot.messages_of(3)
    assert snapshot.messages == (entry,) and entry.remote_cluster_id == 3
    assert dict(entry.sent) == {"begin": 2, "reply": 1} and dict(entry.received) == {"reply": 2}
    assert all(type(kind) is str for kind in entry.sent)  # plain names, as on the wire
    assert (entry.total_sent, entry.total_received) == (3, 2)
    counter.sent[Kind.BEGIN] += 1
    assert entry.sent["begin"] == 2  # a snapshot never changes
    with pytest.raises(TypeError):
        entry.sent["begin"] = 0  # type: ignore[index]
