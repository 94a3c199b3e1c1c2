"""Large pushes into memory the owner registered without sharing it in place (an engine's KV as
``register_blocks_cache`` takes it): the owner copies them itself, from the pusher's shared-memory segment
mapped in the owner where the source lies in one, else reading the pusher's memory with covering reads, and
answers ``BEGIN`` once every byte landed; the pusher would otherwise write each span with
``process_vm_writev``, one pinned page per span.  The owner is a real process; this process pushes (so that the
test can cancel a push at any moment)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import numpy as np
import pytest
from helpers.data import fill_pattern, pattern
from helpers.internals import registry_of
from helpers.requests import count_requests
from helpers.world import eventually

from aiodatadist import BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMRole, LLMStatusCode, Placement
from aiodatadist.protocol.codec import Kind
from aiodatadist.testing import PeerProcess, cluster_info_for
from aiodatadist.transport.same_host_plane import OWNER_COPY_SPANS

S = LLMStatusCode
OWNER, PUSHER = 91, 92


class Pair:
    def __init__(self, dd: LLMDataDist, peer: PeerProcess, remote: int, tensors: int, blocks: int,
                 block: int, registered: bool = False) -> None:
        self.dd, self.peer, self.remote = dd, peer, remote
        self.tensors, self.blocks, self.block = tensors, blocks, block
        self.key = BlocksCacheKey(OWNER, 0)
        desc = CacheDesc(tensors, (blocks, block), DataType.DT_UINT8, Placement.HOST)
        if registered:  # the source in this process's own memory, outside any shared segment
            self.memory = [np.empty(blocks * block, dtype=np.uint8) for _ in range(tensors)]
            self.local = dd.cache_manager.register_blocks_cache(desc, [int(m.ctypes.data) for m in self.memory],
                                                                BlocksCacheKey(PUSHER, 0))
        else:
            self.local = dd.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(PUSHER, 0))
        self.source = [t.reshape(blocks, block) for t in fill_pattern(self.local, 9)]
        # What the owner's tensors hold: its pattern, then every block pushed.
        self.expected = [pattern(5, t, blocks * block).reshape(blocks, block) for t in range(tensors)]

    async def push(self, src: list[int], dst: list[int]) -> None:
        await self.dd.cache_manager.push_blocks(self.key, self.local, src, dst)
        for t in range(self.tensors):
            self.expected[t][dst] = self.source[t][src]

    async def owner_digests(self) -> list[str]:
        return list(await self.peer.call("digest", cache_id=self.remote))

    def expected_digests(self) -> list[str]:
        return [hashlib.sha256(t.tobytes()).hexdigest() for t in self.expected]

    def plane(self) -> Any:
        return next(iter(self.dd._links.links.values())).plane

    def owner_maps_the_source(self) -> bool:
        """Whether the owner process maps the shared-memory segment of this side's source cache."""
        segment = registry_of(self.dd.cache_manager).by_id(self.local.cache_id).shared_segment
        if segment is None:
            return False
        with open(f"/proc/{self.peer.pid}/maps", encoding="ascii") as maps:
            return any(len(f := line.split()) > 4 and f[4] == str(segment.identity.inode) for line in maps)


@contextlib.asynccontextmanager
async def _pair(tensors: int, blocks: int, block: int, env: dict[str, str] | None = None, *,
                registered: bool = False) -> AsyncIterator[Pair]:
    """A peer process owns a blocks cache over its own (unshared) memory, filled with pattern 5; this process
    links to it and has a cache of the same shape (allocated, or ``registered`` from its own memory), filled with
    pattern 9."""
    peer = await PeerProcess.start(env=env)
    try:
        host, port = await peer.init(OWNER) or ("", 0)
        remote = await peer.call("register", blocks=True, num_tensors=tensors, shape=[blocks, block],
                                 blocks_key=[OWNER, 0])
        await peer.call("fill", cache_id=remote["cache_id"], seed=5)
        async with LLMDataDist(LLMRole.DECODER, PUSHER) as dd:
            await dd.init({"llm.SyncKvCacheWaitTime": "30000"})
            code, _ = await dd.link_clusters([cluster_info_for(OWNER, host, port)], timeout=10000)
            assert code == S.LLM_SUCCESS
            assert dd.links()[0]["plane"] == "shm"
            yield Pair(dd, peer, int(remote["cache_id"]), tensors, blocks, block, registered)
    finally:
        await peer.close()


async def _at_least(counts: Awaitable[tuple[int, int]], operations: int) -> bool:
    return (await counts)[0] >= operations


def _scattered(rng: np.random.Generator, blocks: int, count: int) -> list[int]:
    return [int(b) for b in rng.choice(blocks, count, replace=False)]


