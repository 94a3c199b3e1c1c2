"""The two instances ``bench --device`` measures between: a prompt in another process and a decoder here, linked on
loopback, each with a device and a host blocks cache of 64 tensors x 256 blocks of 32 KiB; 128 scattered blocks of
each tensor move (256 MiB)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Final

import numpy as np

from aiodatadist import Cache, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement
from aiodatadist.testing import PeerProcess, cluster_info, free_port

__all__ = ["BLOCKS", "BLOCK_BYTES", "MOVED", "MOVED_BYTES", "TENSORS", "DevicePair", "device_pair"]

TENSORS: Final = 64
BLOCKS: Final = 256  # per tensor; 128 of them move
MOVED: Final = 128
BLOCK_BYTES: Final = 32 << 10
MOVED_BYTES: Final = TENSORS * MOVED * BLOCK_BYTES  # 256 MiB


def blocks_desc(placement: Placement) -> CacheDesc:
    return CacheDesc(TENSORS, (BLOCKS, BLOCK_BYTES), DataType.DT_UINT8, placement)


@dataclass
class DevicePair:
    """The prompt's caches go by ``BlocksCacheKey(1, 0)`` (device, ids ``dev_src``) and ``BlocksCacheKey(1, 1)``
    (host, ``host_src``), filled with random bytes; ``dev`` and ``host`` are the decoder's; the moved blocks are
    ``src_blocks`` there and ``dst_blocks`` here."""

    prompt: PeerProcess
    decoder: LLMDataDist
    dev_src: int
    host_src: int
    dev: Cache
    host: Cache
    src_blocks: list[int]
    dst_blocks: list[int]
    rng: np.random.Generator


@asynccontextmanager
async def device_pair(ordinal: int, transport: str | None = None) -> AsyncIterator[DevicePair]:
    """Start the prompt, link the decoder to it (``transport``: ``llm.Transport`` of both; None: the default),
    and finalize both afterwards."""
    rng = np.random.default_rng(1)
    src_blocks = [int(b) for b in rng.permutation(BLOCKS)[:MOVED]]
    dst_blocks = [int(b) for b in rng.permutation(BLOCKS)[:MOVED]]
    port = free_port()
    cfg, mine = LLMConfig(), LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    for config in (cfg, mine):
        config.device_id = ordinal
        if transport is not None:
            config.transport = transport
    prompt = await PeerProcess.start()
    try:
        await prompt.call("init", role="PROMPT", cluster_id=1, options=dict(cfg.generate_options()))
        shape = {"num_tensors": TENSORS, "shape": [BLOCKS, BLOCK_BYTES], "blocks": True}
        dev_src = (await prompt.call("allocate", **shape, placement="DEVICE", blocks_key=[1, 0]))["cache_id"]
        host_src = (await prompt.call("allocate", **shape, placement="HOST", blocks_key=[1, 1]))["cache_id"]
        await prompt.call("fill", cache_id=dev_src, seed=3)
        await prompt.call("fill", cache_id=host_src, seed=4)
        async with LLMDataDist(LLMRole.DECODER, 2) as decoder:
            await decoder.init(dict(mine.generate_options()))
            code, _ = await decoder.link_clusters([cluster_info(1, port)], timeout=10_000)
            if int(code) != 0:
                raise RuntimeError(f"link failed: {code!r}")
            cm = decoder.cache_manager
            dev = cm.allocate_blocks_cache(blocks_desc(Placement.DEVICE))
            host = cm.allocate_blocks_cache(blocks_desc(Placement.HOST))
            yield DevicePair(prompt, decoder, dev_src, host_src, dev, host, src_blocks, dst_blocks, rng)
        await prompt.call("finalize")
    finally:
        await prompt.close()
