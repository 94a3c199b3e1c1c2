"""Notifications: with a successful transfer of every kind on both planes (round trip, published
and one-sided paths), never with a failed, timed-out or cancelled one; directly with ``notify``; order, the bounded
queue, refusals before anything is sent, unlinked senders, the blocking API, stats, and a real peer process.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import zmq
import zmq.asyncio
from helpers.data import fill_pattern
from helpers.ids import new_cluster_id
from helpers.requests import count_requests

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMConfig,
    LLMException,
    LLMRole,
    LLMStatusCode,
    LLMTimeoutError,
    Notification,
    Placement,
    sync,
)
from aiodatadist.protocol.codec import Kind, decode_batch, encode
from aiodatadist.protocol.messages import Notify, request_to_wire
from aiodatadist.testing import PeerProcess, cluster_info, free_port, linked_pair

S = LLMStatusCode
P, D = 1, 2  # the prompt's and the decoder's cluster ids in linked_pair
DESC = CacheDesc(2, (4, 4096), DataType.DT_UINT8, Placement.HOST)
BIG = CacheDesc(16, (16, 256 << 10), DataType.DT_UINT8, Placement.HOST)  # 64 MiB
PLANES = ["shm", "tcp"]


def config(transport: str) -> LLMConfig:
    cfg = LLMConfig()
    cfg.transport = transport
    return cfg


async def nothing_more(dd: Any, wait: float = 0.2) -> None:
    assert await dd.get_notification(wait) is None




# -- every transfer kind and plane ---------------------------------------------------------------------------
@pytest.mark.parametrize("plane", PLANES)
async def test_each_pull_delivers_one_notification_to_the_owner(plane: str) -> None:
    async with linked_pair(config=config(plane)) as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        by_key = pcm.allocate_cache(DESC, [CacheKey(P, 7)])
        by_id = pcm.allocate_cache(DESC)
        blocks = pcm.allocate_blocks_cache(DESC, BlocksCacheKey(P, 3))
        for cache, seed in ((by_key, 1), (by_id, 2), (blocks, 3)):
            fill_pattern(cache, seed)
        dst = dcm.allocate_cache(DESC)
        dst_blocks = dcm.allocate_blocks_cache(DESC)
        sent = count_requests(decoder)

        await dcm.pull_cache(CacheKey(P, 7), dst, 1, notify=b"by key")  # END awaited (the key is consumed)
        assert await prompt.get_notification(5) == Notification(D, b"by key")
        await dcm.pull_cache(CacheKeyByIdAndIndex(P, by_id.cache_id, 2), dst, 0, notify=b"by id")
        assert await prompt.get_notification(5) == Notification(D, b"by id")
        for i in range(3):  # the first asks the owner; the others read the published cache without a round trip
            await dcm.pull_blocks(BlocksCacheKey(P, 3), dst_blocks, [i], [i + 1], notify=b"blocks %d" % i)
            assert await prompt.get_notification(5) == Notification(D, b"blocks %d" % i)
        await dcm.pull_blocks(BlocksCacheKey(P, 3), dst_blocks, [0], [0])  # no notify: none delivered
        await nothing_more(prompt)
        if decoder.links()[0]["plane"] == "shm" or decoder._links is not None and decoder._links._local.native_net:
            assert sent[Kind.BEGIN] == 3 and sent[Kind.NOTIFY] == 2  # the published/one-sided pulls sent NOTIFY
        else:  # the Python TCP plane serves no one-sided reads: every pull asks the owner, and its END carries it
            assert sent[Kind.BEGIN] == 6 and sent.get(Kind.NOTIFY, 0) == 0
        assert decoder.stats().notifications_of(P).sent == 5
        assert prompt.stats().notifications_of(D).received == 5
        assert decoder.stats().notifications_of(P).received == 0


@pytest.mark.parametrize("plane", PLANES)
async def test_each_push_delivers_one_notification_once_the_bytes_are_in_place(plane: str) -> None:
    async with linked_pair(config=config(plane)) as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        dst = pcm.allocate_cache(DESC)
        dst_blocks = pcm.allocate_blocks_cache(DESC, BlocksCacheKey(P, 4))
        src = dcm.allocate_cache(DESC)
        src_blocks = dcm.allocate_blocks_cache(DESC)
        fill_pattern(src, 5)
        fill_pattern(src_blocks, 6)
        await dcm.push_cache(CacheKeyByIdAndIndex(P, dst.cache_id, 3), src, 1, notify=b"pushed cache")
        got = await prompt.get_notification(5)
        assert got == Notification(D, b"pushed cache")
        assert (dst.tensors[0][3] == src.tensors[0][1]).all()  # in place when the notification is there
        for i in range(2):
            await dcm.push_blocks(BlocksCacheKey(P, 4), src_blocks, [i], [i + 2], notify=b"pushed %d" % i)
            assert await prompt.get_notification(5) == Notification(D, b"pushed %d" % i)
            assert (dst_blocks.tensors[1][i + 2] == src_blocks.tensors[1][i]).all()
        await nothing_more(prompt)
        assert prompt.stats().notifications_of(D).received == 3


@pytest.mark.parametrize("plane", PLANES)
async def test_a_failed_transfer_delivers_nothing(plane: str) -> None:
    async with linked_pair(config=config(plane)) as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        pcm.allocate_blocks_cache(DESC, BlocksCacheKey(P, 3))
        dst = dcm.allocate_cache(DESC)
        dst_blocks = dcm.allocate_blocks_cache(DESC)
        cases = [
            dcm.pull_cache(CacheKey(P, 99), dst, notify=b"x"),  # no such key
            dcm.pull_blocks(BlocksCacheKey(P, 8), dst_blocks, [0], [0], notify=b"x"),  # no such model
            dcm.pull_blocks(BlocksCacheKey(P, 3), dst_blocks, [9], [0], notify=b"x"),  # block out of range (owner)
            dcm.push_cache(CacheKeyByIdAndIndex(P, 12345, 0), dst, notify=b"x"),  # no such cache
        ]
        for case in cases:
            with pytest.raises(LLMException):
                await case
        await nothing_more(prompt)
        assert decoder.stats().notifications_of(P).sent == 0
        assert prompt.stats().notifications_of(D).received == 0


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("published", [False, True])
async def test_a_cancelled_pull_delivers_nothing(plane: str, published: bool) -> None:
    async with linked_pair(config=config(plane)) as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        src = pcm.allocate_blocks_cache(BIG, BlocksCacheKey(P, 9))
        fill_pattern(src, 31)
        dst = dcm.allocate_blocks_cache(BIG)
        if published:  # resolved once: the next pull has no round trip (directory / one-sided read)
            await dcm.pull_blocks(BlocksCacheKey(P, 9), dst, [0], [0])
        plane = next(iter(decoder._links.links.values())).plane
        every = list(range(16))
        for _ in range(3):
            task = asyncio.ensure_future(dcm.pull_blocks(BlocksCacheKey(P, 9), dst, every, every, notify=b"no"))
            while not plane.moving() and not task.done():
                await asyncio.sleep(0)
            if not task.done():
                break
            assert await prompt.get_notification(5) == Notification(D, b"no")  # too fast to catch: try again
        else:
            pytest.skip("the pull always ended before it could be cancelled")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await nothing_more(prompt, 0.3)
        # the link still works, and carries the next notification
        await dcm.pull_blocks(BlocksCacheKey(P, 9), dst, [1], [1], notify=b"after")
        assert await prompt.get_notification(5) == Notification(D, b"after")


@pytest.mark.parametrize("plane", PLANES)
async def test_a_timed_out_transfer_delivers_nothing(plane: str) -> None:
    async with linked_pair(config=config(plane), sync_kv_timeout=300) as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        src = pcm.allocate_blocks_cache(DESC, BlocksCacheKey(P, 3))
        dst = dcm.allocate_blocks_cache(DESC)
        handle = prompt._transfers.handle
        held: list[Any] = []

        async def slow_begin(link: Any, message: dict[str, Any]) -> dict[str, Any] | None:
            if message["k"] == Kind.BEGIN:  # answered too late: after the requester's deadline
                body = await handle(link, message)
                held.append(asyncio.get_running_loop().call_later(0.6, lambda: link.channel._post(
                    {**(body or {}), "k": Kind.REPLY, "r": message["i"], "code": 0, "msg": ""})))
                return None
            return await handle(link, message)

        prompt._links.on_request = slow_begin
        with pytest.raises(LLMTimeoutError):
            await dcm.pull_blocks(BlocksCacheKey(P, 3), dst, [0], [0], notify=b"late")
        with pytest.raises(LLMTimeoutError):
            await dcm.push_blocks(BlocksCacheKey(P, 3), dst, [0], [0], notify=b"late")
        await nothing_more(prompt, 0.9)
        assert src.cache_id > 0 and decoder.stats().notifications_of(P).sent == 0


# -- direct notifications ------------------------------------------------------------------------------------
async def test_notify_both_ways_in_order() -> None:
    async with linked_pair() as (prompt, decoder):
        got: list[Notification] = []

        async def consume() -> None:
            async for notification in prompt.notifications():
                got.append(notification)

        consumer = asyncio.ensure_future(consume())
        for i in range(200):
            await decoder.notify(P, b"%d" % i)
        await prompt.notify(D, b"")  # the server side may notify its client; an empty message is one too
        assert await decoder.get_notification(5) == Notification(P, b"")
        while len(got) < 200:
            await asyncio.sleep(0.01)
        assert got == [Notification(D, b"%d" % i) for i in range(200)]
        # not awaited one by one: sent in one go, still in order
        await asyncio.gather(*(decoder.notify(P, b"g%d" % i) for i in range(50)))
        while len(got) < 250:
            await asyncio.sleep(0.01)
        assert [n.message for n in got[200:]] == [b"g%d" % i for i in range(50)]
        await prompt.finalize()  # finalize ends the iterator
        await asyncio.wait_for(consumer, 5)
        stats = decoder.stats().notifications_of(P)
        assert (stats.sent, stats.received) == (250, 1)


async def test_the_queue_is_bounded_and_drops_are_counted(caplog: pytest.LogCaptureFixture) -> None:
    async with linked_pair() as (prompt, decoder):
        prompt._inbox._capacity = 4
        with caplog.at_level(logging.WARNING, logger="aiodatadist.notifications"):
            for i in range(10):
                await decoder.notify(P, b"%d" % i)  # acknowledged even when dropped: never blocks the sender
        assert len([r for r in caplog.records if "queue is full" in r.getMessage()]) == 1
        assert [(await prompt.get_notification(1)).message for _ in range(4)] == [b"0", b"1", b"2", b"3"]  # type: ignore[union-attr]
        await nothing_more(prompt)
        stats = prompt.stats().notifications_of(D)
        assert (stats.received, stats.dropped) == (4, 6)
        await decoder.notify(P, b"room again")
        assert await prompt.get_notification(5) == Notification(D, b"room again")


async def test_bad_notifications_are_refused_before_anything_is_sent() -> None:
    async with linked_pair() as (prompt, decoder):
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        src = pcm.allocate_cache(DESC, [CacheKey(P, 7)])
        dst = dcm.allocate_cache(DESC)
        dst_blocks = dcm.allocate_blocks_cache(DESC)
        sent = count_requests(decoder)
        cases: list[tuple[Any, type[Exception]]] = [(b"x" * 4097, ValueError), ("text", TypeError),
                                                     (bytearray(b"x"), TypeError), (memoryview(b"x"), TypeError),
                                                     (5, TypeError)]
        for bad, error in cases:
            with pytest.raises(error):
                await dcm.pull_cache(CacheKey(P, 7), dst, notify=bad)
            with pytest.raises(error):
                await dcm.pull_blocks(CacheKeyByIdAndIndex(P, src.cache_id), dst_blocks, (), [0], notify=bad)
            with pytest.raises(error):
                await dcm.push_cache(CacheKeyByIdAndIndex(P, src.cache_id), dst, notify=bad)
            with pytest.raises(error):
                await dcm.push_blocks(BlocksCacheKey(P, 0), dst_blocks, [0], [0], notify=bad)
            with pytest.raises(error):
                await decoder.notify(P, bad)
        with pytest.raises(TypeError):
            await decoder.notify(P, None)  # type: ignore[arg-type]
        assert sent == {} and decoder.stats().links == () and decoder.stats().notifications == ()
        await dcm.pull_cache(CacheKey(P, 7), dst, notify=b"x" * 4096)  # the limit itself is fine
        assert await prompt.get_notification(5) == Notification(D, b"x" * 4096)


async def test_notify_needs_a_link() -> None:
    async with linked_pair() as (_prompt, decoder):
        for target in (99, D + 100):
            with pytest.raises(LLMException) as info:
                await decoder.notify(target, b"x")
            assert info.value.status_code == S.LLM_NOT_YET_LINK
        assert decoder.stats().notifications == ()


async def test_a_notification_from_an_unlinked_sender_is_refused() -> None:
    async with linked_pair() as (prompt, _decoder):
        endpoint = prompt._links.listening
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
            await sock.send(encode(request_to_wire(Notify(b"forged"), 1)))
            reply = decode_batch(await asyncio.wait_for(sock.recv(), 5))[0]
            assert reply["k"] == Kind.REPLY and reply["code"] == int(S.LLM_NOT_YET_LINK)
        finally:
            sock.close(linger=0)
            ctx.term()
        await nothing_more(prompt)
        assert prompt.stats().notifications == ()


async def test_notifications_need_init() -> None:
    from aiodatadist import LLMDataDist, LLMNotInitializedError

    dd = LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    with pytest.raises(LLMNotInitializedError):
        dd.notifications()
    with pytest.raises(LLMNotInitializedError):
        await dd.notify(1, b"x")
    with pytest.raises(LLMNotInitializedError):
        await dd.get_notification(0)


# -- the blocking API --------------------------------------------------------------------------------------
def test_the_blocking_api_sends_and_receives_notifications() -> None:
    port = free_port()
    prompt = sync.LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    decoder = sync.LLMDataDist(LLMRole.DECODER, new_cluster_id())
    server = LLMConfig()
    server.listen_ip_info = f"127.0.0.1:{port}"
    with prompt, decoder:
        prompt.init(server.generate_options())
        decoder.init(LLMConfig().generate_options())
        assert decoder.link_clusters([cluster_info(prompt.cluster_id, port)], timeout=5000)[0] == S.LLM_SUCCESS
        src = prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(prompt.cluster_id, 1))
        fill_pattern(src, 3)
        dst = decoder.cache_manager.allocate_blocks_cache(DESC)
        decoder.cache_manager.pull_blocks(BlocksCacheKey(prompt.cluster_id, 1), dst, [0], [1], notify=b"pulled")
        decoder.cache_manager.submit.push_blocks(BlocksCacheKey(prompt.cluster_id, 1), dst, [1], [2],
                                                 notify=b"pushed").result(10)
        decoder.notify(prompt.cluster_id, b"direct")
        assert prompt.get_notification(5) == Notification(decoder.cluster_id, b"pulled")
        got = list(prompt.notifications(timeout=1.5))  # ends when none came within the timeout (sent already)
        assert got == [Notification(decoder.cluster_id, b"pushed"), Notification(decoder.cluster_id, b"direct")]
        assert prompt.get_notification(0.05) is None

        import threading

        seen: list[Notification] = []
        reader = threading.Thread(target=lambda: seen.extend(prompt.notifications()))
        reader.start()
        decoder.notify(prompt.cluster_id, b"to a thread")
        prompt.finalize()  # ends the blocking iterator
        reader.join(10)
        assert not reader.is_alive() and seen == [Notification(decoder.cluster_id, b"to a thread")]
        assert decoder.stats().notifications_of(prompt.cluster_id).sent == 4


# -- a real peer process -----------------------------------------------------------------------------------
@pytest.mark.parametrize("plane", PLANES)
async def test_with_a_peer_process(plane: str) -> None:
    port = free_port()
    peer_id, own_id = new_cluster_id(), new_cluster_id()
    peer = await PeerProcess.start()
    try:
        await peer.call("init", role="PROMPT", cluster_id=peer_id,
                        options={"llm.listenIpInfo": f"127.0.0.1:{port}", "llm.Transport": plane})
        await peer.call("allocate", blocks=True, num_tensors=2, shape=[4, 4096], blocks_key=[peer_id, 0])
        from aiodatadist import LLMDataDist

        async with LLMDataDist(LLMRole.DECODER, own_id) as dd:
            cfg = config(plane)
            await dd.init(dict(cfg.generate_options()))
            code, _ = await dd.link_clusters([cluster_info(peer_id, port)], timeout=5000)
            assert code == S.LLM_SUCCESS
            dst = dd.cache_manager.allocate_blocks_cache(DESC)
            for i in range(3):  # round trip, then the published / one-sided path
                await dd.cache_manager.pull_blocks(BlocksCacheKey(peer_id, 0), dst, [i], [i], notify=b"req %d" % i)
            await dd.cache_manager.push_blocks(BlocksCacheKey(peer_id, 0), dst, [0], [3], notify=b"push")
            with pytest.raises(LLMException):
                await dd.cache_manager.pull_blocks(BlocksCacheKey(peer_id, 5), dst, [0], [0], notify=b"never")
            got = [await peer.call("notification", timeout=5) for _ in range(4)]
            assert got == [[own_id, (b"req %d" % i).hex()] for i in range(3)] + [[own_id, b"push".hex()]]
            assert await peer.call("notification", timeout=0.2) is None
            await peer.call("notify", cluster_id=own_id, message=b"from the peer".hex())
            assert await dd.get_notification(5) == Notification(peer_id, b"from the peer")
            assert await peer.call("notification_stats", cluster_id=own_id) == [1, 4, 0]
            stats = dd.stats().notifications_of(peer_id)
            assert (stats.sent, stats.received, stats.dropped) == (4, 1, 0)
    finally:
        await peer.close()
