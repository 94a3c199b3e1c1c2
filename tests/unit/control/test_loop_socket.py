"""``LoopSocket``: ZeroMQ sockets driven from the event loop (real DEALER/ROUTER sockets over 127.0.0.1)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq

from aiodatadist.control.loop_socket import LoopSocket
from aiodatadist.control.sockets import Context, new_context
from aiodatadist.testing import free_port


@pytest.fixture
async def ctx() -> AsyncIterator[Context]:
    context = new_context()
    yield context
    for sock in list(context.loop_sockets):
        sock.close(linger=0)
    context.term()


class Received:
    """The messages a socket handed over, and a way to wait for a number of them."""

    def __init__(self) -> None:
        self.messages: list[list[Any]] = []
        self._changed = asyncio.Event()

    def __call__(self, frames: list[Any]) -> None:
        self.messages.append(frames)
        self._changed.set()

    async def wait_for(self, count: int, timeout: float = 10.0) -> list[list[Any]]:
        async with asyncio.timeout(timeout):
            while len(self.messages) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.messages


def _pair(ctx: Context, *, immediate: bool = False) -> tuple[LoopSocket, LoopSocket, str]:
    router = ctx.loop_socket(zmq.ROUTER)
    router.raw.setsockopt(zmq.ROUTER_MANDATORY, 1)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    router.raw.bind(endpoint)
    dealer = ctx.loop_socket(zmq.DEALER)
    dealer.raw.setsockopt(zmq.ROUTING_ID, b"d1")
    if immediate:
        dealer.raw.setsockopt(zmq.IMMEDIATE, 1)
    return router, dealer, endpoint


async def test_messages_go_both_ways_in_order_while_both_sides_send(ctx: Context) -> None:
    """Many messages each way, sent while the other side's arrive (a send may consume the descriptor's signal of
    an arrival: the socket must still read it); every message arrives, in order, byte-exact."""
    router, dealer, endpoint = _pair(ctx)
    dealer.raw.connect(endpoint)
    at_router, at_dealer = Received(), Received()
    router.start(at_router)
    dealer.start(at_dealer)
    payloads = [os.urandom(1 + i % 300) for i in range(2000)]
    for i, payload in enumerate(payloads):
        dealer.send([payload])
        if i % 7 == 0:
            await asyncio.sleep(0)
    first = await at_router.wait_for(1)
    routing_id = first[0][0]
    assert routing_id == b"d1"
    for i, payload in enumerate(payloads):
        router.send([routing_id, payload[::-1]])
        if i % 5 == 0:
            await asyncio.sleep(0)
    got_router = await at_router.wait_for(len(payloads))
    got_dealer = await at_dealer.wait_for(len(payloads))
    assert [m[1] for m in got_router] == payloads
    assert [m[0] for m in got_dealer] == [p[::-1] for p in payloads]


async def test_a_message_whose_signal_a_send_consumed_is_still_read(ctx: Context) -> None:
    """ZeroMQ's descriptor is edge-triggered, and a send takes the socket's pending commands: a message that arrived
    while the loop was busy, followed by a send on that socket before the loop looked, leaves the descriptor
    quiet.  The socket looks again after every send, so the message is read all the same."""
    router, dealer, endpoint = _pair(ctx)
    dealer.raw.connect(endpoint)
    at_router, at_dealer = Received(), Received()
    router.start(at_router)
    dealer.start(at_dealer)
    dealer.send([b"hello"])
    routing_id = (await at_router.wait_for(1))[0][0]
    for round_ in range(5):
        router.send([routing_id, b"reply %d" % round_])
        time.sleep(0.02)  # noqa: ASYNC251 - the loop is busy while the reply arrives (its signal is pending)
        dealer.send([b"next %d" % round_])  # ...and this send takes the signal before the loop looks
        got = await at_dealer.wait_for(round_ + 1)
        assert got[-1] == [b"reply %d" % round_]


async def test_a_message_whose_signal_a_refused_send_consumed_is_still_read(ctx: Context) -> None:
    """The same with a send ZeroMQ refuses (a ROUTER's peer is gone): the refusal takes the pending commands too."""
    router, dealer, endpoint = _pair(ctx)
    dealer.raw.connect(endpoint)
    at_router = Received()
    router.start(at_router)
    dealer.send([b"hello"])
    await at_router.wait_for(1)
    for round_ in range(5):
        dealer.send([b"next %d" % round_])
        time.sleep(0.02)  # noqa: ASYNC251 - the loop is busy while the message arrives (its signal is pending)
        with pytest.raises(zmq.ZMQError):
            router.send([b"gone", b"x"])
        got = await at_router.wait_for(round_ + 2)
        assert got[-1][1] == b"next %d" % round_


async def test_a_send_before_any_connection_waits_and_goes_out_once_connected(ctx: Context) -> None:
    """A DEALER that may queue only to completed connections (``IMMEDIATE``) cannot take a message before it
    connects: the message waits in the backlog, later ones behind it, and all go out in order once connected."""
    router, dealer, endpoint = _pair(ctx, immediate=True)
    at_router = Received()
    router.start(at_router)
    with pytest.raises(zmq.Again):  # what the backlog is for: ZeroMQ refuses the frame for now
        dealer.raw.send(b"probe", zmq.NOBLOCK)
    dealer.send([b"first"])
    dealer.send([b"second"])
    await asyncio.sleep(0.05)
    assert at_router.messages == []
    dealer.raw.connect(endpoint)
    got = await at_router.wait_for(2)
    assert [m[1] for m in got] == [b"first", b"second"]


async def test_a_router_send_to_an_unknown_peer_raises_at_once(ctx: Context) -> None:
    router, _, _ = _pair(ctx)
    with pytest.raises(zmq.ZMQError) as info:
        router.send([b"nobody", b"x"])
    assert info.value.errno == zmq.EHOSTUNREACH


async def test_messages_wait_in_zeromq_until_started_and_after_stop(ctx: Context) -> None:
    """Nothing is read before ``start`` or after ``stop``: what arrived meanwhile is read once (re)started."""
    router, dealer, endpoint = _pair(ctx)
    dealer.raw.connect(endpoint)
    at_router = Received()
    dealer.send([b"early"])
    await asyncio.sleep(0.05)
    router.start(at_router)
    await at_router.wait_for(1)
    router.stop()
    dealer.send([b"while stopped"])
    await asyncio.sleep(0.05)
    assert len(at_router.messages) == 1
    router.start(at_router)
    got = await at_router.wait_for(2)
    assert [m[1] for m in got] == [b"early", b"while stopped"]


async def test_close_stops_watching_so_a_new_socket_works_on_a_reused_descriptor(ctx: Context) -> None:
    """Sockets closed and opened again and again (their descriptor numbers are reused): each new one still
    receives, so no stale watch is left on the loop; closing twice is harmless."""
    loop = asyncio.get_running_loop()
    for round_ in range(20):
        router, dealer, endpoint = _pair(ctx)
        dealer.raw.connect(endpoint)
        at_router = Received()
        router.start(at_router)
        dealer.send([str(round_).encode()])
        got = await at_router.wait_for(1)
        assert got[0][1] == str(round_).encode()
        fds = (router.raw.FD, dealer.raw.FD)
        for sock in (router, dealer):
            sock.close(linger=0)
            sock.close(linger=0)
            assert sock.closed
        for fd in fds:
            assert not loop.remove_reader(fd)  # nothing was left watching it


async def test_abandon_on_the_loop_thread_closes_and_stops_watching(ctx: Context) -> None:
    router, _, _ = _pair(ctx)
    fd = router.raw.FD
    router.abandon()
    assert router.closed
    assert not asyncio.get_running_loop().remove_reader(fd)


async def test_abandon_from_another_thread_hands_the_close_to_the_loop(ctx: Context) -> None:
    router, _, _ = _pair(ctx)
    fd = router.raw.FD
    finalizer = threading.Thread(target=router.abandon)
    finalizer.start()
    finalizer.join()  # (blocking the loop: its callbacks cannot run meanwhile)
    assert not router.closed  # not closed under the running loop's feet...
    for _ in range(100):
        await asyncio.sleep(0.001)
        if router.closed:
            break
    assert router.closed  # ...but by the loop itself, which stopped watching first
    assert not asyncio.get_running_loop().remove_reader(fd)
