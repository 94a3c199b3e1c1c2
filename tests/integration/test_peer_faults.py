"""A peer that dies: the surviving side's waiting transfer fails fast with a link error, its state is clean,
and it can link again."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from helpers.internals import registry_of
from helpers.marks import NIXL

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMLinkError,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import PeerProcess, cluster_info, free_port


async def start_prompt(cluster_id: int) -> tuple[PeerProcess, int]:
    port = free_port()
    peer = await PeerProcess.start()
    await peer.call("init", role="PROMPT", cluster_id=cluster_id, options={"llm.listenIpInfo": f"127.0.0.1:{port}"})
    await peer.call("allocate", blocks=True, num_tensors=2, shape=[8, 4096], blocks_key=[cluster_id, 0])
    return peer, port


async def test_killed_server_fails_waiting_pull_fast_and_relink_works() -> None:
    peer, port = await start_prompt(31)
    async with LLMDataDist(LLMRole.DECODER, 32) as dd:
        cfg = LLMConfig()
        cfg.sync_kv_timeout = 20000
        await dd.init(cfg.generate_options())
        assert (await dd.link_clusters([cluster_info(31, port)]))[0] == LLMStatusCode.LLM_SUCCESS
        cache = dd.cache_manager.allocate_blocks_cache(CacheDesc(2, (8, 4096), DataType.DT_UINT8, Placement.HOST))
        os.kill(peer.pid, signal.SIGSTOP)  # the BEGIN will never be answered
        pull = asyncio.ensure_future(dd.cache_manager.pull_blocks(BlocksCacheKey(31, 0), cache, [1], [2]))
        await asyncio.sleep(0.2)
        assert not pull.done()
        loop = asyncio.get_running_loop()
        killed = loop.time()
        peer.kill()
        with pytest.raises(LLMLinkError) as info:
            await pull
        assert loop.time() - killed < 5.0, "the broken connection was not noticed promptly"  # (deadline: 20 s)
        assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert dd.links() == []
        assert all(entry.leases == 0 for entry in registry_of(dd.cache_manager).entries())
        await peer.close()
        # the peer is back (a new process, same cluster id): linking and pulling work again
        peer, port = await start_prompt(31)
        try:
            assert (await dd.link_clusters([cluster_info(31, port)]))[0] == LLMStatusCode.LLM_SUCCESS
            await dd.cache_manager.pull_blocks(BlocksCacheKey(31, 0), cache, [1], [2])
        finally:
            await peer.close()


@pytest.mark.parametrize("transport", ["tcp", pytest.param("nixl", marks=NIXL)])
async def test_peer_killed_mid_transfer_fails_fast_and_never_reports_success(transport: str) -> None:
    """Over the TCP or NIXL plane the owner dies while bytes are flowing: the pull fails with a link error
    within a bound (it never reports success for a cut-short transfer), and nothing is left running."""
    port = free_port()
    peer = await PeerProcess.start()
    desc = CacheDesc(16, (64, 256 << 10), DataType.DT_UINT8, Placement.HOST)  # 256 MiB
    await peer.call("init", role="PROMPT", cluster_id=41,
                    options={"llm.listenIpInfo": f"127.0.0.1:{port}", "llm.Transport": transport})
    remote = await peer.call("allocate", blocks=True, num_tensors=16, shape=[64, 256 << 10], blocks_key=[41, 0])
    await peer.call("fill", cache_id=remote["cache_id"], seed=3)
    try:
        async with LLMDataDist(LLMRole.DECODER, 42) as dd:
            cfg = LLMConfig()
            cfg.sync_kv_timeout = 20000
            await dd.init(cfg.generate_options())
            assert (await dd.link_clusters([cluster_info(41, port)]))[0] == LLMStatusCode.LLM_SUCCESS
            assert dd.links()[0]["plane"] == transport
            cache = dd.cache_manager.allocate_blocks_cache(desc)
            for t in cache.tensors:
                t[...] = 0  # the pattern bytes are never 0: any non-zero byte has arrived
            blocks = list(range(64))
            pull = asyncio.ensure_future(dd.cache_manager.pull_blocks(BlocksCacheKey(41, 0), cache, blocks, blocks))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while not cache.tensors[0].any() and loop.time() < deadline:
                await asyncio.sleep(0.0005)
            os.kill(peer.pid, signal.SIGSTOP)  # stop the stream half way
            if pull.done():
                pytest.skip("the transfer finished before the peer could be stopped")
            killed = loop.time()
            peer.kill()
            with pytest.raises(LLMLinkError) as info:
                await pull
            assert loop.time() - killed < 5.0, "the broken stream was not noticed promptly"  # (deadline: 20 s)
            assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
            assert dd.links() == []
            assert all(entry.leases == 0 and not entry.jobs for entry in registry_of(dd.cache_manager).entries())
    finally:
        await peer.close()
