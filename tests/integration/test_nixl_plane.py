"""The nixl data plane (``llm.Transport=nixl``) between two real processes, with UCX choosing its transports
(on one host: ``cma`` reads) and with UCX restricted to TCP (``UCX_TLS=tcp``), as between hosts without RDMA;
its refusals; and what an instance without NIXL says.  The transfer conformance matrix, cancellation, a killed
peer and authentication run on this plane in test_transfers, test_cancellation, test_peer_faults and test_auth."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio
from helpers.data import fill_pattern, pattern
from helpers.marks import NIXL

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import PeerProcess, cluster_info, free_port
from aiodatadist.transport.nixl import nixl_available

pytestmark = pytest.mark.asyncio(loop_scope="module")

S = LLMStatusCode
PROMPT, DECODER = 61, 62
TENSORS, BLOCKS, BLOCK = 8, 64, 16 << 10
UCX = {"ucx-auto": {}, "ucx-tcp": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}}


def _desc(blocks: int = BLOCKS) -> CacheDesc:
    return CacheDesc(TENSORS, (blocks, BLOCK), DataType.DT_UINT8, Placement.HOST)


@pytest_asyncio.fixture(loop_scope="module", scope="module", params=list(UCX))
async def linked(request: pytest.FixtureRequest) -> AsyncIterator[tuple[PeerProcess, LLMDataDist, int]]:
    """A prompt process forcing the nixl plane and a decoder here, both with the same UCX settings."""
    if not nixl_available():
        pytest.skip("NIXL is not installed")
    env: dict[str, str] = UCX[request.param]
    port = free_port()
    peer = await PeerProcess.start(env=env)
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            for name, value in env.items():
                monkeypatch.setenv(name, value)  # UCX reads them when an agent starts its backend
            async with _decoder(peer, port) as linked:
                yield linked
    finally:
        await peer.close()


@contextlib.asynccontextmanager
async def _decoder(peer: PeerProcess, port: int) -> AsyncIterator[tuple[PeerProcess, LLMDataDist, int]]:
    """The peer as a prompt forcing nixl, with a filled blocks cache, and a decoder here linked to it."""
    await peer.call("init", role="PROMPT", cluster_id=PROMPT,
                    options={"llm.listenIpInfo": f"127.0.0.1:{port}", "llm.Transport": "nixl"})
    remote = await peer.call("allocate", blocks=True, num_tensors=TENSORS, shape=[BLOCKS, BLOCK],
                             blocks_key=[PROMPT, 0])
    await peer.call("fill", cache_id=remote["cache_id"], seed=3)
    async with LLMDataDist(LLMRole.DECODER, DECODER) as dd:
        await dd.init(LLMConfig().generate_options())
        assert (await dd.link_clusters([cluster_info(PROMPT, port)], timeout=5000))[0] == S.LLM_SUCCESS
        assert dd.links()[0]["plane"] == "nixl"
        assert dd.links()[0]["data_connections"] == 0
        yield peer, dd, int(remote["cache_id"])


@NIXL
async def test_pulls_and_pushes_are_byte_exact(linked: tuple[PeerProcess, LLMDataDist, int]) -> None:
    peer, dd, remote_id = linked
    cm = dd.cache_manager
    key = BlocksCacheKey(PROMPT, 0)
    cache = cm.allocate_blocks_cache(_desc())
    for t in cache.tensors:
        t[...] = 0
    src, dst = [5, 0, 63, 17, 18, 19], [1, 2, 3, 40, 41, 42]
    await cm.pull_blocks(key, cache, src, dst)
    untouched = sorted(set(range(BLOCKS)) - set(dst))
    for t, tensor in enumerate(cache.tensors):
        want = pattern(3, t, BLOCKS * BLOCK).reshape(BLOCKS, BLOCK)
        assert np.array_equal(tensor[dst], want[src]), f"tensor {t}"
        assert not tensor[untouched].any()
    # a push of other blocks, then the owner's bytes are read back
    mine = fill_pattern(cache, 9)
    await cm.push_blocks(key, cache, [7, 8], [60, 30])
    for t in (0, TENSORS - 1):
        for src_block, dst_block in ((7, 60), (8, 30)):
            got = await peer.call("read", cache_id=remote_id, tensor=t, offset=dst_block * BLOCK, nbytes=BLOCK)
            assert bytes.fromhex(got) == mine[t][src_block * BLOCK:(src_block + 1) * BLOCK].tobytes()
    await peer.call("fill", cache_id=remote_id, seed=3)  # as the other tests expect it
    # by cache id and batch index (a whole slot: the prepared lists' unit is the slot)
    whole = await peer.call("allocate", blocks=False, num_tensors=TENSORS, shape=[2, BLOCK])
    await peer.call("fill", cache_id=whole["cache_id"], seed=4)
    contiguous = cm.allocate_cache(CacheDesc(TENSORS, (2, BLOCK), DataType.DT_UINT8, Placement.HOST))
    await cm.pull_cache(CacheKeyByIdAndIndex(PROMPT, whole["cache_id"], 1), contiguous, 0)
    for t, tensor in enumerate(contiguous.tensors):
        assert np.array_equal(tensor[0], pattern(4, t, 2 * BLOCK).reshape(2, BLOCK)[1])


@NIXL
async def test_concurrent_pulls_each_land_where_they_should(linked: tuple[PeerProcess, LLMDataDist, int]) -> None:
    _, dd, _ = linked
    cm = dd.cache_manager
    cache = cm.allocate_blocks_cache(_desc())
    blocks = list(range(BLOCKS))
    await asyncio.gather(*(cm.pull_blocks(BlocksCacheKey(PROMPT, 0), cache, [b], [BLOCKS - 1 - b]) for b in blocks))
    for t, tensor in enumerate(cache.tensors):
        want = pattern(3, t, BLOCKS * BLOCK).reshape(BLOCKS, BLOCK)
        assert np.array_equal(tensor[::-1], want)


@NIXL
async def test_caches_freed_and_created_again_stay_reachable(linked: tuple[PeerProcess, LLMDataDist, int]) -> None:
    """The owner frees caches the requester's agent loaded and creates new ones (maybe at the same addresses):
    the peer's stale regions must not shadow the new caches."""
    peer, dd, _ = linked
    cm = dd.cache_manager
    cache = cm.allocate_blocks_cache(_desc(4))
    for round_ in range(6):
        shape = [4, BLOCK * (1 + round_ % 3)]
        made = await peer.call("register", blocks=True, num_tensors=TENSORS, shape=shape, blocks_key=[PROMPT, 1])
        await peer.call("fill", cache_id=made["cache_id"], seed=10 + round_)
        target = cm.allocate_blocks_cache(CacheDesc(TENSORS, tuple(shape), DataType.DT_UINT8, Placement.HOST))
        await cm.pull_blocks(BlocksCacheKey(PROMPT, 1), target, [3, 0], [0, 1])
        for t, tensor in enumerate(target.tensors):
            want = pattern(10 + round_, t, shape[0] * shape[1]).reshape(shape)
            assert np.array_equal(tensor[:2], want[[3, 0]]), f"round {round_} tensor {t}"
        cm.deallocate_blocks_cache(target)
        await peer.call("release", cache_id=made["cache_id"])
    await cm.pull_blocks(BlocksCacheKey(PROMPT, 0), cache, [9], [2])
    assert np.array_equal(cache.tensors[1][2], pattern(3, 1, BLOCKS * BLOCK).reshape(BLOCKS, BLOCK)[9])


