"""Faults over and over, on the shipped pytest plugin's fixtures, with ``leak_check`` on: a TCP prompt killed while
a pull waits on it, and its data connections cut, 30 times each.  Every request after a fault is served (the
retry-once router of docs/api.md, "Routers that link on demand", relinks at once), and nothing is left behind: no
descriptor, thread or task outlives the links dropped during transfers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio

from aiodatadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMLinkError,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import FaultInjector, PromptServer, block_rows, tensor_bytes

S = LLMStatusCode
ROUNDS = 30
LINKED = (S.LLM_SUCCESS, S.LLM_ALREADY_LINK)
DESC = CacheDesc(4, (16, 1024), DataType.DT_UINT8, Placement.HOST)


class KVRouter:
    """docs/api.md's router that links on demand, as written there."""

    def __init__(self, decoder: LLMDataDist) -> None:
        self.decoder = decoder

    async def fetch(self, prompt: LLMClusterInfo, src_blocks: list[int], dst_cache: Cache,
                    dst_blocks: list[int]) -> None:
        key = BlocksCacheKey(prompt.remote_cluster_id, 0)
        for attempt in range(2):
            _, (code,) = await self.decoder.link_clusters([prompt], timeout=3000)
            if code not in LINKED:
                raise LLMLinkError(f"cannot link to cluster {prompt.remote_cluster_id}: {code}")
            try:
                return await self.decoder.cache_manager.pull_blocks(key, dst_cache, src_blocks, dst_blocks)
            except LLMLinkError:
                if attempt:
                    raise


@pytest_asyncio.fixture
async def prompt_server(prompt_server_factory) -> PromptServer:  # type: ignore[no-untyped-def]
    return await prompt_server_factory(options={"llm.Transport": "tcp", "llm.SyncKvCacheWaitTime": "20000"})


def _landed(server: PromptServer, cache: Cache, src: list[int], dst: list[int]) -> None:
    for have, want in zip(block_rows(tensor_bytes(cache), 16, dst), server.expected("kv", src), strict=True):
        np.testing.assert_array_equal(have, want)


async def _served(router: KVRouter, faults: FaultInjector, server: PromptServer, cache: Cache, i: int) -> None:
    src, dst = [i % 16, (5 * i + 3) % 16], [(i + 1) % 16, (i + 9) % 16]
    await router.fetch(faults.cluster_info(), src, cache, dst)
    _landed(server, cache, src, dst)


@pytest.mark.asyncio
async def test_a_tcp_prompt_killed_during_pulls_leaks_nothing_and_loses_no_request(
        leak_check, prompt_server, fault_injector, linked_decoder) -> None:  # type: ignore[no-untyped-def]
    router = KVRouter(linked_decoder)
    cache = linked_decoder.cache_manager.allocate_blocks_cache(DESC)
    key = prompt_server.caches["kv"].key
    for i in range(ROUNDS):
        await _served(router, fault_injector, prompt_server, cache, i)
        await fault_injector.stop()  # the pull below waits on the prompt until it is killed
        pull = asyncio.ensure_future(linked_decoder.cache_manager.pull_blocks(key, cache, [(i + 2) % 16], [0]))
        await asyncio.sleep(0.02)
        assert not pull.done()  # (the prompt is stopped: nothing can answer it)
        await fault_injector.kill()
        with pytest.raises(LLMLinkError):
            await pull
        await fault_injector.restart()
        await _served(router, fault_injector, prompt_server, cache, i)
    linked_decoder.cache_manager.deallocate_blocks_cache(cache)


@pytest.mark.asyncio
async def test_data_connections_cut_then_relinked_at_once_lose_no_request(
        leak_check, prompt_server, fault_injector, linked_decoder) -> None:  # type: ignore[no-untyped-def]
    router = KVRouter(linked_decoder)
    cache = linked_decoder.cache_manager.allocate_blocks_cache(DESC)
    for i in range(ROUNDS):
        await _served(router, fault_injector, prompt_server, cache, i)
        assert fault_injector.cut_data() > 0
        _, (per,) = await linked_decoder.link_clusters([fault_injector.cluster_info()], timeout=3000)
        assert per in LINKED
        if per == S.LLM_ALREADY_LINK:  # then there is a link, and it serves
            assert [link["remote_cluster_id"] for link in linked_decoder.links()] == [prompt_server.address.cluster_id]
        await _served(router, fault_injector, prompt_server, cache, i)
    linked_decoder.cache_manager.deallocate_blocks_cache(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("run", range(5))
async def test_a_tcp_prompt_killed_while_a_pull_waits_then_the_test_ends(
        leak_check, prompt_server, fault_injector, linked_decoder, run: int) -> None:  # type: ignore[no-untyped-def]
    """The test ends right after the kill: what the dropped link held is gone by the leak check."""
    cache = linked_decoder.cache_manager.allocate_blocks_cache(DESC)
    await fault_injector.stop()
    pull = asyncio.ensure_future(linked_decoder.cache_manager.pull_blocks(
        prompt_server.caches["kv"].key, cache, [run % 16], [0]))
    await asyncio.sleep(0.02)
    assert not pull.done()
    await fault_injector.kill()
    with pytest.raises(LLMLinkError):
        await pull


BIG = CacheDesc(4, (64, 256 * 1024), DataType.DT_UINT8, Placement.HOST)  # 64 MiB: a pull takes a while


@pytest.mark.asyncio
@pytest.mark.parametrize("run", range(5))
async def test_a_tcp_prompt_killed_while_its_bytes_stream_then_the_test_ends(
        leak_check, prompt_server_factory, datadist_factory, run: int) -> None:  # type: ignore[no-untyped-def]
    """Killed at some moment of a 64 MiB pull (before, during or after its bytes; which one does not matter)."""
    server = await prompt_server_factory(caches={"kv": BIG}, options={"llm.Transport": "tcp"})
    decoder = await datadist_factory(options={"llm.SyncKvCacheWaitTime": "20000"})
    code, _ = await decoder.link_clusters([server.cluster_info()], timeout=5000)
    assert code == S.LLM_SUCCESS
    cache = decoder.cache_manager.allocate_blocks_cache(BIG)
    key = server.caches["kv"].key
    await decoder.cache_manager.pull_blocks(key, cache, [1], [1])
    pull = asyncio.ensure_future(decoder.cache_manager.pull_blocks(key, cache, list(range(64)), list(range(64))))
    await asyncio.sleep(0.002 * run)
    await server.kill()
    try:
        await pull
    except LLMLinkError:
        pass
