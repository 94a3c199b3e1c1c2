"""Transfer plans are cached by their arguments (block lists and both caches' geometries), never by memory: a key
re-bound to other memory, or to a cache of another geometry, moves the new cache's bytes with the right plan."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.data import blocks, fill_pattern

from aiodatadist import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMException, Placement
from aiodatadist.layout.plans import CacheGeometry, TransferParams, transfer_plan
from aiodatadist.testing import linked_pair


def _config(transport: str) -> LLMConfig:
    cfg = LLMConfig()
    cfg.transport = transport
    return cfg


def _desc(block: int) -> CacheDesc:
    return CacheDesc(4, (16, block), DataType.DT_UINT8, Placement.HOST)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_key_rebound_to_other_memory_moves_the_new_bytes(transport: str) -> None:
    """The same pull (same key, same lists) before and after the owner re-binds the key: to another cache of the
    same geometry (other memory), then to one of another block size; each pull lands the current cache's bytes."""
    async with linked_pair(config=_config(transport)) as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        dst = dcm.allocate_blocks_cache(_desc(256))
        src_blocks, dst_blocks = [3, 4, 9], [0, 7, 8]
        for seed, block in ((11, 256), (12, 256), (13, 128)):
            src = pcm.allocate_blocks_cache(_desc(block), BlocksCacheKey(1, 5))
            fill_pattern(src, seed)
            if block != 256:
                dst = dcm.allocate_blocks_cache(_desc(block))
            fill_pattern(dst, seed + 100)
            for _ in range(3):  # the first through the owner, the next from the cached plan (one-sided too)
                await dcm.pull_blocks(BlocksCacheKey(1, 5), dst, src_blocks, dst_blocks)
                assert all(np.array_equal(a, b) for a, b in zip(blocks(src, src_blocks), blocks(dst, dst_blocks)))
            pcm.deallocate_blocks_cache(src)


def test_cached_plans_are_read_only_and_errors_are_not_cached() -> None:
    geometry = CacheGeometry(2, 16 * 64, 16, True, 4)
    params = TransferParams("pull", "blocks", (1, 2), (3, 4), None, None, 2, -1, 0)
    plan = transfer_plan(params, geometry, geometry, 0)
    assert transfer_plan(params, geometry, geometry, 0) is plan  # reused
    with pytest.raises(ValueError):
        plan.runs.length[0] = 1
    bad = TransferParams("pull", "blocks", (1, 99), (3, 4), None, None, 2, -1, 0)
    for _ in range(2):
        with pytest.raises(LLMException):
            transfer_plan(bad, geometry, geometry, 0)
    other = CacheGeometry(2, 16 * 128, 16, True, 4)  # same lists, other block size: another plan
    assert transfer_plan(params, other, other, 0).total_bytes == 2 * 2 * 128
