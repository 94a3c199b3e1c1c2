"""The life of a link as a router that links on demand sees it (issue 22): concurrent ``link_clusters`` for one
peer share the link in progress, a cancelled ``link_clusters`` leaves no link on either side, a refused connection
fails at once, a call on a link that dropped raises ``LLMLinkError`` naming why, and ``unlink`` during transfers.

Real parts only: ZeroMQ on 127.0.0.1, the prompt in its own OS process where its death or silence matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import numpy as np
import pytest
from helpers.ids import new_cluster_id
from helpers.world import eventually

from aiodatadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMLinkError,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.errors import LinkDropReason
from aiodatadist.testing import PeerProcess, cluster_info, free_port, pattern

S = LLMStatusCode
R = LinkDropReason
BLOCKS, BLOCK_BYTES = 64, 4096
SMALL = CacheDesc(2, (BLOCKS, BLOCK_BYTES), DataType.DT_UINT8, Placement.HOST)
SEED = 7


# -- helpers ---------------------------------------------------------------------------------------------------

class Prompt:
    """A prompt in its own process, listening on 127.0.0.1, with one blocks cache of random bytes (``SEED``) of
    ``tensors`` tensors of ``shape`` (blocks, block bytes)."""

    def __init__(self, proc: PeerProcess, cluster_id: int, port: int, tensors: int, shape: tuple[int, int]) -> None:
        self.proc, self.cluster_id, self.port = proc, cluster_id, port
        self.tensors, self.shape = tensors, shape

    def desc(self, blocks: int) -> CacheDesc:
        """A local blocks cache of ``blocks`` blocks to pull its blocks into."""
        return CacheDesc(self.tensors, (blocks, self.shape[1]), DataType.DT_UINT8, Placement.HOST)

    @property
    def info(self) -> Any:
        return cluster_info(self.cluster_id, self.port)

    async def links(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self.proc.call("links")
        return result

    def expected(self, tensor: int, block: int) -> np.ndarray:
        """The bytes of ``block`` of tensor ``tensor`` of its cache."""
        rows = pattern(SEED, tensor, self.shape[0] * self.shape[1]).reshape(self.shape[0], -1)
        return np.asarray(rows[block])


async def start_prompt(cluster_id: int, *, tensors: int = 2, shape: tuple[int, int] = (BLOCKS, BLOCK_BYTES),
                       options: dict[str, str] | None = None) -> Prompt:
    port = free_port()
    proc = await PeerProcess.start()
    try:
        await proc.call("init", role="PROMPT", cluster_id=cluster_id,
                        options={"llm.listenIpInfo": f"127.0.0.1:{port}", **(options or {})})
        cache = await proc.call("allocate", blocks=True, num_tensors=tensors, shape=list(shape),
                                blocks_key=[cluster_id, 0])
        await proc.call("fill", cache_id=cache["cache_id"], seed=SEED)
    except BaseException:
        await proc.close()
        raise
    return Prompt(proc, cluster_id, port, tensors, shape)


@contextlib.asynccontextmanager
async def prompt(cluster_id: int | None = None, **kw: Any) -> AsyncIterator[Prompt]:
    p = await start_prompt(cluster_id if cluster_id is not None else new_cluster_id(), **kw)
    try:
        yield p
    finally:
        await p.proc.close()


@contextlib.asynccontextmanager
async def decoder(sync_kv_timeout: int = 5000, auth_key: str | None = None) -> AsyncIterator[LLMDataDist]:
    cfg = LLMConfig()
    cfg.sync_kv_timeout = sync_kv_timeout
    if auth_key is not None:
        cfg.auth_key = auth_key
    async with LLMDataDist(LLMRole.DECODER, new_cluster_id()) as dd:
        await dd.init(dict(cfg.generate_options()))
        yield dd


async def pull(dd: LLMDataDist, p: Prompt, dst: Cache, src_block: int, dst_block: int) -> None:
    await dd.cache_manager.pull_blocks(BlocksCacheKey(p.cluster_id, 0), dst, [src_block], [dst_block])


def assert_block(p: Prompt, dst: Cache, src_block: int, dst_block: int) -> None:
    for t in range(p.tensors):
        got = dst.tensors[t].reshape(dst.cache_desc.shape[0], -1)[dst_block]
        assert np.array_equal(got, p.expected(t, src_block)), f"tensor {t}, block {src_block} -> {dst_block}"


async def drop_reason(dd: LLMDataDist, p: Prompt, dst: Cache) -> LLMLinkError:
    """The error of a pull to ``p`` once the link is gone: ``LLMLinkError`` with ``LLM_NOT_YET_LINK``."""
    with pytest.raises(LLMLinkError) as info:
        await pull(dd, p, dst, 0, 0)
    assert info.value.status_code == S.LLM_NOT_YET_LINK
    assert info.value.reason is not None and str(info.value.reason) in str(info.value)
    return info.value


async def unlinked_everywhere(dd: LLMDataDist, p: Prompt) -> None:
    assert dd.links() == []
    await eventually(lambda: _no_links(p), timeout=10.0, what="the prompt dropped its end")


async def _no_links(p: Prompt) -> bool:
    return await p.links() == []


# -- 1: concurrent link_clusters share the link in progress -----------------------------------------------------

async def test_32_concurrent_link_then_pull_requests_to_a_new_peer_all_succeed() -> None:
    """A router's requests each link on demand, then pull: every one succeeds and moves the right bytes."""
    async with prompt() as p, decoder() as dd:
        dst = dd.cache_manager.allocate_blocks_cache(SMALL)

        async def request(i: int) -> LLMStatusCode:
            _, codes = await dd.link_clusters([p.info], timeout=5000)
            if codes[0] in (S.LLM_SUCCESS, S.LLM_ALREADY_LINK):
                await pull(dd, p, dst, i, BLOCKS - 1 - i)
            return codes[0]

        codes = await asyncio.gather(*(request(i) for i in range(32)))
        assert codes == [S.LLM_SUCCESS] * 32  # all joined the one link in progress
        for i in range(32):
            assert_block(p, dst, i, BLOCKS - 1 - i)
        assert [link["remote_cluster_id"] for link in dd.links()] == [p.cluster_id]
        assert [link["remote_cluster_id"] for link in await p.links()] == [dd.cluster_id]
        # Once the link exists, linking again is LLM_ALREADY_LINK, as in LLM-DataDist.
        assert await dd.link_clusters([p.info]) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])


