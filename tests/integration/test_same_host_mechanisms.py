"""Each same-host mechanism on its own (mapping the peer's memfd, process_vm_readv/writev), and the error when
neither reaches the peer's memory.  AIODATADIST_SAME_HOST restricts what a process may use, standing in for an
OS that refuses the other mechanism."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
from helpers.data import pattern

from aiodatadist import BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMException, LLMRole, Placement
from aiodatadist.testing import PeerProcess, cluster_info, free_port

TENSORS, BLOCKS, BLOCK = 4, 32, 4096


def _desc() -> CacheDesc:
    return CacheDesc(TENSORS, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.HOST)


@pytest.fixture(params=["map", "pvm"])
async def setup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[
        tuple[str, PeerProcess, LLMDataDist]]:
    mechanism = request.param
    monkeypatch.setenv("AIODATADIST_SAME_HOST", mechanism)
    port = free_port()
    peer = await PeerProcess.start(env={"AIODATADIST_SAME_HOST": mechanism})
    try:
        await peer.call("init", role="PROMPT", cluster_id=1, options={"llm.listenIpInfo": f"127.0.0.1:{port}"})
        shm = await peer.call("allocate", blocks=True, num_tensors=TENSORS, shape=[BLOCKS, BLOCK], blocks_key=[1, 0])
        own = await peer.call("register", blocks=True, num_tensors=TENSORS, shape=[BLOCKS, BLOCK],
                              blocks_key=[1, 1])
        await peer.call("fill", cache_id=shm["cache_id"], seed=1)
        await peer.call("fill", cache_id=own["cache_id"], seed=2)
        async with LLMDataDist(LLMRole.DECODER, 2) as dd:
            await dd.init({})
            await dd.link_clusters([cluster_info(1, port)])
            yield mechanism, peer, dd
    finally:
        await peer.close()


def _check(cache: object, seed: int, src: list[int], dst: list[int]) -> None:
    for t, tensor in enumerate(cache.tensors):  # type: ignore[attr-defined]
        expected = pattern(seed, t, BLOCKS * BLOCK).reshape(BLOCKS, BLOCK)
        assert np.array_equal(tensor[dst], expected[src])


async def test_pull_from_shared_memory_cache(setup: tuple[str, PeerProcess, LLMDataDist]) -> None:
    mechanism, _, dd = setup
    assert f"({mechanism})" in dd.links()[0]["peer"]
    cache = dd.cache_manager.allocate_blocks_cache(_desc())
    await dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, [3, 4, 30], [0, 1, 2])
    _check(cache, 1, [3, 4, 30], [0, 1, 2])


async def test_pull_from_registered_memory(setup: tuple[str, PeerProcess, LLMDataDist]) -> None:
    mechanism, _, dd = setup
    cache = dd.cache_manager.allocate_blocks_cache(_desc())
    if mechanism == "pvm":
        await dd.cache_manager.pull_blocks(BlocksCacheKey(1, 1), cache, [5, 6], [7, 8])
        _check(cache, 2, [5, 6], [7, 8])
        return
    with pytest.raises(LLMException) as info:
        await dd.cache_manager.pull_blocks(BlocksCacheKey(1, 1), cache, [5, 6], [7, 8])
    message = str(info.value)
    assert "caller-registered" in message and "process_vm_readv" in message
    # The failed pull changed nothing and the link still works.
    assert all((t[[7, 8]] == 0).all() for t in cache.tensors)
    await dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, [9], [9])
    _check(cache, 1, [9], [9])


async def test_push_into_each_kind_of_memory(setup: tuple[str, PeerProcess, LLMDataDist]) -> None:
    mechanism, peer, dd = setup
    cache = dd.cache_manager.allocate_blocks_cache(_desc())
    for t, tensor in enumerate(cache.tensors):
        tensor.reshape(-1)[:] = pattern(9, t, BLOCKS * BLOCK)
    await dd.cache_manager.push_blocks(BlocksCacheKey(1, 0), cache, [2], [31])
    got = await peer.call("read", cache_id=1, tensor=3, offset=31 * BLOCK, nbytes=BLOCK)
    assert bytes.fromhex(got) == pattern(9, 3, BLOCKS * BLOCK)[2 * BLOCK: 3 * BLOCK].tobytes()
    if mechanism == "map":
        with pytest.raises(LLMException):
            await dd.cache_manager.push_blocks(BlocksCacheKey(1, 1), cache, [2], [31])
    else:
        await dd.cache_manager.push_blocks(BlocksCacheKey(1, 1), cache, [2], [31])
        got = await peer.call("read", cache_id=2, tensor=0, offset=31 * BLOCK, nbytes=BLOCK)
        assert bytes.fromhex(got) == pattern(9, 0, BLOCKS * BLOCK)[2 * BLOCK: 3 * BLOCK].tobytes()
