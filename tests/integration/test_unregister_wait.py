"""Unregistering caller-owned memory while a peer process pushes into it: ``unregister_cache_and_wait`` (and the
blocking API's ``unregister_cache``) return only once the peer stopped writing, so the memory may be freed."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from collections.abc import AsyncIterator

import numpy as np
import pytest
from helpers.internals import registry_of

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    LLMTimeoutError,
    Placement,
)
from aiodatadist.testing import PeerProcess, free_port

S = LLMStatusCode
OWNER, PUSHER = 71, 72
TENSORS, BLOCKS, BLOCK = 16, 128, 128 << 10  # 256 MiB: a push takes tens of ms


Owner = tuple[LLMDataDist, PeerProcess, list[np.ndarray], int, int]  # instance, peer, memory, cache id, peer's


def _desc() -> CacheDesc:
    return CacheDesc(TENSORS, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.HOST)


@pytest.fixture
async def owner() -> AsyncIterator[Owner]:
    """This process owns a registered (caller-owned) blocks cache; a peer process is linked to it and has a
    filled cache of the same shape to push from."""
    port = free_port()
    peer = await PeerProcess.start()
    try:
        async with LLMDataDist(LLMRole.PROMPT, OWNER) as dd:
            cfg = LLMConfig()
            cfg.listen_ip_info = f"127.0.0.1:{port}"
            cfg.sync_kv_timeout = 30000
            await dd.init(cfg.generate_options())
            buffers = [np.zeros(_desc().size, dtype=np.uint8) for _ in range(TENSORS)]
            cache = dd.cache_manager.register_blocks_cache(_desc(), [int(b.ctypes.data) for b in buffers],
                                                           BlocksCacheKey(OWNER, 0))
            await peer.call("init", role="DECODER", cluster_id=PUSHER, options={"llm.SyncKvCacheWaitTime": "30000"})
            assert (await peer.call("link", cluster_id=OWNER, port=port))[0] == S.LLM_SUCCESS
            source = await peer.call("allocate", blocks=True, num_tensors=TENSORS, shape=[BLOCKS, BLOCK])
            await peer.call("fill", cache_id=source["cache_id"], seed=4)
            yield dd, peer, buffers, int(cache.cache_id), int(source["cache_id"])
    finally:
        await peer.close()


def _digest(buffers: list[np.ndarray]) -> list[bytes]:
    return [hashlib.sha256(b.tobytes()).digest() for b in buffers]


async def _push_started(peer: PeerProcess, source: int, buffers: list[np.ndarray]) -> asyncio.Future[object]:
    """Start the peer's push of every block into ours; returns once its first bytes landed."""
    blocks = list(range(BLOCKS))
    push = asyncio.ensure_future(peer.call("transfer", op="push_blocks", cache_id=source,
                                           key={"type": "blocks", "cluster_id": OWNER, "model_id": 0},
                                           src_blocks=blocks, dst_blocks=blocks))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not buffers[0].any() and loop.time() < deadline and not push.done():
        await asyncio.sleep(0.0005)
    return push


async def test_unregistering_during_a_push_returns_once_the_peer_stopped_writing(
        owner: Owner) -> None:
    dd, peer, buffers, cache_id, source = owner
    entry = registry_of(dd.cache_manager).by_id(cache_id)
    push = await _push_started(peer, source, buffers)
    if push.done():
        pytest.skip("the push ended before the cache could be unregistered")
    await dd.cache_manager.unregister_cache_and_wait(cache_id)
    assert entry.leases == 0, "the peer may still be writing: its transfer has not ended"
    first = _digest(buffers)
    await asyncio.sleep(0.2)
    assert _digest(buffers) == first, "bytes landed after unregister_cache_and_wait returned"
    with pytest.raises(Exception, match="LLM_KV_CACHE_NOT_EXIST|released the cache"):
        await push
    assert dd.links() and dd.links()[0]["remote_cluster_id"] == PUSHER  # the link is still there


async def test_a_peer_that_does_not_stop_loses_its_link_and_the_call_times_out(
        owner: Owner) -> None:
    dd, peer, buffers, cache_id, source = owner
    push = await _push_started(peer, source, buffers)
    if push.done():
        pytest.skip("the push ended before the peer could be stopped")
    os.kill(peer.pid, signal.SIGSTOP)  # mid-push: it holds its lease and never answers the ABORT
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(LLMTimeoutError, match=str(PUSHER)):
            await dd.cache_manager.unregister_cache_and_wait(cache_id, timeout=0.3)
        assert loop.time() - started < 2.0
        assert dd.links() == []
    finally:
        os.kill(peer.pid, signal.SIGCONT)
    with pytest.raises(Exception):  # noqa: B017 - the push fails, whichever way the peer learns it
        await push


async def test_bad_arguments_and_unknown_ids(owner: Owner) -> None:
    dd, _, _, cache_id, _ = owner
    for timeout in (0, -1.0, "1", True):
        with pytest.raises(Exception) as info:
            await dd.cache_manager.unregister_cache_and_wait(cache_id, timeout=timeout)  # type: ignore[arg-type]
        assert getattr(info.value, "status_code", None) == S.LLM_PARAM_INVALID
    await dd.cache_manager.unregister_cache_and_wait(cache_id)  # idle: returns at once
    await dd.cache_manager.unregister_cache_and_wait(cache_id)  # unknown now: ignored, as unregister_cache