@NIXL
@pytest.mark.parametrize("other", ["tcp", "shm"])
async def test_nixl_against_another_forced_transport_is_refused_on_both_sides(other: str) -> None:
    port = free_port()
    async with LLMDataDist(LLMRole.PROMPT, 1) as server, LLMDataDist(LLMRole.DECODER, 2) as client:
        await server.init({"llm.listenIpInfo": f"127.0.0.1:{port}", "llm.Transport": "nixl"})
        await client.init({"llm.Transport": other})
        _, codes = await client.link_clusters([cluster_info(1, port)], timeout=3000)
        assert codes == [S.LLM_LINK_FAILED]
        await asyncio.sleep(0.1)
        assert server.links() == [] and client.links() == []


async def test_without_nixl_the_option_says_what_to_install() -> None:
    """NIXL hidden from a fresh interpreter: ``init`` with ``llm.Transport=nixl`` raises
    LLM_FEATURE_NOT_ENABLED naming the extra, and the core imports without it."""
    script = """
import asyncio, sys
for name in ("nixl", "nixl_cu12", "nixl_cu13"):
    sys.modules[name] = sys.modules[name + "._api"] = None
from aiodatadist import LLMDataDist, LLMException, LLMRole
async def main():
    dd = LLMDataDist(LLMRole.DECODER, 5)
    try:
        await dd.init({"llm.Transport": "nixl"})
    except LLMException as exc:
        print(exc.status_code.name, "|", exc)
    await dd.finalize()
asyncio.run(main())
"""
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", script], capture_output=True, text=True,
                                  timeout=60, check=True)
    assert out.stdout.startswith("LLM_FEATURE_NOT_ENABLED |"), out.stdout + out.stderr
    assert "pip install 'aiodatadist[nixl]'" in out.stdout