async def test_requests_arriving_while_the_link_is_made_share_it() -> None:
    """Staggered arrivals: each gets LLM_SUCCESS (joined the attempt) or LLM_ALREADY_LINK (after it), never a
    failure, and every pull succeeds."""
    async with prompt() as p, decoder() as dd:
        dst = dd.cache_manager.allocate_blocks_cache(SMALL)

        async def request(i: int) -> LLMStatusCode:
            await asyncio.sleep(i * 0.0005)
            _, codes = await dd.link_clusters([p.info], timeout=5000)
            await pull(dd, p, dst, i, i)
            return codes[0]

        codes = await asyncio.gather(*(request(i) for i in range(16)))
        assert set(codes) <= {S.LLM_SUCCESS, S.LLM_ALREADY_LINK} and codes[0] == S.LLM_SUCCESS
        for i in range(16):
            assert_block(p, dst, i, i)


# -- 2: cancellation --------------------------------------------------------------------------------------------

BIG_POOL: dict[str, Any] = {"tensors": 16, "shape": (64, 256 << 10)}  # 256 MiB: the decoder maps it while linking


async def cancelled_link(dd: LLMDataDist, p: Prompt, *, when_listed: bool, delay: float = 0.0) -> bool:
    """Start linking, cancel it (as soon as ``links()`` lists the peer, or after ``delay`` s); True when it was
    cancelled (False: it linked first)."""
    task = asyncio.ensure_future(dd.link_clusters([p.info], timeout=5000))
    if when_listed:
        while not dd.links() and not task.done():
            await asyncio.sleep(0)
    else:
        await asyncio.sleep(delay)
    task.cancel()
    try:
        code = await task
    except asyncio.CancelledError:
        return True
    assert code == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    return False


