"""Control plane sockets: one ROUTER server per listening instance, one DEALER per link, each a
:class:`~.loop_socket.LoopSocket` (driven from the event loop without pyzmq's asyncio futures).

Each socket has exactly one reader task (:meth:`Server.serve`, :func:`read_dealer`).  The socket hands every
message it receives to that task's :class:`_Inbox`, which delivers them in order to the link's
:class:`~.channel.Channel` (inline kinds awaited in turn, others in tasks of the instance's
:class:`~.channel.TaskSet`).  A reply goes to the request awaiting it at once, without waking the task, when
nothing received before it is still waiting or being handled.

With :class:`~aiodatadist.settings.curve_keys.CurveKeys` (``llm.CurveSecretKey``), every socket uses ZeroMQ CURVE: the
server is a CURVE server whose context runs a ZAP handler (:class:`ZapHandler`) admitting only the listed client
keys, fails closed (``ZAP_ENFORCE_DOMAIN``), and checks that a client's HELLO claims a cluster id its key is listed
for; a DEALER is a CURVE client that expects the server key listed for the cluster it links to.  See
``docs/security.md``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import zmq
import zmq.asyncio
import zmq.utils.z85

from .._aio import drop_cancellation
from .._listen import LISTEN_BACKLOG
from .._log_limits import LimitedWarning
from ..errors import LLMLinkError, LLMStatusCode
from ..protocol.codec import MAX_MESSAGE_BYTES, Kind, decode_batch, encode
from ..protocol.messages import reply_to_wire
from ..settings.curve_keys import CurveKeys
from .channel import Channel, TaskSet
from .loop_socket import LoopSocket

__all__ = ["LINGER_MS", "ZAP_DOMAIN", "Context", "Server", "ZapHandler", "abandon_context", "connect_dealer",
           "dealer_sender", "new_context", "read_dealer"]

log = logging.getLogger("aiodatadist.control.sockets")
_malformed = LimitedWarning(log)  # a peer sending garbage in a loop gets one line per interval

W = TypeVar("W")

LINGER_MS: Final = 100
"""How long a socket closed in an orderly way still tries to deliver what it queued (a BYE), in milliseconds; the
context's default, for every other close, is 0."""
# ZMTP heartbeats (milliseconds): a PING every HEARTBEAT_IVL_MS on each connection; one that hears nothing within
# HEARTBEAT_TIMEOUT_MS of a PING is dropped, and each PING asks the peer to drop it after HEARTBEAT_TTL_MS of silence.
HEARTBEAT_IVL_MS: Final = 1000
HEARTBEAT_TIMEOUT_MS: Final = 5000
HEARTBEAT_TTL_MS: Final = 5000
HANDSHAKE_IVL_MS: Final = 10_000  # server: a connection that has not finished its ZMTP handshake by then is closed
ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
ZAP_DOMAIN: Final = b"aiodatadist"
_MAX_KEYED_ROUTES: Final = 4096  # server: routing ids remembered with their CURVE key beyond the linked ones


