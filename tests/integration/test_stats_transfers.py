"""Transfer statistics of real transfers over a linked pair: counted per remote cluster and direction, and
exported to Prometheus (the recorder alone is tested in ``unit/api/test_stats.py``)."""

from __future__ import annotations

import asyncio

import pytest
from helpers.data import fill_pattern

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMException,
    LLMStatusCode,
    MessageStats,
    Placement,
    StatsSnapshot,
)
from aiodatadist.testing import cluster_info, linked_pair

DESC = CacheDesc(4, (8, 1024), DataType.DT_UINT8, Placement.HOST)  # 1 KiB blocks, 4 tensors


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_transfers_are_counted_per_cluster_and_direction(transport: str) -> None:
    cfg = LLMConfig()
    cfg.transport = transport
    async with linked_pair(config=cfg) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 3))
        dst = decoder.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(2, 4))
        fill_pattern(src, 1)
        fill_pattern(dst, 2)
        assert decoder.stats() == StatsSnapshot(messages=decoder.stats().messages)  # (the handshake's)
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
        assert prompt.stats().links == ()  # the owner requested nothing (what it served: the next test)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_the_owner_counts_what_it_served(transport: str) -> None:
    """``served``: the transfers that asked the owner (BEGIN to END, refusals by code) and, on TCP, the one-sided
    reads its I/O threads served; same-host one-sided transfers never reach it."""
    cfg = LLMConfig()
    cfg.transport = transport
    async with linked_pair(config=cfg) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 3))
        dst = decoder.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(2, 4))
        fill_pattern(src, 1)
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 3), dst, [1, 2], [3, 4])  # asks the owner: 8 KiB
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 3), dst, [5], [6])  # one-sided: 4 KiB
        with pytest.raises(LLMException):
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 99), dst, [5], [6])  # refused by the owner
        await decoder.cache_manager.push_blocks(BlocksCacheKey(1, 3), dst, [0, 1, 2], [0, 1, 2])  # 12 KiB

        served = prompt.stats()
        pulls, pushes = served.served_of(2, "pull"), served.served_of(2, "push")
        assert pulls is not None and pulls.plane == transport
        assert dict(pulls.failures) == {LLMStatusCode.LLM_KV_CACHE_NOT_EXIST.name: 1}
        assert served.links == () and decoder.stats().served == ()
        if transport == "tcp":  # the one-sided read and write are counted by the owner's I/O threads
            assert (pulls.operations, pulls.succeeded, pulls.bytes) == (3, 2, 12 << 10)
            assert pushes is not None and (pushes.bytes, dict(pushes.failures)) == (12 << 10, {})
            assert pushes.operations >= 1  # one per WRITE frame
        else:  # the second pull and the push read and write the owner's mapped memory without asking it
            assert (pulls.operations, pulls.succeeded, pulls.bytes) == (2, 1, 8 << 10)
            assert pushes is None
        assert pulls.latency_max_ms > 0
        await decoder.unlink_clusters([cluster_info(1, 0)], timeout=3000)
        await asyncio.sleep(0.1)
        assert prompt.stats().served_of(2, "pull") == pulls  # the counts outlive the link


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_control_messages_are_counted_by_kind_on_both_sides(transport: str) -> None:
    """Every message of the link's channel, by kind: what one side sent the other received, and a pull through
    the owner is a BEGIN and an END, each answered."""
    cfg = LLMConfig()
    cfg.transport = transport
    async with linked_pair(config=cfg) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 3))
        dst = decoder.cache_manager.allocate_blocks_cache(DESC)
        fill_pattern(src, 1)
        linked = decoder.stats().messages_of(1)
        assert linked.sent.get("hello", 0) >= 1 and linked.received.get("reply", 0) >= 1  # the handshake's
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 3), dst, [1, 2], [3, 4])  # asks the owner
        await decoder.notify(1, b"x")
        await asyncio.sleep(0.1)  # the owner's last replies are on their way when the calls return
        mine, theirs = decoder.stats().messages_of(1), prompt.stats().messages_of(2)
        sent = {kind: n - linked.sent.get(kind, 0) for kind, n in mine.sent.items()}
        assert sent.get("begin") == 1 and sent.get("notify") == 1
        assert theirs.received.get("begin") == 1 and theirs.received.get("notify") == 1
        for kind in ("begin", "end", "notify"):  # (the server counts no HELLO: its channel comes after it)
            assert mine.sent.get(kind, 0) == theirs.received.get(kind, 0), kind
            assert theirs.sent.get(kind, 0) == mine.received.get(kind, 0), kind
        assert mine.received.get("reply", 0) >= sent["begin"] + sent["notify"] + linked.received["reply"]
        assert decoder.stats().messages_of(7) == MessageStats(7)  # no link to it
        await decoder.unlink_clusters([cluster_info(1, 0)], timeout=3000)
        assert decoder.stats().messages_of(1).sent.get("bye", 0) >= 1  # the counts outlive the link


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
        owner = prometheus_client.CollectorRegistry()  # the owner's side: what it served
        register_prometheus(prompt, owner)
        served = {"cluster": "1", "remote_cluster": "2", "direction": "pull", "plane": "shm"}
        assert owner.get_sample_value("aiodatadist_served_transfers_total", served) == 2
        assert owner.get_sample_value("aiodatadist_served_transfer_bytes_total", served) == 4 << 10
        assert owner.get_sample_value("aiodatadist_served_transfer_failures_total",
                                      {**served, "code": "LLM_KV_CACHE_NOT_EXIST"}) == 1
