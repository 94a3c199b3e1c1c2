"""A link between a CUDA process and an ACL process (both emulated here, or whichever are real): device caches
cannot cross by IPC, so a same-host link refuses them with ``LLM_FEATURE_NOT_ENABLED`` saying why (the link and
its host caches stay usable), while over TCP each side stages its own device memory and the blocks land
byte-exact."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.data import fill_pattern, tensor_bytes

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    Placement,
)
from aiodatadist.errors import LLMStatusCode
from aiodatadist.settings.environment import ENV_DEVICE_RUNTIME
from aiodatadist.testing import PeerProcess, cluster_info, free_port, pattern

pytestmark = pytest.mark.usefixtures("device_runtime")
S = LLMStatusCode
BLOCKS, BLOCK = 16, 4096


@pytest.fixture(autouse=True)
def _acl_here(device_runtime: str) -> None:
    if device_runtime != "acl":
        pytest.skip("this process is the ACL side (the peer the CUDA one)")


@pytest.mark.parametrize("transport", ["auto", "tcp"])
async def test_a_cuda_owner_and_an_acl_requester(transport: str) -> None:
    port = free_port()
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    options = {**dict(cfg.generate_options()), "llm.Transport": transport}
    peer = await PeerProcess.start(env={ENV_DEVICE_RUNTIME: "cuda"})
    try:
        await peer.call("init", role="PROMPT", cluster_id=1, options=options)
        dev_cid = (await peer.call("allocate", num_tensors=2, shape=[BLOCKS, BLOCK], blocks=True,
                                   placement="DEVICE", blocks_key=[1, 0]))["cache_id"]
        await peer.call("fill", cache_id=dev_cid, seed=5)
        host_cid = (await peer.call("allocate", num_tensors=2, shape=[BLOCKS, BLOCK], blocks=True,
                                    placement="HOST", blocks_key=[1, 1]))["cache_id"]
        await peer.call("fill", cache_id=host_cid, seed=3)
        async with LLMDataDist(LLMRole.DECODER, 2) as decoder:
            await decoder.init({"llm.Transport": transport})
            code, _ = await decoder.link_clusters([cluster_info(1, port)], timeout=10_000)
            assert code == S.LLM_SUCCESS
            cm = decoder.cache_manager
            dst = cm.allocate_blocks_cache(CacheDesc(2, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.DEVICE))
            ours = fill_pattern(dst, 4)
            assert decoder.cache_manager._device().runtime.name == "acl"
            if transport == "tcp":  # each side stages its own device memory
                await cm.pull_blocks(BlocksCacheKey(1, 0), dst, [2, 5], [7, 8])
                got = [t.reshape(BLOCKS, -1) for t in tensor_bytes(dst)]
                for t in range(2):
                    expect = ours[t].reshape(BLOCKS, -1).copy()
                    expect[[7, 8]] = pattern(5, t, BLOCKS * BLOCK).reshape(BLOCKS, -1)[[2, 5]]
                    assert np.array_equal(got[t], expect)
            else:
                with pytest.raises(LLMException) as info:
                    await cm.pull_blocks(BlocksCacheKey(1, 0), dst, [2, 5], [7, 8])
                assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
                assert "CUDA" in str(info.value) and "ACL" in str(info.value) and "tcp" in str(info.value)
                assert all(np.array_equal(a, b) for a, b in zip(tensor_bytes(dst), ours))  # nothing landed
            host = cm.allocate_blocks_cache(CacheDesc(2, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.HOST))
            await cm.pull_blocks(BlocksCacheKey(1, 1), host, [1], [1])  # the link still moves host caches
            assert len(decoder.links()) == 1
        await peer.call("finalize")
    finally:
        await peer.close()