class Context(zmq.asyncio.Context):
    """An asyncio context that holds its open sockets (monitor sockets included) strongly, until each is closed.

    pyzmq's own set is weak: when an abandoned instance is garbage-collected, the collector clears those references
    before any finalizer runs, and the context's ``term()`` then waits for ever on sockets it no longer knows.
    Here :func:`abandon_context` can still reach and close every one of them."""

    open_sockets: set[Any]
    loop_sockets: weakref.WeakSet[LoopSocket]  # the DEALERs and ROUTERs (their descriptors watched by a loop)
    zap: ZapHandler | None  # CURVE: the context's ZAP handler, started with the first CURVE server

    def __init__(self) -> None:
        super().__init__()
        self.open_sockets = set()
        self.loop_sockets = weakref.WeakSet()
        self.zap = None

    def loop_socket(self, kind: int, *, copy: bool = True) -> LoopSocket:
        """A DEALER or ROUTER driven by the running loop (see :class:`~.loop_socket.LoopSocket`)."""
        sock = LoopSocket.open(self, kind, copy=copy)
        self.loop_sockets.add(sock)
        return sock

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
    loop possibly gone): every socket closed with linger 0 (a loop-driven one by its loop where that still runs),
    then ``term()`` on a daemon thread.  Never blocks."""
    driven = list(ctx.loop_sockets)
    for loop_sock in driven:
        loop_sock.abandon()
    skip = {id(loop_sock.raw) for loop_sock in driven}
    for sock in list(ctx.open_sockets):
        if sock.closed or id(sock) in skip:
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


def _tune(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)


class _Inbox:
    """What a socket received, delivered in order by its reader task (:meth:`serve`).  A reply resolves its request
    at once (:meth:`resolved`) while nothing received before it waits here or is being handled, which keeps the order
    of a link's messages as the reader would see them one by one."""

    def __init__(self) -> None:
        self._queue: collections.deque[Callable[[], Awaitable[None]]] = collections.deque()
        self._wake: asyncio.Future[None] | None = None
        self._busy = False
        self._error: BaseException | None = None

    def reading(self, received: Callable[[list[Any]], None]) -> Callable[[list[Any]], None]:
        """``received`` (the socket's callback on the loop) with its failures raised by the reader task: a bug
        there ends the task, as one in a delivery does, instead of only reaching the loop's exception handler."""
        def guarded(frames: list[Any]) -> None:
            if self._error is not None:
                return
            try:
                received(frames)
            except Exception as exc:  # noqa: BLE001 - raised again by serve()
                self._error = exc
                self._wake_up()
        return guarded

    def _wake_up(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def resolved(self, channel: Channel, message: dict[str, Any]) -> bool:
        """Whether ``message`` was a reply handed to its request at once (nothing received before it pending)."""
        if message["k"] == Kind.REPLY and not self._queue and not self._busy:
            channel.resolve(message)
            return True
        return False

    def put_call(self, deliver: Callable[[], Awaitable[None]]) -> None:
        """Something for the reader task to await in turn."""
        self._queue.append(deliver)
        self._wake_up()

    async def serve(self) -> None:
        """Deliver what arrives, for ever (the reader task)."""
        loop = asyncio.get_running_loop()
        queue = self._queue
        while True:
            if self._error is not None:
                raise self._error
            if not queue:
                self._wake = loop.create_future()
                await self._wake
                continue
            self._busy = True
            try:
                await queue.popleft()()
            finally:
                self._busy = False


async def read_dealer(sock: LoopSocket, channel: Channel, tasks: TaskSet) -> None:
    """Reader task of a client socket (cancelled, it stops reading)."""
    inbox = _Inbox()

    def received(frames: list[Any]) -> None:
        try:
            messages = decode_batch(frames[-1])
        except Exception as exc:  # noqa: BLE001 - whatever a peer sends must not end the reader
            _malformed("dropping malformed message on %s: %s", channel.name, exc)
            return
        for message in messages:
            if not inbox.resolved(channel, message):
                inbox.put_call(functools.partial(_deliver, channel, message, tasks))

    sock.start(inbox.reading(received))
    try:
        await inbox.serve()
    finally:
        sock.stop()


def _decoded(routing_id: bytes, data: bytes) -> list[dict[str, Any]]:
    """The messages of one received batch; a malformed one is logged and dropped whole (whatever a peer sends
    must not end the reader)."""
    try:
        return decode_batch(data)
    except Exception as exc:  # noqa: BLE001
        _malformed("dropping malformed message from %r: %s", routing_id[:8], exc)
        return []


async def _deliver(channel: Channel, message: dict[str, Any], tasks: TaskSet) -> None:
    if message["k"] in Kind.INLINE:
        await channel.dispatch(message)
    else:
        tasks.spawn(channel.dispatch(message), name=f"handle-{message['k']}")


def _sender(sock: LoopSocket, channel: Channel, envelope: tuple[bytes, ...]) -> Callable[[bytes], None]:
    def send(data: bytes) -> None:
        try:
            sock.send([*envelope, data])
        except zmq.ZMQError as exc:  # e.g. a ROUTER's peer is gone (ROUTER_MANDATORY), or the socket closed
            raise LLMLinkError(f"peer of {channel.name} unreachable: {exc}") from None
    return send


def dealer_sender(sock: LoopSocket) -> Callable[[Channel], Callable[[bytes], None]]:
    """The send function of a client channel (frames are queued by ZeroMQ; a refused one fails the channel)."""
    return lambda channel: _sender(sock, channel, ())


def connect_dealer(ctx: Context, endpoint: str, routing_id: bytes, curve: CurveKeys | None = None,
                   remote_id: int = 0, *, watch: Callable[[zmq.Socket[Any]], W]) -> tuple[LoopSocket, W]:
    """A DEALER connected to ``endpoint``, and what ``watch(socket)`` made of it just before it connected (a
    :class:`~.monitor.ConnectionWatch`: no connection event is missed).  With ``curve``, a CURVE client that
    completes its handshake only with a server holding the secret key of the public key listed for cluster
    ``remote_id`` (a server without CURVE, or with another key, refuses it: the watch sees the failed handshake).
    With no key listed for that cluster the socket is not connected at all (logged), so that the link fails
    without a byte in the clear (at its timeout)."""
    sock = ctx.loop_socket(zmq.DEALER)
    raw = sock.raw
    _tune(raw)
    raw.setsockopt(zmq.ROUTING_ID, routing_id)
    if curve is not None:
        server_key = curve.server_key(remote_id)
        raw.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
        raw.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
        if server_key is None:
            log.warning("no CURVE public key for cluster %d in llm.CurvePeerKeys (list it as %d=KEY, or list "
                        "exactly one key without an id): the link to %s is not attempted", remote_id, remote_id,
                        endpoint)
            return sock, watch(raw)
        raw.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    watching = watch(raw)
    raw.connect(endpoint)
    return sock, watching


class ZapHandler:
    """A context's ZAP handler (ZeroMQ RFC 27) for CURVE servers: admits a client's handshake only when its public
    key is in ``llm.CurvePeerKeys`` and reports that key as the connection's User-Id.  Bound before any CURVE
    server socket is; the servers enforce the ZAP domain, so without a live handler no client gets in.  Its task
    ends when the socket is closed (the link manager closes every socket of its context on ``close``)."""

    def __init__(self, ctx: zmq.asyncio.Context, curve: CurveKeys) -> None:
        self.curve = curve
        self.sock = ctx.socket(zmq.REP)
        try:
            self.sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            self.sock.close(linger=0)
            raise
        self.task = asyncio.ensure_future(self._serve())
        self.task.add_done_callback(_zap_ended)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request (sans-IO): ``[version, request id, domain, address, identity, mechanism,
        credentials...]`` -> ``[version, request id, status, text, user id, metadata]``."""
        if len(request) < 6 or request[0] != b"1.0":
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        request_id, domain, address, mechanism = request[1], request[2], request[3], request[5]
        credentials = request[6:]
        if mechanism != b"CURVE" or domain != ZAP_DOMAIN or len(credentials) != 1 or len(credentials[0]) != 32:
            log.warning("refused a control connection from %s: mechanism %r is not CURVE", address.decode(
                errors="replace"), mechanism)
            return [b"1.0", request_id, b"400", b"CURVE required", b"", b""]
        key = zmq.utils.z85.encode(credentials[0])
        if not self.curve.trusts(key):
            log.warning("refused a CURVE control connection from %s: its public key %s is not in "
                        "llm.CurvePeerKeys", address.decode(errors="replace"), key.decode())
            return [b"1.0", request_id, b"400", b"public key not trusted", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", key, b""]

    async def _serve(self) -> None:
        while True:
            request = await self.sock.recv_multipart()
            try:
                reply = self.answer(request)
            except Exception as exc:  # noqa: BLE001 - a malformed request must not end the handler
                log.warning("malformed ZAP request: %r", exc)
                reply = [b"1.0", b"", b"500", b"internal error", b"", b""]
            await self.sock.send_multipart(reply)


def _zap_ended(task: asyncio.Future[None]) -> None:
    """The ZAP handler's task ended: cancelled when its socket closed, else a failure (clients are refused from now
    on: CURVE servers enforce the ZAP domain)."""
    if task.cancelled():
        drop_cancellation(task)
    elif task.exception() is not None:
        log.error("the CURVE ZAP handler failed; no client is admitted any more", exc_info=task.exception())


def _zap_for(ctx: Context, curve: CurveKeys) -> ZapHandler:
    if ctx.zap is None or ctx.zap.sock.closed:
        ctx.zap = ZapHandler(ctx, curve)
    return ctx.zap


class Server:
    """A bound ROUTER socket; channels are created per routing id when a peer says hello.

    With ``curve``: a CURVE server (clients admitted by the context's :class:`ZapHandler`), a client's HELLO must
    claim a cluster id its key is listed for, and a linked routing id's messages must come from the key that said
    hello on it (``ROUTER_HANDOVER`` would otherwise let another trusted key take a connection over)."""

    def __init__(self, ctx: Context, endpoint: str,
                 on_hello: Callable[[bytes, dict[str, Any]], Awaitable[None]], curve: CurveKeys | None = None) -> None:
        self.curve = curve
        if curve is not None:
            _zap_for(ctx, curve)  # bound before the server: no handshake may happen without it
        self.sock = ctx.loop_socket(zmq.ROUTER, copy=curve is None)  # CURVE: frames carry the client's key
        raw = self.sock.raw
        _tune(raw)
        raw.setsockopt(zmq.ROUTER_MANDATORY, 1)
        raw.setsockopt(zmq.ROUTER_HANDOVER, 1)
        raw.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)  # a half-open greeting holds its descriptor no longer
        raw.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        if curve is not None:
            raw.setsockopt(zmq.CURVE_SERVER, 1)
            raw.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
            raw.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            raw.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering: nobody gets in
        try:
            raw.bind(endpoint)
        except zmq.ZMQError:
            self.sock.close(linger=0)  # an unclosed socket would block the context's term() forever
            raise
        self.requested = endpoint  # as asked: port 0 means any free port
        bound = raw.getsockopt(zmq.LAST_ENDPOINT)
        port = bound.decode().rsplit(":", 1)[1] if isinstance(bound, bytes) else endpoint.rsplit(":", 1)[1]
        self.endpoint = f"{endpoint.rsplit(':', 1)[0]}:{port}"  # as bound: the port peers connect to
        self.channels: dict[bytes, Channel] = {}
        self._on_hello = on_hello
        self._keys: dict[bytes, bytes] = {}  # CURVE: routing id -> the client key that said hello on it

    def sender(self, routing_id: bytes) -> Callable[[Channel], Callable[[bytes], None]]:
        """The send function of a server-side channel (an unknown routing id fails the channel)."""
        return lambda channel: _sender(self.sock, channel, (routing_id,))

    def reply_raw(self, routing_id: bytes, message: dict[str, Any]) -> None:
        try:
            self.sock.send([routing_id, encode(message)])
        except zmq.ZMQError:
            pass

    async def serve(self, tasks: TaskSet) -> None:
        """Reader task of the server socket (cancelled, it stops reading)."""
        inbox = _Inbox()
        curve = self.curve

        def received(frames: list[Any]) -> None:
            if len(frames) != 2:
                return
            if curve is None:
                routing_id, data = frames
                for message in _decoded(routing_id, data):
                    self._route(inbox, routing_id, message, tasks)
            else:
                self._received_curve(inbox, frames, tasks, curve)

        self.sock.start(inbox.reading(received))
        try:
            await inbox.serve()
        finally:
            self.sock.stop()

    def _route(self, inbox: _Inbox, routing_id: bytes, message: dict[str, Any], tasks: TaskSet) -> None:
        channel = self.channels.get(routing_id)
        if channel is None or not inbox.resolved(channel, message):
            inbox.put_call(functools.partial(self._deliver, routing_id, message, tasks))

    async def _deliver(self, routing_id: bytes, message: dict[str, Any], tasks: TaskSet) -> None:
        """A message in its turn, to the channel its routing id has by then."""
        channel = self.channels.get(routing_id)
        if channel is not None:
            await _deliver(channel, message, tasks)
        elif message["k"] == Kind.HELLO:
            tasks.spawn(self._on_hello(routing_id, message), name="hello")
        elif message["k"] != Kind.REPLY:
            self.reply_raw(routing_id, reply_to_wire(
                message["i"], code=int(LLMStatusCode.LLM_NOT_YET_LINK), msg="not linked"))

    def _received_curve(self, inbox: _Inbox, frames: list[Any], tasks: TaskSet, curve: CurveKeys) -> None:
        """A CURVE server's message: as a plain one, reading its User-Id (the client's public key, set by the ZAP
        handler) to bind cluster ids and routing ids to keys."""
        routing_id, data = frames[0].bytes, frames[1].bytes
        try:
            key = str(frames[1].get("User-Id")).encode()
        except zmq.ZMQError:  # no User-Id: not admitted by our ZAP handler (cannot happen: fail closed)
            return
        for message in _decoded(routing_id, data):
            if routing_id in self.channels:
                if self._keys.get(routing_id) != key:
                    log.warning("dropping a message on a linked connection taken over by another CURVE key "
                                "(%s)", key.decode())
                    continue
            elif message["k"] == Kind.HELLO:
                allowed = curve.clusters_of(key)
                claimed = message.get("cluster")
                if allowed is not None and not (type(claimed) is int and claimed in allowed):
                    log.warning("refused a link from cluster %r: CURVE key %s is listed only for cluster(s) %s",
                                claimed, key.decode(), ",".join(map(str, sorted(allowed))))
                    self.reply_raw(routing_id, reply_to_wire(
                        message["i"], code=int(LLMStatusCode.LLM_LINK_FAILED),
                        msg=f"this CURVE key is not trusted for cluster {claimed!r}"))
                    continue
                self._remember(routing_id, key)
            self._route(inbox, routing_id, message, tasks)

    def _remember(self, routing_id: bytes, key: bytes) -> None:
        """Bind ``routing_id`` to ``key`` (the newest last); past the bound, routes that are not linked are
        forgotten, the oldest first (a link still in its handshake is among the newest)."""
        self._keys.pop(routing_id, None)
        self._keys[routing_id] = key
        if len(self._keys) > len(self.channels) + _MAX_KEYED_ROUTES:
            unlinked = [r for r in self._keys if r not in self.channels]
            for r in unlinked[:len(unlinked) - _MAX_KEYED_ROUTES // 2]:
                del self._keys[r]

    def close(self) -> None:
        self.sock.close(linger=LINGER_MS)
