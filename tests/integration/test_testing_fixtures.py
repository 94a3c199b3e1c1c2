"""The pytest plugin's fixtures (``aiodatadist.testing.plugin``) and the helpers behind them, used as a user's
suite uses them: a prompt in a child process, a decoder linked to it, faults, and ``PeerProcess`` itself.

Real processes, real ZeroMQ on 127.0.0.1, real shared memory; every transfer is checked byte for byte against
the random bytes the prompt was filled with.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from aiodatadist import (
    Cache,
    CacheDesc,
    DataType,
    LinkDropReason,
    LLMDataDist,
    LLMException,
    LLMStatusCode,
    Placement,
    cluster_info_for,
)
from aiodatadist.testing import (
    FaultInjector,
    PeerError,
    PeerProcess,
    PromptServer,
    assert_blocks_landed,
    block_rows,
    cluster_info,
    local_prompt,
    tensor_bytes,
    wait_linked,
    wait_unlinked,
)

GONE = (LLMStatusCode.LLM_NOT_YET_LINK, LLMStatusCode.LLM_LINK_FAILED)


def local_cache(decoder: LLMDataDist, server: PromptServer, name: str = "kv") -> Cache:
    desc = server.caches[name].desc
    cache = decoder.cache_manager.allocate_blocks_cache(CacheDesc(desc.num_tensors, tuple(desc.shape),
                                                                  desc.data_type, Placement.HOST))
    for t in cache.tensors:
        t[...] = 0  # the pattern is never 0
    return cache


async def pull_and_check(decoder: LLMDataDist, server: PromptServer, cache: Cache, src: list[int],
                         dst: list[int], name: str = "kv") -> None:
    await decoder.cache_manager.pull_blocks(server.caches[name].key, cache, src, dst)
    got = block_rows(tensor_bytes(cache), cache.cache_desc.shape[0], dst)
    for have, want in zip(got, server.expected(name, src), strict=True):
        np.testing.assert_array_equal(have, want)


def random_blocks(n: int, count: int) -> tuple[list[int], list[int]]:
    rng = random.Random()
    return rng.sample(range(n), count), rng.sample(range(n), count)


# -- prompt_server, linked_decoder ----------------------------------------------------------------------------
async def test_linked_decoder_pulls_the_prompt_servers_random_bytes(prompt_server: PromptServer,
                                                                     linked_decoder: LLMDataDist) -> None:
    host, port, cluster_id = prompt_server.address
    assert (host, cluster_id) == ("127.0.0.1", prompt_server.cluster_id) and port > 0
    assert [link["remote_cluster_id"] for link in linked_decoder.links()] == [cluster_id]
    cache = local_cache(linked_decoder, prompt_server)
    src, dst = random_blocks(16, 6)
    await pull_and_check(linked_decoder, prompt_server, cache, src, dst)
    # what the test computed is what the process holds
    for have, want in zip(await prompt_server.read("kv"), prompt_server.expected("kv"), strict=True):
        np.testing.assert_array_equal(have, want)


async def test_written_and_refilled_bytes_are_what_pulls_see(prompt_server: PromptServer,
                                                             linked_decoder: LLMDataDist) -> None:
    cache = local_cache(linked_decoder, prompt_server)
    data = np.random.default_rng().integers(1, 256, 3000, dtype=np.uint8)
    await prompt_server.write("kv", 2, data, offset=500)
    await pull_and_check(linked_decoder, prompt_server, cache, list(range(16)), list(range(16)))
    assert bytes(tensor_bytes(cache)[2][500:3500]) == data.tobytes()
    seed = await prompt_server.fill("kv")
    await pull_and_check(linked_decoder, prompt_server, cache, [3], [9])
    assert seed == (await prompt_server.fill("kv", seed))


async def test_prompt_server_factory_caches_and_options(
        prompt_server_factory: Callable[..., Awaitable[PromptServer]],
        datadist_factory: Callable[..., Awaitable[LLMDataDist]]) -> None:
    server = await prompt_server_factory(caches={"k": CacheDesc(2, (8, 256), DataType.DT_FLOAT16, Placement.HOST),
                                                 "v": CacheDesc(2, (8, 512), DataType.DT_UINT8, Placement.HOST)})
    assert [c.key.model_id for c in server.caches.values()] == [0, 1]
    decoder = await datadist_factory()
    assert (await decoder.link_clusters([server.cluster_info()], timeout=5000))[0] == LLMStatusCode.LLM_SUCCESS
    for name in ("k", "v"):
        await pull_and_check(decoder, server, local_cache(decoder, server, name), [7, 0], [1, 2], name)


# -- faults ----------------------------------------------------------------------------------------------------
async def test_stopped_prompt_times_out_then_serves_again(prompt_server: PromptServer,
                                                          fault_injector: FaultInjector,
                                                          linked_decoder: LLMDataDist) -> None:
    cache = local_cache(linked_decoder, prompt_server)
    async with fault_injector.stopped():
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await linked_decoder.cache_manager.pull_blocks(prompt_server.caches["kv"].key, cache, [1], [1])
    await pull_and_check(linked_decoder, prompt_server, cache, [2], [3])


async def test_stalled_control_connection_times_out_then_passes(prompt_server: PromptServer,
                                                                fault_injector: FaultInjector,
                                                                linked_decoder: LLMDataDist) -> None:
    assert linked_decoder.links()[0]["endpoint"].endswith(f":{fault_injector.address.port}")
    cache = local_cache(linked_decoder, prompt_server)
    fault_injector.stall_control()
    assert fault_injector.control_mode == "stall"
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await linked_decoder.cache_manager.pull_blocks(prompt_server.caches["kv"].key, cache, [1], [1])
    fault_injector.pass_control()
    await pull_and_check(linked_decoder, prompt_server, cache, [4], [5])


async def test_cut_control_connection_drops_the_link(prompt_server: PromptServer, fault_injector: FaultInjector,
                                                     linked_decoder: LLMDataDist) -> None:
    fault_injector.cut_control()
    cache = local_cache(linked_decoder, prompt_server)
    with pytest.raises(LLMException) as info:
        async with asyncio.timeout(10):
            while True:  # the drop is noticed within the heartbeat
                await linked_decoder.cache_manager.pull_blocks(prompt_server.caches["kv"].key, cache, [1], [1])
                await asyncio.sleep(0.05)
    assert info.value.status_code in GONE
    # the proxy's port still accepts connections: the decoder cannot tell a cut from a silent peer
    assert await fault_injector.taken_effect(linked_decoder) == LinkDropReason.HEARTBEAT_LOST
    fault_injector.pass_control()
    code, _ = await linked_decoder.link_clusters([fault_injector.cluster_info()], timeout=5000)
    assert code == LLMStatusCode.LLM_SUCCESS
    await pull_and_check(linked_decoder, prompt_server, cache, [6], [7])


async def test_cut_tcp_data_connections(prompt_server_factory: Callable[..., Awaitable[PromptServer]],
                                        datadist_factory: Callable[..., Awaitable[LLMDataDist]]) -> None:
    server = await prompt_server_factory(options={"llm.Transport": "tcp"})
    async with FaultInjector.start(server) as faults:
        decoder = await datadist_factory()
        assert (await decoder.link_clusters([server.cluster_info()], timeout=5000))[0] == LLMStatusCode.LLM_SUCCESS
        assert decoder.links()[0]["plane"] == "tcp"
        cache = local_cache(decoder, server)
        await pull_and_check(decoder, server, cache, [0], [0])
        assert faults.cut_data() > 0
        with pytest.raises(LLMException):
            await pull_and_check(decoder, server, cache, [1], [1])


async def test_killed_prompt_restarts_with_its_bytes(prompt_server: PromptServer, fault_injector: FaultInjector,
                                                     linked_decoder: LLMDataDist) -> None:
    cache = local_cache(linked_decoder, prompt_server)
    old_pid, port = prompt_server.pid, prompt_server.port
    assert await fault_injector.kill() == -9
    assert not prompt_server.alive
    # through the proxy, whose port still accepts connections (linked directly: PEER_GONE)
    assert await fault_injector.taken_effect(linked_decoder) == LinkDropReason.HEARTBEAT_LOST
    await fault_injector.restart(port=0)  # elsewhere: the proxy follows
    assert prompt_server.pid != old_pid and prompt_server.port != port
    relink = asyncio.create_task(linked_decoder.link_clusters([fault_injector.cluster_info()], timeout=5000))
    link = await wait_linked(linked_decoder, prompt_server.cluster_id)  # as code linking in the background
    assert str(link["endpoint"]).endswith(f":{fault_injector.address.port}")
    code, _ = await relink
    assert code == LLMStatusCode.LLM_SUCCESS
    await pull_and_check(linked_decoder, prompt_server, cache, [9, 10], [0, 1])
    assert_blocks_landed(cache, [0, 1], prompt_server, [9, 10])


async def test_wait_unlinked_waits_for_the_drop_and_says_why(prompt_server: PromptServer,
                                                             linked_decoder: LLMDataDist) -> None:
    cluster = prompt_server.cluster_id
    with pytest.raises(TimeoutError, match=f"dropping its link to cluster {cluster} not true within 0.1 s"):
        await wait_unlinked(linked_decoder, cluster, 0.1)
    assert await wait_unlinked(linked_decoder, cluster + 1) is None  # never linked
    await linked_decoder.unlink_clusters([prompt_server.cluster_info()])
    assert await wait_unlinked(linked_decoder, cluster) == LinkDropReason.UNLINKED
    with pytest.raises(TimeoutError, match=f"linked to cluster {cluster} not true"):
        await wait_linked(linked_decoder, cluster, 0.1)


# -- PeerProcess ---------------------------------------------------------------------------------------------
async def test_peer_process_reports_its_port_and_times_out_calls() -> None:
    async with PeerProcess.start(call_timeout=30) as peer:
        host, port = await peer.init(5) or ("", 0)
        assert (host, peer.listen_address) == ("127.0.0.1", (host, port)) and port > 0
        async with local_prompt(6) as other:  # a real server on the other side, on its own free port
            address = other.listen_address
            assert address is not None
            code, _ = await peer.call("link", cluster_id=6, port=address[1])
            assert code == 0
            with pytest.raises(TimeoutError, match="did not answer 'sleep'"):
                await peer.call("sleep", seconds=5, reply_timeout=0.1)
            assert await peer.call("ping") == "pong"  # a late reply does not confuse the next one
        with pytest.raises(PeerError) as info:
            await peer.call("transfer", op="pull_blocks", cache_id=12345, key={}, dst_blocks=[0])
        assert info.value.kind == "KeyError"
    assert peer.returncode == 0
    with pytest.raises(PeerError, match="exited"):
        await peer.call("ping")


async def test_peer_process_works_from_another_event_loop_and_thread() -> None:
    peer = await PeerProcess.start()
    try:
        await peer.init(7)
        results: list[Any] = []

        def elsewhere() -> None:
            async def use() -> Any:
                return await peer.call("links"), await peer.call("ping", reply_timeout=10)
            results.append(asyncio.run(use()))

        thread = threading.Thread(target=elsewhere)
        thread.start()
        await asyncio.to_thread(thread.join, 30)
        assert results == [([], "pong")]
    finally:
        status = await peer.kill()
        await peer.close()
    assert status == -9 and peer.returncode == -9


def test_cluster_info_for_is_public_and_testing_cluster_info_still_works() -> None:
    info = cluster_info_for(3, "10.1.2.3", 26000)
    assert info.remote_cluster_id == 3 and len(info.remote_ip_info_list) == 1
    assert info.remote_ip_info_list[0][1] == 26000 and len(info.local_ip_info_list) == 1
    old = cluster_info(3, 26000, "10.1.2.3")
    assert (old.remote_ip_info_list, old.local_ip_info_list) == (info.remote_ip_info_list, info.local_ip_info_list)
    with pytest.raises(ValueError):
        cluster_info_for(3, "10.1.2.3", 70000)
