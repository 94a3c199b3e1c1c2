"""Control plane on pyzmq's asyncio sockets: one ROUTER server per listening instance, one DEALER per link.

Each socket has exactly one reader task.  A :class:`Channel` is one link's bidirectional message pipe: either
side sends requests (``"i"`` ids) and awaits replies through futures keyed by request id; incoming requests go
to a handler.  DEALER/ROUTER never lock-step, so a timed-out request leaves the channel usable.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from ..errors import LLMException, LLMLinkError, LLMStatusCode
from ..protocol.codec import MAX_MESSAGE_BYTES, Kind, ProtocolError, decode_batch, encode, encode_batch

__all__ = ["Channel", "RequestHandler", "Server", "TaskSet", "connect_dealer", "new_context"]

log = logging.getLogger("aiodatadist.control.channel")

FRAME_MESSAGES = 256  # messages per frame (receivers accept up to protocol.MAX_BATCH)

RequestHandler = Callable[["Channel", dict[str, Any]], Awaitable[dict[str, Any] | None]]
"""Handles a request; returns the reply body (``None``: no reply)."""


def new_context() -> zmq.asyncio.Context:
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    ctx.set(zmq.MAX_SOCKETS, 8192)
    return ctx


def _tune(sock: zmq.asyncio.Socket) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 5000)


class TaskSet:
    """Background tasks owned by an instance: tracked, cancelled and awaited together."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        if name:
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class Channel:
    """One link's message pipe (``send`` is bound to a DEALER or to a ROUTER + routing id).

    Outgoing messages are queued and flushed once per event-loop iteration, so the many requests and replies of
    concurrent transfers share ZeroMQ frames (a frame costs thread hand-offs; a message in it costs ~nothing).
    """

    def __init__(self, send: Callable[[Channel], Callable[[bytes], None]], handler: RequestHandler,
                 name: str) -> None:
        self._send = send(self)
        self._handler = handler
        self.name = name
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._outbox: list[dict[str, Any]] = []
        self.closed: LLMException | None = None
        self.context: Any = None  # the Link this channel belongs to

    def _post(self, message: dict[str, Any]) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self.flush)
        self._outbox.append(message)

    def flush(self) -> None:
        """Send what is queued as one frame (also called by ``close``, so that a last BYE goes out)."""
        if not self._outbox:
            return
        messages, self._outbox = self._outbox, []
        try:
            for start in range(0, len(messages), FRAME_MESSAGES):
                self._send(encode_batch(messages[start:start + FRAME_MESSAGES]))
        except LLMException as exc:
            self.close(exc)

    def failed(self, error: LLMException) -> None:
        """The transport reported that a frame could not be delivered: the peer is gone."""
        log.debug("send on %s failed: %s", self.name, error)
        self._outbox.clear()
        self.close(error)

    async def request(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """Send a request and await its reply; a non-zero reply code raises ``LLMException``."""
        if self.closed is not None:
            raise self.closed
        req_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = future
        try:
            self._post({**body, "k": kind, "i": req_id})
            reply = await future
        finally:
            self._pending.pop(req_id, None)
        code = reply.get("code", 0)
        if code:
            raise LLMException(str(reply.get("msg", "peer reported an error")),
                               status_code=LLMStatusCode.from_code(code if isinstance(code, int) else -1))
        return reply

    def notify(self, kind: str, body: dict[str, Any]) -> None:
        """Queue a request whose reply nobody awaits (replies to unknown ids are dropped)."""
        if self.closed is None:
            self._post({**body, "k": kind, "i": next(self._ids)})

    async def reply(self, req_id: int, body: dict[str, Any] | None = None, *, code: int = 0, msg: str = "") -> None:
        """Answer a request; a peer that has gone away meanwhile is not an error of ours."""
        if self.closed is None:
            self._post({**(body or {}), "k": Kind.REPLY, "r": req_id, "code": code, "msg": msg})

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Route a decoded message: replies resolve futures, requests go to the handler."""
        if message["k"] == Kind.REPLY:
            future = self._pending.get(message["r"])
            if future is not None and not future.done():
                future.set_result(message)
            return
        req_id = message["i"]
        try:
            body = await self._handler(self, message)
        except LLMException as exc:
            await self.reply(req_id, code=int(exc.status_code), msg=str(exc))
            return
        except ProtocolError as exc:
            await self.reply(req_id, code=int(LLMStatusCode.LLM_PARAM_INVALID), msg=f"malformed request: {exc}")
            return
        except Exception as exc:  # a bug must cost one request, never the link or the peer's deadline
            log.exception("handler of %s on %s failed", message["k"], self.name)
            await self.reply(req_id, code=int(LLMStatusCode.LLM_FAILED), msg=f"internal error: {exc!r}")
            return
        if body is not None:
            await self.reply(req_id, body)

    def close(self, error: LLMException | None = None) -> None:
        """Send what is queued, then fail every pending request with ``error`` (a link error by default)."""
        if self.closed is not None:
            return
        self.flush()
        if self.closed is not None:  # the flush itself found the peer gone
            return
        self.closed = error or LLMLinkError(f"link {self.name} is closed", status_code=LLMStatusCode.LLM_LINK_FAILED)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(self.closed)
        self._pending.clear()


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
        self.endpoint = endpoint
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
                    await self.reply_raw(routing_id, {"k": Kind.REPLY, "r": message["i"],
                                                      "code": int(LLMStatusCode.LLM_NOT_YET_LINK),
                                                      "msg": "not linked"})

    def close(self) -> None:
        self.sock.close(linger=100)
