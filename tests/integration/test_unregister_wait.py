"""Unregistering caller-owned memory while a peer process pushes into it: ``unregister_cache_and_wait`` (and the
blocking API's ``unregister_cache``) return only once the peer stopped writing, so the memory may be freed.

Each case runs twice: a first push (through the owner: ``BEGIN``, a lease, ``END``), and a push by a key the peer
resolved before, which writes without a round trip; unregistering then sends ``WITHDRAW`` and waits for the peer's
``END``."""

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
from aiodatadist.testing import PeerError, PeerProcess, free_port, pattern

S = LLMStatusCode
OWNER, PUSHER = 71, 72
TENSORS, BLOCKS, BLOCK = 16, 128, 128 << 10  # 256 MiB: a push takes tens of ms


Owner = tuple[LLMDataDist, PeerProcess, list[np.ndarray], int, int]  # instance, peer, memory, cache id, peer's


def _desc() -> CacheDesc:
    return CacheDesc(TENSORS, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.HOST)


KEY = {"type": "blocks", "cluster_id": OWNER, "model_id": 0}


@pytest.fixture(params=[False, True], ids=["through-the-owner", "one-sided"])
async def owner(request: pytest.FixtureRequest) -> AsyncIterator[Owner]:
    """This process owns a registered (caller-owned) blocks cache; a peer process is linked to it and has a
    filled cache of the same shape to push from.  ``one-sided``: the peer pushed one block before (the memory
    is zeroed again), so its next push by the same key goes without a round trip."""
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
            if request.param:
                await peer.call("transfer", op="push_blocks", cache_id=source["cache_id"], key=KEY,
                                src_blocks=[0], dst_blocks=[1])
                assert buffers[0][BLOCK:2 * BLOCK].any()
                for buffer in buffers:
                    buffer[:] = 0
            yield dd, peer, buffers, int(cache.cache_id), int(source["cache_id"])
    finally:
        await peer.close()


def _digest(buffers: list[np.ndarray]) -> list[bytes]:
    return [hashlib.sha256(b.tobytes()).digest() for b in buffers]


async def _push_started(peer: PeerProcess, source: int, buffers: list[np.ndarray]) -> asyncio.Future[object]:
    """Start the peer's push of every block into ours; returns once its first bytes landed."""
    blocks = list(range(BLOCKS))
    push = asyncio.ensure_future(peer.call("transfer", op="push_blocks", cache_id=source, key=KEY,
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
    resolved = dd.stats().served_of(PUSHER, "push") is not None
    assert entry.leases == (0 if resolved else 1), "a resolved key writes one-sided, a first push under a lease"
    await dd.cache_manager.unregister_cache_and_wait(cache_id)
    assert entry.leases == 0, "the peer may still be writing: its transfer has not ended"
    first = _digest(buffers)
    await asyncio.sleep(0.2)
    assert _digest(buffers) == first, "bytes landed after unregister_cache_and_wait returned"
    with pytest.raises(PeerError) as failed:
        await push
    assert failed.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
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
        assert loop.time() - started < 5.0  # its 0.3 s (late on a loaded machine), not the peer's 30 s
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


async def test_pushes_by_a_resolved_key_skip_the_round_trip_and_land_whole(owner: Owner) -> None:
    dd, peer, buffers, cache_id, source = owner
    blocks = list(range(0, BLOCKS, 3))
    for _ in range(3):
        await peer.call("transfer", op="push_blocks", cache_id=source, key=KEY, src_blocks=blocks,
                        dst_blocks=blocks)
    after = dd.stats().served_of(PUSHER, "push")
    assert after is not None and after.operations == 1, "only the first push by the key goes through the owner"
    for t, buffer in enumerate(buffers):
        expected = pattern(4, t, buffer.nbytes).reshape(BLOCKS, BLOCK)
        got = buffer.reshape(BLOCKS, BLOCK)
        assert np.array_equal(got[blocks], expected[blocks])
        assert not np.delete(got, blocks, axis=0).any()
    await dd.cache_manager.unregister_cache_and_wait(cache_id)  # WITHDRAW answered with nothing running
    with pytest.raises(PeerError) as failed:
        await peer.call("transfer", op="push_blocks", cache_id=source, key=KEY, src_blocks=[0], dst_blocks=[0])
    assert failed.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    assert not buffers[0][:BLOCK].any() or np.array_equal(buffers[0][:BLOCK], pattern(4, 0, BLOCK))
    assert [link["remote_cluster_id"] for link in dd.links()] == [PUSHER]  # the link survives