async def relink_then_unlink(dd: LLMDataDist, p: Prompt) -> None:
    """Linking again works (it is not LLM_ALREADY_LINK) and the link moves bytes; then unlink both ends."""
    assert await dd.link_clusters([p.info], timeout=5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    dst = dd.cache_manager.allocate_blocks_cache(p.desc(4))
    await pull(dd, p, dst, 3, 2)
    dd.cache_manager.deallocate_blocks_cache(dst)
    assert await dd.unlink_clusters([p.info]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    await unlinked_everywhere(dd, p)


async def test_a_cancelled_link_leaves_no_link_on_either_side() -> None:
    async with prompt(**BIG_POOL) as p, decoder() as dd:
        # The moment the link is listed (its handshake done, the peer's caches being mapped): cancelled there, it
        # must be gone at once on this side, soon on the peer's, and a retry must link.
        if not await cancelled_link(dd, p, when_listed=True):  # (nothing to map here: it linked at once)
            assert await dd.unlink_clusters([p.info]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        await unlinked_everywhere(dd, p)
        await relink_then_unlink(dd, p)
        # Any other moment, from before the first byte to the end.
        cancelled = 0
        for delay in (0.0, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.008, 0.013, 0.02):
            if await cancelled_link(dd, p, when_listed=False, delay=delay):
                cancelled += 1
                await unlinked_everywhere(dd, p)
            else:
                assert await dd.unlink_clusters([p.info]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
                await unlinked_everywhere(dd, p)
            await relink_then_unlink(dd, p)
        assert cancelled > 0


async def test_a_link_shared_by_several_callers_outlives_one_cancelled_caller() -> None:
    """Cancelling one caller of a shared link attempt does not take the link from the others; cancelling every
    caller gives it up."""
    async with prompt(**BIG_POOL) as p, decoder() as dd:
        first = asyncio.ensure_future(dd.link_clusters([p.info], timeout=5000))
        second = asyncio.ensure_future(dd.link_clusters([p.info], timeout=5000))
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await second == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert [link["remote_cluster_id"] for link in dd.links()] == [p.cluster_id]
        assert await dd.unlink_clusters([p.info]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        await unlinked_everywhere(dd, p)

        callers = [asyncio.ensure_future(dd.link_clusters([p.info], timeout=5000)) for _ in range(3)]
        await asyncio.sleep(0.001)
        for caller in callers:
            caller.cancel()
        results = await asyncio.gather(*callers, return_exceptions=True)
        if all(isinstance(r, asyncio.CancelledError) for r in results):
            await unlinked_everywhere(dd, p)
        else:  # it linked before the cancellations: each caller got the result
            assert all(r == (S.LLM_SUCCESS, [S.LLM_SUCCESS]) for r in results), results
            await dd.unlink_clusters([p.info])
            await unlinked_everywhere(dd, p)
        await relink_then_unlink(dd, p)


async def test_a_joined_caller_with_a_shorter_timeout_gives_up_alone() -> None:
    async with prompt() as p, decoder() as dd:
        blocked = asyncio.ensure_future(p.proc.call("block", seconds=2.0))  # a busy peer answers late
        await asyncio.sleep(0.3)
        first = asyncio.ensure_future(dd.link_clusters([p.info], timeout=5000))
        await asyncio.sleep(0)
        assert await dd.link_clusters([p.info], timeout=100) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        assert await first == (S.LLM_SUCCESS, [S.LLM_SUCCESS])  # a slow but listening peer still links
        await blocked


# -- 3: a refused connection fails fast ------------------------------------------------------------------------

async def test_linking_to_a_closed_port_fails_at_once() -> None:
    async with decoder() as dd:
        info = cluster_info(new_cluster_id(), free_port())
        start = time.monotonic()
        code, codes = await dd.link_clusters([info], timeout=3000)
        elapsed = time.monotonic() - start
        assert (code, codes) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        # (at once: milliseconds, however loaded the machine, against the attempt's 3 s timeout)
        assert elapsed < 1.0, f"a refused connection took {elapsed:.3f} s to fail"
        assert dd.links() == []


# -- 4: why a link dropped ---------------------------------------------------------------------------------------

async def test_a_pull_after_the_peer_died_raises_a_link_error_naming_why() -> None:
    cluster = new_cluster_id()
    async with decoder(sync_kv_timeout=20000) as dd:
        dst = dd.cache_manager.allocate_blocks_cache(SMALL)
        p = await start_prompt(cluster)
        try:
            assert (await dd.link_clusters([p.info]))[0] == S.LLM_SUCCESS
            os.kill(p.proc.pid, signal.SIGSTOP)  # the pull's request will not be answered
            waiting = asyncio.ensure_future(pull(dd, p, dst, 1, 2))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            os.kill(p.proc.pid, signal.SIGKILL)
            with pytest.raises(LLMLinkError) as info:  # the pull under way when it died
                await waiting
            assert info.value.status_code == S.LLM_LINK_FAILED and info.value.reason == R.PEER_GONE
            assert dd.links() == []
            error = await drop_reason(dd, p, dst)  # a later one
            assert error.reason == R.PEER_GONE
            assert "peer gone" in str(error) and f"cluster {cluster}" in str(error)
        finally:
            await p.proc.close()
        # The peer is back (a new process, the same cluster id): linking clears the memory of the drop.
        async with prompt(cluster) as back:
            assert (await dd.link_clusters([back.info]))[0] == S.LLM_SUCCESS
            await pull(dd, back, dst, 5, 6)
            assert_block(back, dst, 5, 6)
            assert await dd.unlink_clusters([back.info]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            assert (await drop_reason(dd, back, dst)).reason == R.UNLINKED


async def test_a_peer_that_stops_answering_is_dropped_for_lost_heartbeats() -> None:
    async with prompt() as p, decoder() as dd:
        dst = dd.cache_manager.allocate_blocks_cache(SMALL)
        assert (await dd.link_clusters([p.info]))[0] == S.LLM_SUCCESS
        os.kill(p.proc.pid, signal.SIGSTOP)
        try:
            await eventually(lambda: not dd.links(), timeout=15.0, what="the silent peer's link dropped")
            assert (await drop_reason(dd, p, dst)).reason == R.HEARTBEAT_LOST
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)


async def test_unlinked_by_the_peer_or_by_this_side() -> None:
    async with prompt() as p, decoder() as dd:
        dst = dd.cache_manager.allocate_blocks_cache(SMALL)
        assert (await dd.link_clusters([p.info]))[0] == S.LLM_SUCCESS
        assert await p.proc.call("unlink", cluster_id=dd.cluster_id) == [0, [0]]
        await eventually(lambda: not dd.links(), what="the decoder saw the BYE")
        error = await drop_reason(dd, p, dst)
        assert error.reason == R.UNLINKED_BY_PEER and "unlinked by the peer" in str(error)
        # Linking again forgets it: the link works, and once unlinked here the reason is this side's.
        assert (await dd.link_clusters([p.info]))[0] == S.LLM_SUCCESS
        await pull(dd, p, dst, 9, 10)
        assert_block(p, dst, 9, 10)
        assert await dd.unlink_clusters([p.info]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert (await drop_reason(dd, p, dst)).reason == R.UNLINKED
        await unlinked_everywhere(dd, p)


async def test_a_failed_authentication_is_named_by_later_calls() -> None:
    async with prompt(options={"llm.AuthKey": "the prompt's key"}) as p, decoder(auth_key="another key") as dd:
        dst = dd.cache_manager.allocate_blocks_cache(SMALL)
        assert await dd.link_clusters([p.info]) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        error = await drop_reason(dd, p, dst)
        assert error.reason == R.AUTH_FAILED and "authentication failed" in str(error)
        assert await p.links() == []


def test_a_link_error_keeps_its_reason_when_pickled() -> None:
    error = LLMLinkError("gone", status_code=S.LLM_NOT_YET_LINK, reason=R.PEER_GONE)
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.status_code, copy.reason) == (LLMLinkError, "gone", S.LLM_NOT_YET_LINK,
                                                                      R.PEER_GONE)
    assert LLMException("x", status_code=S.LLM_LINK_FAILED).reason is None  # type: ignore[attr-defined]


async def test_a_never_linked_cluster_is_a_plain_not_yet_link() -> None:
    async with decoder() as dd:
        dst = dd.cache_manager.allocate_blocks_cache(SMALL)
        with pytest.raises(LLMException) as info:
            await dd.cache_manager.pull_blocks(BlocksCacheKey(new_cluster_id(), 0), dst, [0], [0])
        assert info.value.status_code == S.LLM_NOT_YET_LINK and not isinstance(info.value, LLMLinkError)


# -- 5: unlink during transfers ----------------------------------------------------------------------------------

async def test_unlink_during_transfers_fails_them_with_a_link_error_and_leaves_both_ends_clean() -> None:
    async with prompt(**BIG_POOL) as p, decoder(sync_kv_timeout=30000) as dd:
        dst = dd.cache_manager.allocate_blocks_cache(p.desc(64))
        assert (await dd.link_clusters([p.info]))[0] == S.LLM_SUCCESS
        blocks = list(range(64))
        pulls = [asyncio.ensure_future(dd.cache_manager.pull_blocks(BlocksCacheKey(p.cluster_id, 0), dst, blocks,
                                                                    blocks)) for _ in range(4)]
        await asyncio.sleep(0.01)
        assert await dd.unlink_clusters([p.info]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        results = await asyncio.wait_for(asyncio.gather(*pulls, return_exceptions=True), 10)
        for result in results:  # each finished before the unlink, or failed with the unlink's link error
            assert result is None or (isinstance(result, LLMLinkError) and result.reason == R.UNLINKED), repr(result)
        assert (await drop_reason(dd, p, dst)).reason == R.UNLINKED
        await unlinked_everywhere(dd, p)
        assert (await dd.link_clusters([p.info]))[0] == S.LLM_SUCCESS  # both ends usable
        small = dd.cache_manager.allocate_blocks_cache(p.desc(4))
        await pull(dd, p, small, 1, 2)


# -- 6: messages that say what to do ---------------------------------------------------------------------------

async def test_a_device_cache_that_cannot_be_allocated_hints_at_placement_host() -> None:
    cfg = LLMConfig()
    cfg.device_id = 4095  # no such GPU here, whether or not this machine has one
    async with LLMDataDist(LLMRole.DECODER, new_cluster_id()) as dd:
        await dd.init(dict(cfg.generate_options()))
        with pytest.raises(LLMException) as info:
            dd.cache_manager.allocate_blocks_cache(CacheDesc(2, (8, 64), DataType.DT_UINT8))
        assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
        assert "placement=Placement.HOST" in str(info.value)


async def test_out_of_range_blocks_name_their_argument() -> None:
    async with decoder() as dd:
        cache = dd.cache_manager.allocate_blocks_cache(SMALL)
        key = BlocksCacheKey(new_cluster_id(), 0)
        with pytest.raises(LLMException) as info:
            await dd.cache_manager.pull_blocks(key, cache, [0], [BLOCKS])
        assert info.value.status_code == S.LLM_PARAM_INVALID and "dst_blocks" in str(info.value)
        with pytest.raises(LLMException) as info:
            await dd.cache_manager.push_blocks(key, cache, [BLOCKS], [0])
        assert info.value.status_code == S.LLM_PARAM_INVALID and "src_blocks" in str(info.value)


async def test_the_wrong_loop_error_mentions_loop_scope() -> None:
    """An instance made on another loop (a module-scoped fixture used by function-scoped tests)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def there(coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    dd = LLMDataDist(LLMRole.DECODER, new_cluster_id())
    try:
        there(dd.init(dict(LLMConfig().generate_options())))
        with pytest.raises(LLMException) as info:
            await dd.link_clusters([cluster_info(new_cluster_id(), free_port())])
        assert "loop_scope" in str(info.value)
    finally:
        there(dd.finalize())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