@pytest.mark.parametrize("registered", [False, True], ids=["source-in-a-segment", "source-registered"])
async def test_a_large_push_into_unshared_memory_is_copied_by_the_owner_byte_for_byte(registered: bool) -> None:
    """The owner copies from the pusher's segment, which it maps, where the source is an allocated cache; from
    memory the pusher registered (no segment) it reads the pusher's memory."""
    tensors, blocks = 16, 512
    count = 2 * OWNER_COPY_SPANS // tensors  # scattered: about that many runs, each one span per tensor
    async with _pair(tensors, blocks, 64, registered=registered) as pair:
        sent = count_requests(pair.dd)
        rng = np.random.default_rng(3)
        assert not pair.owner_maps_the_source()
        await pair.push(_scattered(rng, blocks, count), _scattered(rng, blocks, count))  # first: through BEGIN
        assert pair.plane().owner_reads is True, "the owner did not copy the push itself"
        assert pair.owner_maps_the_source() is not registered
        assert await pair.owner_digests() == pair.expected_digests()
        await pair.push(_scattered(rng, blocks, count), _scattered(rng, blocks, count))  # a resolved key
        assert sent.get(Kind.BEGIN) == 2, "a large push by a resolved key goes through the owner all the same"
        assert await pair.owner_digests() == pair.expected_digests()
        await pair.push([1, 3], [7, 500])  # a small one goes one-sided: no BEGIN
        assert sent.get(Kind.BEGIN) == 2
        assert await pair.owner_digests() == pair.expected_digests()
        # The owner counts a push it served when it handles the pusher's END, a notification the pushing call
        # does not wait for: wait for the second count, then hold it to exactly two, both succeeded.
        async def served() -> tuple[int, int]:
            got = await pair.peer.call("served", cluster_id=PUSHER, direction="push")
            return got["operations"], got["succeeded"]

        await eventually(lambda: _at_least(served(), 2), what="the owner counted both pushes it copied")
        assert await served() == (2, 2)


async def test_a_push_the_owner_copies_writes_nothing_once_it_was_cancelled() -> None:
    """Cancelled at any moment (before BEGIN went out, while the owner copies, about when it answers), the push
    returns only once the owner stopped copying: its memory does not change afterwards; the link stays, and a
    whole push afterwards lands exactly."""
    tensors, blocks, block = 8, 2048, 4096  # every other block: 8192 spans, 32 MiB
    async with _pair(tensors, blocks, block) as pair:
        src, dst = list(range(0, blocks, 2)), list(range(1, blocks, 2))
        await pair.push(src[:2], dst[:2])
        outcomes = set()
        for delay in (0.0, 0.0005, 0.002, 0.005, 0.01, 0.02, 0.04):
            push = asyncio.ensure_future(pair.dd.cache_manager.push_blocks(pair.key, pair.local, src, dst))
            await asyncio.sleep(delay)
            push.cancel()
            try:
                await push
                outcomes.add("done")
            except asyncio.CancelledError:
                outcomes.add("cancelled")
            first = await pair.owner_digests()
            await asyncio.sleep(0.2)
            assert await pair.owner_digests() == first, f"bytes landed after a push cancelled at {delay} s returned"
            assert pair.dd.links(), "the link was dropped"
        assert "cancelled" in outcomes
        rng = np.random.default_rng(4)
        order = rng.permutation(len(src))
        await pair.push([src[i] for i in order], [dst[i] for i in order])
        assert await pair.owner_digests() == pair.expected_digests()


@pytest.mark.parametrize("count", [8, 2 * OWNER_COPY_SPANS // 16])
async def test_pushes_the_owner_does_not_copy_are_written_by_the_pusher(count: int) -> None:
    """Small pushes (too few spans) are the pusher's own to copy, as before; so are large ones into an owner that
    cannot read the pusher (``process_vm_readv`` not allowed to it): after its first answer, they go one-sided."""
    async with _pair(16, 512, 64, env={"AIODATADIST_SAME_HOST": "map"}) as pair:
        rng = np.random.default_rng(5)
        sent = count_requests(pair.dd)
        for _ in range(2):
            await pair.push(_scattered(rng, 512, count), _scattered(rng, 512, count))
        assert sent.get(Kind.BEGIN) == 1, "the second push did not go one-sided"
        assert pair.plane().owner_reads is (None if count < OWNER_COPY_SPANS // 16 else False)
        assert await pair.owner_digests() == pair.expected_digests()


async def test_a_cancelled_push_waits_for_a_busy_owner_to_confirm_it_stopped_copying() -> None:
    """The owner's event loop is busy when the push's BEGIN arrives; the push is cancelled before the owner even
    read it.  The owner may start copying as soon as it reads BEGIN, so the call returns only once the owner
    answered that it stopped (it reads the cancellation right after): not before its loop is free again."""
    tensors, blocks, block = 8, 2048, 4096
    async with _pair(tensors, blocks, block) as pair:
        src, dst = list(range(0, blocks, 2)), list(range(1, blocks, 2))
        await pair.push(src[:2], dst[:2])
        loop = asyncio.get_running_loop()
        asked = loop.time()  # the owner's loop is blocked from after this for 0.5 s: free again no sooner
        busy = asyncio.ensure_future(pair.peer.call("block", seconds=0.5))
        await asyncio.sleep(0.05)  # the owner's loop is blocked now
        push = asyncio.ensure_future(pair.dd.cache_manager.push_blocks(pair.key, pair.local, src, dst))
        await asyncio.sleep(0.05)
        push.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await push
        # (from the block's request, not from the cancellation: however late this task ran its cancel)
        assert loop.time() - asked > 0.45, "returned before the owner confirmed that it stopped copying"
        await busy
        first = await pair.owner_digests()
        await asyncio.sleep(0.2)
        assert await pair.owner_digests() == first
        assert pair.dd.links(), "the link was dropped"
        await pair.push(src[:4], dst[:4])  # both sides usable
        for t in range(tensors):  # the cancelled push may have landed in part: only the last one is checked
            got = bytes.fromhex(await pair.peer.call("read", cache_id=pair.remote, tensor=t, offset=0,
                                                     nbytes=8 * block))
            assert got[block:2 * block] == pair.source[t][0].tobytes()
            assert got[7 * block:8 * block] == pair.source[t][6].tobytes()
