"""Transfer statistics: immutable snapshots per remote cluster and direction, and their Prometheus export."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMException,
    LLMStatusCode,
    Placement,
    StatsSnapshot,
)
from aiodatadist.stats import LATENCY_WINDOW, StatsRecorder
from aiodatadist.testing import fill_pattern, linked_pair

DESC = CacheDesc(4, (8, 1024), DataType.DT_UINT8, Placement.HOST)  # 1 KiB blocks, 4 tensors


@settings(max_examples=60, deadline=None)
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


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_transfers_are_counted_per_cluster_and_direction(transport: str) -> None:
    cfg = LLMConfig()
    cfg.transport = transport
    async with linked_pair(config=cfg) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 3))
        dst = decoder.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(2, 4))
        fill_pattern(src, 1)
        fill_pattern(dst, 2)
        assert decoder.stats() == StatsSnapshot()
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 3), dst, [1, 2], [3, 4])  # 4 tensors x 2 KiB
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 3), dst, [5], [6])  # 4 KiB
        before = decoder.stats()
        with pytest.raises(LLMException):
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 99), dst, [5], [6])  # no such model id
        await decoder.cache_manager.push_blocks(BlocksCacheKey(1, 3), dst, [0, 1, 2], [0, 1, 2])  # 12 KiB

        pulls, pushes = decoder.stats().get(1, "pull"), decoder.stats().get(1, "push")
        assert pulls is not None and pushes is not None
        assert (pulls.operations, pulls.succeeded, pulls.bytes) == (3, 2, 12 << 10)
        assert dict(pulls.failures) == {LLMStatusCode.LLM_KV_CACHE_NOT_EXIST.name: 1}
        assert (pushes.operations, pushes.bytes, dict(pushes.failures)) == (1, 12 << 10, {})
        assert pulls.plane == pushes.plane == transport
        assert 0 < pulls.latency_p50_ms <= pulls.latency_p99_ms <= pulls.latency_max_ms
        assert before.get(1, "pull").operations == 2  # type: ignore[union-attr]  # a snapshot never changes
        assert decoder.stats().total_bytes == 24 << 10
        assert prompt.stats() == StatsSnapshot()  # the owner does not record transfers it serves


async def test_prometheus_export_reads_the_statistics() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from aiodatadist.metrics import register_prometheus

    async with linked_pair() as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 3))
        dst = decoder.cache_manager.allocate_blocks_cache(DESC)
        registry = prometheus_client.CollectorRegistry()
        register_prometheus(decoder, registry)
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 3), dst, [1], [1])
        with pytest.raises(LLMException):
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 7), dst, [1], [1])
        del src
        labels = {"cluster": "2", "remote_cluster": "1", "direction": "pull", "plane": "shm"}
        assert registry.get_sample_value("aiodatadist_transfers_total", labels) == 2
        assert registry.get_sample_value("aiodatadist_transfer_bytes_total", labels) == 4 << 10
        assert registry.get_sample_value("aiodatadist_transfer_failures_total",
                                         {**labels, "code": "LLM_KV_CACHE_NOT_EXIST"}) == 1
        assert registry.get_sample_value("aiodatadist_transfer_latency_ms", {**labels, "quantile": "0.5"}) > 0
