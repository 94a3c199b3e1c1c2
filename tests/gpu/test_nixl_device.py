"""The nixl plane with device caches (NIXL registers them as VRAM): pulls and pushes between processes,
byte-exact.  Needs NIXL and a real GPU (UCX's CUDA transports do not run on the emulated one)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.data import fill_pattern, tensor_bytes
from helpers.marks import NIXL

from aiodatadist import BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMRole, LLMStatusCode, Placement
from aiodatadist.testing import PeerProcess, cluster_info, free_port

S = LLMStatusCode
BLOCKS, BLOCK = 64, 32 << 10
UCX = {"UCX_TLS": "cuda_ipc,cuda_copy,tcp,self", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}  # fair settings (design notes)


@NIXL
@pytest.mark.real_gpu
async def test_device_caches_move_on_the_nixl_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in UCX.items():
        monkeypatch.setenv(name, value)
    port = free_port()
    async with PeerProcess.start(env=UCX) as peer:
        await peer.call("init", role="PROMPT", cluster_id=1,
                        options={"llm.listenIpInfo": f"127.0.0.1:{port}", "llm.Transport": "nixl"})
        cid = (await peer.call("allocate", blocks=True, num_tensors=4, shape=[BLOCKS, BLOCK], placement="DEVICE",
                               blocks_key=[1, 0]))["cache_id"]
        await peer.call("fill", cache_id=cid, seed=3)
        async with LLMDataDist(LLMRole.DECODER, 2) as dd:
            await dd.init({"llm.Transport": "nixl"})
            assert (await dd.link_clusters([cluster_info(1, port)], timeout=10_000))[0] == S.LLM_SUCCESS
            assert dd.links()[0]["plane"] == "nixl" and dd.links()[0]["device_path"] == "nixl"
            cache = dd.cache_manager.allocate_blocks_cache(CacheDesc(4, (BLOCKS, BLOCK), DataType.DT_UINT8,
                                                                     Placement.DEVICE))
            ours = [t.reshape(BLOCKS, BLOCK) for t in fill_pattern(cache, 5)]
            src, dst = [5, 0, 63, 17], [1, 2, 3, 40]
            await dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src, dst)
            got = [t.reshape(BLOCKS, BLOCK) for t in tensor_bytes(cache)]
            for t in range(4):
                theirs = np.frombuffer(bytes.fromhex(await peer.call("read", cache_id=cid, tensor=t, offset=0,
                                                                      nbytes=BLOCKS * BLOCK)), np.uint8)
                expect = ours[t].copy()
                expect[dst] = theirs.reshape(BLOCKS, BLOCK)[src]
                assert np.array_equal(got[t], expect)
            await dd.cache_manager.push_blocks(BlocksCacheKey(1, 0), cache, [7], [60])
            for t in range(4):
                back = bytes.fromhex(await peer.call("read", cache_id=cid, tensor=t, offset=60 * BLOCK, nbytes=BLOCK))
                assert back == got[t][7].tobytes()
        await peer.call("finalize")
