"""Control plane sockets on pyzmq's asyncio API: one ROUTER server per listening instance, one DEALER per link.

Each socket has exactly one reader task (:meth:`Server.serve`, :func:`read_dealer`), which decodes frames and
hands their messages to the link's :class:`~.channel.Channel` (inline kinds at once, others in tasks of the
instance's :class:`~.channel.TaskSet`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Final

import zmq
import zmq.asyncio

from ..errors import LLMLinkError, LLMStatusCode
from ..protocol.codec import MAX_MESSAGE_BYTES, Kind, decode_batch, encode
from ..protocol.messages import reply_to_wire
from .channel import Channel, TaskSet

__all__ = ["LINGER_MS", "Context", "Server", "abandon_context", "connect_dealer", "dealer_sender", "new_context",
           "read_dealer"]

log = logging.getLogger("aiodatadist.control.sockets")

LINGER_MS: Final = 100
"""How long a socket closed in an orderly way still tries to deliver what it queued (a BYE), in milliseconds; the
context's default, for every other close, is 0."""
# ZMTP heartbeats (milliseconds): a PING every HEARTBEAT_IVL_MS on each connection; one that hears nothing within
# HEARTBEAT_TIMEOUT_MS of a PING is dropped, and each PING asks the peer to drop it after HEARTBEAT_TTL_MS of silence.
HEARTBEAT_IVL_MS: Final = 1000
HEARTBEAT_TIMEOUT_MS: Final = 5000
HEARTBEAT_TTL_MS: Final = 5000


class Context(zmq.asyncio.Context):
    """An asyncio context that holds its open sockets (monitor sockets included) strongly, until each is closed.

    pyzmq's own set is weak: when an abandoned instance is garbage-collected, the collector clears those references
    before any finalizer runs, and the context's ``term()`` then waits for ever on sockets it no longer knows.
    Here :func:`abandon_context` can still reach and close every one of them."""

    open_sockets: set[Any]

    def __init__(self) -> None:
        super().__init__()
        self.open_sockets = set()

    def _add_socket(self, socket: Any) -> None:
        super()._add_socket(socket)
        self.open_sockets.add(socket)

    def _rm_socket(self, socket: Any) -> None:
        super()._rm_socket(socket)
        if getattr(self, "open_sockets", None) is not None:
            self.open_sockets.discard(socket)


def new_context() -> Context:
    ctx = Context()
    ctx.setsockopt(zmq.LINGER, 0)
    ctx.set(zmq.MAX_SOCKETS, 8192)
    return ctx


def abandon_context(ctx: Context) -> None:
    """Free a context whose owner was dropped without being closed (from a finalizer, on any thread, with its event
    loop possibly gone): every socket closed with linger 0, then ``term()`` on a daemon thread.  Never blocks."""
    for sock in list(ctx.open_sockets):
        if sock.closed:
            continue
        try:
            sock.close(linger=0)  # the asyncio close: cancels its futures, leaves its loop
        except Exception:  # noqa: BLE001 - its loop is closed: close the socket itself
            try:
                zmq.Socket.close(sock, linger=0)
            except Exception:  # noqa: BLE001, S110 - a finalizer must not raise
                pass
        ctx.open_sockets.discard(sock)
    if ctx.closed:
        return
    try:  # the thread holds the context until term() returns, so its own __del__ does not term it again
        threading.Thread(target=ctx.term, name="aiodatadist-zmq-term", daemon=True).start()
    except RuntimeError:  # interpreter shutdown: pyzmq no longer terms contexts then either
        pass


def _tune(sock: zmq.asyncio.Socket) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)


async def read_dealer(sock: zmq.asyncio.Socket, channel: Channel, tasks: TaskSet) -> None:
    """Reader task of a client socket."""
    while True:
        data = await sock.recv()
        try:
            messages = decode_batch(data)
        except Exception as exc:  # noqa: BLE001 - whatever a peer sends must not end the reader
            log.warning("dropping malformed message on %s: %s", channel.name, exc)
            continue
        for message in messages:
            await _deliver(channel, message, tasks)


async def _deliver(channel: Channel, message: dict[str, Any], tasks: TaskSet) -> None:
    if message["k"] in Kind.INLINE:
        await channel.dispatch(message)
    else:
        tasks.spawn(channel.dispatch(message), name=f"handle-{message['k']}")


def _report_failure(channel: Channel, future: Any) -> None:
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        channel.failed(LLMLinkError(f"peer of {channel.name} unreachable: {exc}"))


def dealer_sender(sock: zmq.asyncio.Socket) -> Callable[[Channel], Callable[[bytes], None]]:
    """The send function of a client channel (frames are queued by ZeroMQ; failures close the channel)."""
    def bind(channel: Channel) -> Callable[[bytes], None]:
        def send(data: bytes) -> None:
            future: Any = sock.send(data)
            future.add_done_callback(lambda f: _report_failure(channel, f))
        return send
    return bind


def connect_dealer(ctx: zmq.asyncio.Context, endpoint: str, routing_id: bytes) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    _tune(sock)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(endpoint)
    return sock


class Server:
    """A bound ROUTER socket; channels are created per routing id when a peer says hello."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str,
                 on_hello: Callable[[bytes, dict[str, Any]], Awaitable[None]]) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        _tune(self.sock)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError:
            self.sock.close(linger=0)  # an unclosed socket would block the context's term() forever
            raise
        self.requested = endpoint  # as asked: port 0 means any free port
        bound = self.sock.getsockopt(zmq.LAST_ENDPOINT)
        port = bound.decode().rsplit(":", 1)[1] if isinstance(bound, bytes) else endpoint.rsplit(":", 1)[1]
        self.endpoint = f"{endpoint.rsplit(':', 1)[0]}:{port}"  # as bound: the port peers connect to
        self.channels: dict[bytes, Channel] = {}
        self._on_hello = on_hello

    def sender(self, routing_id: bytes) -> Callable[[Channel], Callable[[bytes], None]]:
        """The send function of a server-side channel (an unknown routing id closes the channel)."""
        def bind(channel: Channel) -> Callable[[bytes], None]:
            def send(data: bytes) -> None:
                future: Any = self.sock.send_multipart([routing_id, data])
                future.add_done_callback(lambda f: _report_failure(channel, f))
            return send
        return bind

    async def reply_raw(self, routing_id: bytes, message: dict[str, Any]) -> None:
        try:
            await self.sock.send_multipart([routing_id, encode(message)])
        except zmq.ZMQError:
            pass

    async def serve(self, tasks: TaskSet) -> None:
        """Reader task of the server socket."""
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                continue
            routing_id, data = frames
            try:
                messages = decode_batch(data)
            except Exception as exc:  # noqa: BLE001 - whatever a peer sends must not end the reader
                log.warning("dropping malformed message from %r: %s", routing_id[:8], exc)
                continue
            for message in messages:
                channel = self.channels.get(routing_id)
                if channel is not None:
                    await _deliver(channel, message, tasks)
                elif message["k"] == Kind.HELLO:
                    tasks.spawn(self._on_hello(routing_id, message), name="hello")
                elif message["k"] != Kind.REPLY:
                    await self.reply_raw(routing_id, reply_to_wire(
                        message["i"], code=int(LLMStatusCode.LLM_NOT_YET_LINK), msg="not linked"))

    def close(self) -> None:
        self.sock.close(linger=LINGER_MS)
