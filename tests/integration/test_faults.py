"""Faults: a stalled or cut network (a real fault-injecting TCP proxy in this process), peers killed during
pushes, and unlink/finalize while transfers run.  Nothing hangs, errors come fast, both sides stay usable."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
from collections.abc import AsyncIterator

import numpy as np
import pytest
from helpers.data import fill_pattern
from helpers.internals import registry_of

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMLinkError,
    LLMRole,
    LLMStatusCode,
    LLMTimeoutError,
    Placement,
)
from aiodatadist.testing import PeerProcess, cluster_info, free_port
from aiodatadist.testing.fault_proxy import FaultProxy

S = LLMStatusCode
SMALL = CacheDesc(2, (8, 4096), DataType.DT_UINT8, Placement.HOST)
BIG = CacheDesc(16, (64, 256 << 10), DataType.DT_UINT8, Placement.HOST)  # 256 MiB


@contextlib.asynccontextmanager
async def proxied_pair(sync_kv_timeout: int = 400) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist, FaultProxy]]:
    port = free_port()
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    client_cfg = LLMConfig()
    client_cfg.sync_kv_timeout = sync_kv_timeout
    proxy = FaultProxy(port)
    await proxy.start()
    async with LLMDataDist(LLMRole.PROMPT, 1) as server, LLMDataDist(LLMRole.DECODER, 2) as client:
        await server.init(dict(cfg.generate_options()))
        await client.init(dict(client_cfg.generate_options()))
        try:
            yield server, client, proxy
        finally:
            await proxy.close()


async def test_a_stalled_network_gives_a_timeout_never_a_hang_and_the_link_recovers() -> None:
    async with proxied_pair() as (server, client, proxy):
        assert (await client.link_clusters([cluster_info(1, proxy.port)], timeout=3000))[0] == S.LLM_SUCCESS
        src = server.cache_manager.allocate_blocks_cache(SMALL, BlocksCacheKey(1, 0))
        data = fill_pattern(src, 1)
        dst = client.cache_manager.allocate_blocks_cache(SMALL)
        proxy.set("stall")
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(LLMTimeoutError) as info:
            await client.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [2])  # resolved via the owner
        assert info.value.status_code == S.LLM_TIMEOUT
        assert loop.time() - start < 0.4 + 2.6, "the timeout came late"  # (its 400 ms, late on a loaded machine)
        proxy.set("pass")  # the held bytes arrive late: their replies are dropped, the link goes on
        await asyncio.sleep(0.2)
        await client.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [2])
        assert np.array_equal(dst.tensors[0].reshape(8, -1)[2], data[0].reshape(8, -1)[1])
        deadline = loop.time() + 10  # the server lets go of what the late requests took, once it answered them
        while not all(entry.leases == 0 for entry in registry_of(server.cache_manager).entries()):
            assert loop.time() < deadline, "the server kept a lease for 10 s after the link recovered"
            await asyncio.sleep(0.01)


async def test_a_cut_network_fails_fast_with_a_link_error_and_relinking_works() -> None:
    async with proxied_pair(sync_kv_timeout=20000) as (server, client, proxy):
        assert (await client.link_clusters([cluster_info(1, proxy.port)], timeout=3000))[0] == S.LLM_SUCCESS
        src = server.cache_manager.allocate_blocks_cache(SMALL, BlocksCacheKey(1, 0))
        fill_pattern(src, 2)
        dst = client.cache_manager.allocate_blocks_cache(SMALL)
        proxy.set("stall")
        pull = asyncio.ensure_future(client.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [2]))
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        cut = loop.time()
        proxy.set("cut")
        with pytest.raises(LLMLinkError):
            await pull
        assert loop.time() - cut < 5.0, "the cut was not noticed promptly"  # (not at the 20 s deadline)
        assert client.links() == []
        proxy.set("pass")
        assert (await client.link_clusters([cluster_info(1, proxy.port)], timeout=3000))[0] == S.LLM_SUCCESS
        await client.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [2])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_peer_killed_during_a_push_fails_it_fast(transport: str) -> None:
    port = free_port()
    peer = await PeerProcess.start()
    try:
        await peer.call("init", role="PROMPT", cluster_id=61, options={
            "llm.listenIpInfo": f"127.0.0.1:{port}", "llm.Transport": transport})
        await peer.call("allocate", blocks=True, num_tensors=16, shape=[64, 256 << 10], blocks_key=[61, 0])
        async with LLMDataDist(LLMRole.DECODER, 62) as dd:
            cfg = LLMConfig()
            cfg.sync_kv_timeout = 30000
            await dd.init(dict(cfg.generate_options()))
            assert (await dd.link_clusters([cluster_info(61, port)], timeout=5000))[0] == S.LLM_SUCCESS
            src = dd.cache_manager.allocate_blocks_cache(BIG)
            fill_pattern(src, 3)
            blocks = list(range(64))
            await dd.cache_manager.push_blocks(BlocksCacheKey(61, 0), src, [0], [0])  # resolved once
            loop = asyncio.get_running_loop()
            for _ in range(3):  # kill at a moment the push is running (several tries: it may finish first)
                push = asyncio.ensure_future(dd.cache_manager.push_blocks(BlocksCacheKey(61, 0), src, blocks, blocks))
                await asyncio.sleep(0.005)
                if not push.done():
                    break
                await push
            os.kill(peer.pid, signal.SIGKILL)
            killed = loop.time()
            with contextlib.suppress(LLMException):  # shm: the mapped pages outlive the peer, it may complete
                await push
            assert loop.time() - killed < 5.0  # (not at the 30 s deadline)
            deadline = loop.time() + 15
            while dd.links() and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert dd.links() == []
            with pytest.raises(LLMException) as info:
                await dd.cache_manager.push_blocks(BlocksCacheKey(61, 0), src, [1], [1])
            assert info.value.status_code == S.LLM_NOT_YET_LINK
            assert all(e.leases == 0 and not e.jobs for e in registry_of(dd.cache_manager).entries())
    finally:
        await peer.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("action", ["unlink", "finalize-requester", "finalize-owner"])
async def test_unlink_or_finalize_during_transfers_is_safe(transport: str, action: str) -> None:
    port = free_port()
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    cfg.transport = transport
    client_cfg = LLMConfig()
    client_cfg.sync_kv_timeout = 30000
    async with LLMDataDist(LLMRole.PROMPT, 1) as owner, LLMDataDist(LLMRole.DECODER, 2) as requester:
        await owner.init(dict(cfg.generate_options()))
        await requester.init(dict(client_cfg.generate_options()))
        assert (await requester.link_clusters([cluster_info(1, port)], timeout=3000))[0] == S.LLM_SUCCESS
        src = owner.cache_manager.allocate_blocks_cache(BIG, BlocksCacheKey(1, 0))
        fill_pattern(src, 4)
        dst = requester.cache_manager.allocate_blocks_cache(BIG)
        blocks = list(range(64))
        pulls = [asyncio.ensure_future(requester.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks))
                 for _ in range(4)]
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        start = loop.time()
        if action == "unlink":
            await requester.unlink_clusters([cluster_info(1, port)], timeout=2000, force=True)
        elif action == "finalize-requester":
            await requester.finalize()
        else:
            await owner.finalize()
        results = await asyncio.wait_for(asyncio.gather(*pulls, return_exceptions=True), 15)
        assert loop.time() - start < 15  # (not at the 30 s deadline)
        for r in results:  # each pull finished before the cut, or failed cleanly
            assert r is None or isinstance(r, LLMException), repr(r)
        if action != "finalize-requester":
            first = [hashlib.sha256(t.tobytes()).digest() for t in dst.tensors]
            await asyncio.sleep(0.2)
            assert [hashlib.sha256(t.tobytes()).digest() for t in dst.tensors] == first  # no late writes
            assert all(e.leases == 0 and not e.jobs for e in registry_of(requester.cache_manager).entries())
        if action == "unlink":  # both sides usable: link again and pull
            assert (await requester.link_clusters([cluster_info(1, port)], timeout=3000))[0] == S.LLM_SUCCESS
            await requester.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [5], [6])
            assert np.array_equal(dst.tensors[0].reshape(64, -1)[6], src.tensors[0].reshape(64, -1)[5])


async def test_a_server_notices_a_dead_client_at_once() -> None:
    """The server pulls from its client (either side may request); the client process dies: the server's
    waiting transfer fails with a link error right away, not at its deadline."""
    port = free_port()
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    cfg.sync_kv_timeout = 30000
    async with LLMDataDist(LLMRole.PROMPT, 71) as server:
        await server.init(dict(cfg.generate_options()))
        peer = await PeerProcess.start()
        try:
            await peer.call("init", role="DECODER", cluster_id=72, options={})
            await peer.call("allocate", blocks=True, num_tensors=2, shape=[8, 4096], blocks_key=[72, 0])
            assert (await peer.call("link", cluster_id=71, port=port))[0] == S.LLM_SUCCESS
            dst = server.cache_manager.allocate_blocks_cache(SMALL)
            os.kill(peer.pid, signal.SIGSTOP)  # BEGIN will not be answered
            pull = asyncio.ensure_future(server.cache_manager.pull_blocks(BlocksCacheKey(72, 0), dst, [1], [2]))
            await asyncio.sleep(0.2)
            assert not pull.done()
            loop = asyncio.get_running_loop()
            killed = loop.time()
            peer.kill()
            with pytest.raises(LLMLinkError):
                await pull
            assert loop.time() - killed < 5.0, "the server did not notice the dead client"  # (deadline: 30 s)
            while server.links() and loop.time() - killed < 10.0:
                await asyncio.sleep(0.02)
            assert server.links() == []
        finally:
            await peer.close()
