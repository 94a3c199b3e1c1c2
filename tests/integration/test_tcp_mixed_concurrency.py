"""Concurrent one-sided TCP pulls and pushes of mixed sizes on one link: the owner serves small READs from its
receiver thread when the connection is idle and queues the rest for the sender threads, while WRITE frames and
their acknowledgements cross the same connections.  Every transfer must land byte-exact, whichever way it went."""

from __future__ import annotations

import asyncio
import random

import numpy as np

from aiodatadist import BlocksCacheKey, CacheDesc, DataType, LLMConfig, Placement
from aiodatadist.testing import linked_pair

BLOCKS = 64
HALF = BLOCKS // 2  # pulls read blocks [0, HALF) of the owner; pushes write blocks [HALF, BLOCKS)
SIZES = (64, 4096, 256 << 10)  # tiny spans (bounce buffers), pages, and a frame too big to serve inline at once


async def test_mixed_concurrent_pulls_and_pushes_land_byte_exact() -> None:
    config = LLMConfig()
    config.transport = "tcp"
    rng = np.random.default_rng(11)
    pick = random.Random(12)
    async with linked_pair(1, 2, config=config) as (prompt, decoder):
        owner, requester = prompt.cache_manager, decoder.cache_manager
        descs = {size: CacheDesc(4, (BLOCKS, size), DataType.DT_UINT8, Placement.HOST) for size in SIZES}
        keys = {size: BlocksCacheKey(1, i) for i, size in enumerate(SIZES)}
        remote = {size: owner.allocate_blocks_cache(descs[size], keys[size]) for size in SIZES}
        local = {size: requester.allocate_blocks_cache(descs[size]) for size in SIZES}
        views = {(side, size): [t.view(np.uint8).reshape(BLOCKS, size) for t in caches[size].tensors]
                 for side, caches in (("remote", remote), ("local", local)) for size in SIZES}
        for tensors in views.values():
            for t in tensors:
                t[:] = rng.integers(1, 256, t.shape, dtype=np.uint8)
        for size in SIZES:  # the first transfer by a key goes through the owner; the rest are one-sided
            await requester.pull_blocks(keys[size], local[size], [0], [0])
            await requester.push_blocks(keys[size], local[size], [HALF], [HALF])
        checked, pulls, pulled = 0, len(SIZES), 4 * sum(SIZES)
        for _ in range(12):
            batch: list[tuple[str, int, list[int], list[int]]] = []
            for size in SIZES:  # per cache, disjoint destinations within a batch
                pull_dst = pick.sample(range(HALF), HALF)
                push_dst = pick.sample(range(HALF, BLOCKS), HALF)
                for op, dst_pool, src_range in (("pull", pull_dst, range(HALF)),
                                                ("push", push_dst, range(HALF, BLOCKS))):
                    while len(dst_pool) >= 4 and pick.random() < 0.8:
                        n = pick.randint(1, 4)
                        dst = [dst_pool.pop() for _ in range(n)]
                        batch.append((op, size, pick.sample(src_range, n), dst))
            pick.shuffle(batch)
            await asyncio.gather(*(
                (requester.pull_blocks if op == "pull" else requester.push_blocks)(keys[size], local[size], src, dst)
                for op, size, src, dst in batch))
            for op, size, src, dst in batch:
                to, frm = (("local", "remote") if op == "pull" else ("remote", "local"))
                for t_to, t_from in zip(views[(to, size)], views[(frm, size)], strict=True):
                    np.testing.assert_array_equal(t_to[dst], t_from[src], err_msg=f"{op} of {size}-byte blocks")
                checked += 1
                if op == "pull":
                    pulls, pulled = pulls + 1, pulled + 4 * size * len(dst)
            for size in SIZES:  # new source bytes, so that a late or misplaced write cannot pass unnoticed
                for t in views[("remote", size)]:
                    t[:HALF] = rng.integers(1, 256, (HALF, size), dtype=np.uint8)
                for t in views[("local", size)]:
                    t[HALF:] = rng.integers(1, 256, (HALF, size), dtype=np.uint8)
        assert checked > 100
        assert decoder.links()[0]["plane"] == "tcp"
        served = prompt.stats().served_of(2, "pull")  # every pull reached the owner's threads once, all bytes
        assert served is not None and (served.operations, served.bytes) == (pulls, pulled)
