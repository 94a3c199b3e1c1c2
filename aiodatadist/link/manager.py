"""The links of one instance: the handshake, the link table, unlinking, and dispatch of a link's requests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
import socket
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn, Protocol

import zmq
import zmq.asyncio

from .._aio import in_thread, wait_through_cancellation
from .._log_limits import LimitedWarning
from ..control.channel import Channel, TaskSet
from ..control.loop_socket import LoopSocket
from ..control.monitor import ConnectionWatch, Disconnects, describe_failure, probe
from ..control.sockets import (
    LINGER_MS,
    Context,
    Server,
    abandon_context,
    connect_dealer,
    dealer_sender,
    new_context,
    read_dealer,
)
from ..errors import LinkDropReason, LLMException, LLMLinkError, LLMStatusCode
from ..protocol import auth
from ..protocol.codec import Kind, ProtocolError
from ..protocol.handshake import (
    AUTH_FAILED,
    AUTH_REQUIRED,
    MAX_LINKS,
    PROTOCOL_VERSION,
    Refused,
    admit,
    answer_challenge,
    authenticate,
    choose_plane,
    client_plane,
    data_connections,
    may_link,
    plane_refusal,
)
from ..protocol.identity import SegmentIdentity
from ..protocol.messages import (
    FD_TOKEN_BYTES,
    Bye,
    DataOffer,
    Hello,
    HelloChallenge,
    HelloReply,
    Ping,
    Plane,
    Request,
    is_challenge,
    reply_to_wire,
)
from ..settings.options import Settings
from ..stats import MessageCounter
from ..transport.fd_passing import FdServer
from ..transport.same_host import (
    HostProbe,
    PeerCapabilities,
    allowed_mechanisms,
    probe_peer,
    probe_peer_fds,
)
from ..transport.tcp.connect import accept_data, connect_data, data_listener
from ..transport.tcp.plane import Connections
from ..types import LLMClusterInfo, LLMRole, ip_int_to_str
from .attempts import LinkAttempts
from .drops import DropLog
from .link import Link
from .planes import PlaneFactory

__all__ = ["MAX_LINKS", "ClosedHook", "LinkManager", "Publications", "RequestHook"]

DISCONNECT_PINGS_S = (0.05, 0.25, 1.0)  # after a client connection broke: ping the server's links, then wait
PROBE_S = 0.25  # a client's connection broke: how long a TCP connect to the server's address may take
PROBE_AGAIN_S = 0.02  # ... and, accepted, when to try once more (a dying process closes its listener last)
R = LinkDropReason

log = logging.getLogger("aiodatadist.link")
_at_link_limit = LimitedWarning(log)
_challenges_full = LimitedWarning(log)

RequestHook = Callable[["Link", dict[str, Any]], Awaitable["dict[str, Any] | None"]]
"""Serves a peer's transfer request on a link; returns the reply body (None: answered later, or never)."""
ClosedHook = Callable[["Link", LLMException], Awaitable[None]]
"""Told when a link is torn down, after its data plane stopped, before its peer memory is let go."""
S = LLMStatusCode


class Publications(Protocol):
    """What this instance announces to its peers at link time (its cache registry)."""

    def announced_segments(self) -> tuple[tuple[SegmentIdentity, int], ...]:
        """The shared segments of its remote-accessible caches, with their addresses here."""
        ...

    def directory_identity(self) -> SegmentIdentity | None:
        """Its cache directory's segment, if any."""
        ...

    def shared_fd(self, inode: int, device: int) -> int | None:
        """The memfd of a remote-accessible cache's segment ``(inode, device)``, or None."""
        ...


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


@dataclasses.dataclass(eq=False)
class _Client:
    """A link attempt's client socket, with its channel, reader and connection watch; its data connections and
    its link once made (what a cancelled attempt undoes)."""

    endpoint: str
    sock: LoopSocket
    channel: Channel
    reader: asyncio.Task[Any]
    watch: ConnectionWatch
    conns: Connections | None = None
    link: Link | None = None


def _abandoned(ctx: Context, cluster_id: int) -> None:
    """A link manager was garbage-collected without :meth:`LinkManager.close` (its instance was never finalized,
    e.g. its event loop ended first): like an unclosed file, warn and free what it held, never blocking."""
    try:
        log.warning("cluster %d was not finalized: its sockets are closed without notifying its peers "
                    "(call LLMDataDist.finalize() or use 'async with')", cluster_id)
    except Exception:  # noqa: BLE001, S110 - logging may be gone at interpreter shutdown
        pass
    abandon_context(ctx)


class LinkManager:
    """The links of one :class:`LLMDataDist`, its server socket and its control-plane tasks."""

    def __init__(self, cluster_id: int, role: LLMRole, settings: Settings, publications: Publications,
                 planes: PlaneFactory, start_nixl: Callable[[], object] | None = None,
                 messages: Callable[[int], MessageCounter] | None = None) -> None:
        self._cluster_id = cluster_id
        self._messages = messages or (lambda _: MessageCounter())  # a remote cluster's control-message counter
        self._start_nixl_plane = start_nixl  # starts the NIXL plane (raises LLMException) for a nixl link
        self.role = role  # set by switch_role
        self._settings = settings
        self._publications = publications
        self._planes = planes
        self._ctx = new_context()
        # Dropped without close() (the instance never finalized): free the sockets and context without blocking.
        self._abandoned = weakref.finalize(self, _abandoned, self._ctx, cluster_id)
        self._abandoned.atexit = False  # at exit pyzmq leaves contexts alone; a live loop may still use them
        self._tasks = TaskSet()
        self._probe = HostProbe()
        self._fd_grants: dict[bytes, Link] = {}  # fd socket tokens given to peers over their admitted link
        self._fds = self._fd_server()
        self._server: Server | None = None
        self._server_task: asyncio.Task[Any] | None = None
        self._server_watch: asyncio.Task[Any] | None = None
        self._disconnects: Disconnects | None = None  # the server's ended connections, counted
        self._accept_task: asyncio.Task[Any] | None = None
        self._data_listener: socket.socket | None = None
        self._data_tokens: dict[bytes, Link] = {}
        key = settings.auth_key
        self._auth_key = auth.derive_key(key) if key is not None else None
        self._challenges = auth.ChallengeTable()
        self.links: dict[int, Link] = {}
        self._attempts = LinkAttempts(self._tasks.spawn, self._unlink_undone)  # links being made, by cluster id
        self._drops = DropLog()  # why recent links went away, by cluster id
        self._settling: dict[int, asyncio.Future[None]] = {}  # links unlisted, being dropped once it is known why
        self._dropping: dict[int, set[asyncio.Future[None]]] = {}  # links being torn down, by cluster id
        # Hooks set by the transfer layer.
        self.on_request: RequestHook | None = None
        self.on_link_closed: ClosedHook | None = None

    # -- server ----------------------------------------------------------------------------------------------
    @property
    def listening(self) -> str | None:
        """The bound endpoint (``tcp://ip:port``, the real port when asked for port 0), or None."""
        return self._server.endpoint if self._server is not None else None

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(ip, port)`` of the bound server socket (the real port when asked for port 0), or None."""
        return _split_endpoint(self._server.endpoint) if self._server is not None else None

    async def listen(self, ip: str, port: int) -> None:
        """Listen on ``ip:port`` (replacing the current address; the same address is kept as it is)."""
        endpoint = f"tcp://{ip}:{port}"
        if self._server is not None and self._server.requested == endpoint:
            return
        old = self._server.endpoint if self._server is not None else None
        if old is not None and _split_endpoint(old)[1] == port:
            await self.stop_listening()  # the same port in another address form: it must be free to bind again
        try:
            server = Server(self._ctx, endpoint, self._on_hello, self._settings.curve)
        except zmq.ZMQError as exc:
            # A failed bind leaves the current server (if any) untouched.
            raise LLMException(f"cannot listen on {ip}:{port}: {exc}", status_code=S.LLM_PARAM_INVALID) from None
        try:
            listener = data_listener(ip)
        except OSError as exc:
            server.close()
            raise LLMException(f"cannot listen for data connections on {ip}: {exc}",
                               status_code=S.LLM_PARAM_INVALID) from None
        await self.stop_listening()
        self._server = server
        self._server_task = self._tasks.spawn(server.serve(self._tasks), name=f"server-{endpoint}")
        self._server_watch = self._tasks.spawn(self._watch_server(server), name=f"watch-{endpoint}")
        self._data_listener = listener
        self._accept_task = self._tasks.spawn(
            accept_data(listener, self._adopt_data, functools.partial(self._tasks.spawn, name="adopt-data")),
            name=f"data-{endpoint}")
        log.info("cluster %d listening on %s", self._cluster_id, server.endpoint)

    async def stop_listening(self) -> None:
        """Stop serving: the server's tasks end before its sockets close.  A socket's descriptor number names what
        the event loop registered for it (its reader), and a server listening again at once may get the same
        numbers: nothing of the old one may be left then."""
        server, listener = self._server, self._data_listener
        tasks = [task for task in (self._server_watch, self._server_task, self._accept_task) if task is not None]
        self._server = self._server_task = self._server_watch = self._accept_task = None
        self._data_listener = None
        for task in tasks:
            task.cancel()
        await wait_through_cancellation(asyncio.gather(*tasks, return_exceptions=True))
        if listener is not None:
            listener.close()
        if server is not None:
            server.close()

    def _hello(self, remote_cluster_id: int, client_nonce: bytes, grant: bytes | None) -> Hello:
        """The first HELLO of a link to ``remote_cluster_id`` (``grant``: this side's fd socket token for the
        server, sent here only when the link is not authenticated: else in the second HELLO, once the server
        proved its key)."""
        return Hello(PROTOCOL_VERSION, self._cluster_id, remote_cluster_id, int(self.role), self._settings.transport,
                     self._probe.info(), self._publications.announced_segments(),
                     self._publications.directory_identity(), self._planes.native_net, cn=client_nonce,
                     fdt=None if self._auth_key is not None else grant)

    # -- fd socket: segments handed to same-host peers under another user -------------------------------------
    def _fd_server(self) -> FdServer | None:
        if "fds" not in allowed_mechanisms():
            return None
        probe_fd = self._probe.segment.fd
        try:
            assert probe_fd is not None
            server = FdServer(probe_fd, self._segment_fd)
        except OSError as exc:  # e.g. no abstract Unix sockets here
            log.debug("no fd socket: %s", exc)
            return None
        server.start()
        self._probe.fds = server.name
        return server

    def _segment_fd(self, token: bytes, inode: int, device: int) -> int | None:
        """The memfd of a remote-accessible cache's segment ``(inode, device)``, for the peer that holds
        ``token`` (a live link's grant); None for anyone else or any other memory."""
        link = self._fd_grants.get(token)
        if link is None or link.closed:
            return None
        return self._publications.shared_fd(inode, device)

    def _grant(self, link: Link, grant: bytes) -> None:
        link.fd_grant = grant
        self._fd_grants[grant] = link

    async def _on_hello(self, routing_id: bytes, message: dict[str, Any]) -> None:
        assert self._server is not None
        server = self._server
        seen = self._disconnects.total if self._disconnects is not None else 0
        req_id = message["i"]
        try:
            hello = Hello.from_wire(message)
        except ProtocolError as exc:
            server.reply_raw(routing_id, reply_to_wire(req_id, code=int(S.LLM_LINK_FAILED),
                                                       msg=f"malformed hello: {exc}"))
            return
        cluster = hello.cluster
        nonces = None
        if self._auth_key is not None:
            nonces = await self._authenticate(server, routing_id, req_id, hello)
            if nonces is None:
                return  # challenged (the client answers with a second HELLO) or refused
        stale = self.links.get(cluster)
        if stale is not None and not stale.is_client and not await self._alive(stale):
            # The peer restarted (or its old connection died): its old link must not block the new one.
            await self.drop(stale, LLMLinkError(f"cluster {cluster} reconnected; its old link was dead",
                                                reason=R.CONNECTION_LOST))
        code, msg = admit(hello.version, cluster, hello.target, own_id=self._cluster_id, links=self.links,
                          linking=self._attempts, max_links=MAX_LINKS)
        if code == 0:
            caps = await probe_peer_fds(hello.host, probe_peer(hello.host))
            chosen = self._choose(hello.transport, caps)
            if isinstance(chosen, LLMException):
                code, msg = int(chosen.status_code), str(chosen)
            else:
                await self._accept(server, routing_id, req_id, hello, nonces, caps, chosen)
                link = self.links.get(cluster)
                if link is not None:
                    self._check_admitted(link, seen)
                return
        if code == S.LLM_CLUSTER_NUM_EXCEED_LIMIT:
            _at_link_limit("cluster %d refused a link from cluster %d: it has %d links, the most it admits "
                           "(without llm.AuthKey any client that says hello is a link)", self._cluster_id, cluster,
                           MAX_LINKS)
        server.reply_raw(routing_id, reply_to_wire(req_id, code=code, msg=msg))

    def _choose(self, peer_transport: Any, caps: PeerCapabilities) -> Plane | LLMException:
        """The plane of a link with a peer set to ``peer_transport``, or why there is none."""
        plane = choose_plane(self._settings.transport, peer_transport, caps.same_host)
        if plane is None:
            return LLMException(plane_refusal(self._settings.transport, peer_transport),
                                status_code=S.LLM_LINK_FAILED)
        refusal = self._start_nixl() if self._planes.needs_nixl(plane) else None
        return refusal if refusal is not None else plane

    def _set_plane(self, link: Link, kind: Plane, caps: PeerCapabilities, conns: Connections | None,
                   fd_token: bytes | None) -> None:
        async def untrusted(error: LLMException) -> None:
            if isinstance(error, LLMLinkError) and error.reason is None:
                error.reason = R.PROTOCOL_ERROR
            await self.drop(link, error)

        link.plane = self._planes.plane(kind, link.remote_cluster_id, caps, untrusted, conns=conns,
                                        fd_token=fd_token, peer_serves_reads=link.peer_serves_reads)

    def _connections(self, link: Link) -> Connections:
        """A link's data connections: a failure drops the link."""
        def broken(error: LLMException) -> None:
            # A peer answering our BYE closes its data connections: that end is expected, the BYE's reply is not
            # lost because of it (the unlink drops the link itself).
            if not link.closed and not link.unlinking:
                if isinstance(error, LLMLinkError) and error.reason is None:
                    error.reason = R.DATA_CONNECTION_LOST  # (its transfers raise it now: the probe comes later)
                self._tasks.spawn(self._connection_lost(link, str(error), R.DATA_CONNECTION_LOST),
                                  name=f"drop-{link.remote_cluster_id}")

        return self._planes.connections(link.remote_cluster_id, broken)

    async def _accept(self, server: Server, routing_id: bytes, req_id: Any, hello: Hello,
                      nonces: tuple[bytes, bytes] | None, caps: PeerCapabilities, plane: Plane) -> None:
        """Server side: admit the link (the handshake agreed on ``plane``) and answer the HELLO."""
        cluster = hello.cluster
        channel = Channel(server.sender(routing_id), self._handle, f"{self._cluster_id}<-{cluster}",
                          self._messages(cluster))
        link = Link(cluster, channel, is_client=False, endpoint=server.endpoint, remote_role=hello.role,
                    routing_id=routing_id)
        channel.context = link
        channel.on_failed = functools.partial(self._unreachable, link)
        data, dconns = None, None
        if self._data_listener is not None and self._planes.offers_connections(plane):  # the client may choose TCP
            port = self._data_listener.getsockname()[1]
            if nonces is not None and self._auth_key is not None:  # derived on both ends, never sent
                link.data_token = auth.data_token(self._auth_key, *nonces)
            else:
                link.data_token = secrets.token_bytes(16)
            data = DataOffer(port, None if nonces is not None else link.data_token)
            self._data_tokens[link.data_token] = link
            link.data_admits = dconns = self._settings.tcp_connections
            link.offered = self._connections(link)
        link.peer_serves_reads = hello.reads
        self._set_plane(link, plane, caps, link.offered, hello.fdt)
        grant = secrets.token_bytes(FD_TOKEN_BYTES)
        self._grant(link, grant)
        self.links[cluster] = link
        self._drops.forget(cluster)
        server.channels[routing_id] = channel
        reply = HelloReply(self._cluster_id, int(self.role), self._probe.info(), self._settings.transport,
                           self._publications.announced_segments(), self._publications.directory_identity(), plane,
                           self._planes.native_net, data, dconns, grant)
        await channel.reply(req_id, reply.to_wire())
        # In the background: nobody waits for the peer's segments to be mapped here.
        link.plane.adopt_announced(hello.directory, self._settings.directory, hello.segs)
        log.info("cluster %d accepted link from %d (%s)", self._cluster_id, cluster, link.plane.kind)

    async def _authenticate(self, server: Server, routing_id: bytes, req_id: Any,
                            hello: Hello) -> tuple[bytes, bytes] | None:
        """Server side of the challenge (see :mod:`aiodatadist.protocol.auth`): the nonces once the client proved it holds
        the key; None after answering with a challenge or a refusal."""
        assert self._auth_key is not None
        outcome = authenticate(self._auth_key, self._challenges, routing_id, hello, self._cluster_id,
                               time.monotonic())
        if isinstance(outcome, HelloChallenge):
            if len(self._challenges) >= auth.MAX_PENDING:
                _challenges_full("cluster %d has %d authentication challenges pending, the most it keeps: a HELLO "
                                 "flood? (each new one replaces the oldest)", self._cluster_id, auth.MAX_PENDING)
            server.reply_raw(routing_id, outcome.reply_to_wire(req_id))
            return None
        if isinstance(outcome, Refused):
            if outcome.msg == AUTH_FAILED:
                log.warning("cluster %d refused a link from cluster %d: authentication failed", self._cluster_id,
                            hello.cluster)
            server.reply_raw(routing_id, reply_to_wire(req_id, code=outcome.code, msg=outcome.msg))
            return None
        return outcome

    async def not_linked(self, remote_id: int) -> NoReturn:
        """Raise the error of a call to ``remote_id``, which is not linked: ``LLM_NOT_YET_LINK``, an ``LLMLinkError``
        naming why when its link dropped recently (:class:`~aiodatadist.errors.LinkDropReason`), else a plain
        ``LLMException``.  A link whose connection just broke is first given the moment it takes to learn why
        (a probe of the peer's address, well under a second).  Use: ``links.get(c) or await not_linked(c)``."""
        settling = self._settling.get(remote_id)
        if settling is not None:
            await asyncio.shield(settling)
        raise self._drops.not_linked(remote_id)

    async def check(self, remote_id: int, timeout: float) -> None:
        """Raise unless linked to ``remote_id`` (``LLM_NOT_YET_LINK``) and its peer answers a ping within
        ``timeout`` seconds (``LLM_LINK_FAILED``)."""
        link = self.links.get(remote_id) or await self.not_linked(remote_id)
        if not await self._alive(link, timeout):
            raise LLMException(f"cluster {remote_id} did not answer within {timeout:g} s",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)

    async def _alive(self, link: Link, timeout: float = 0.5) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await link.channel.request(Ping())
            return True
        except (LLMException, TimeoutError):
            return False

    # -- client ----------------------------------------------------------------------------------------------
    async def link_one(self, cluster: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        """Link to ``cluster`` (``link_clusters`` of one cluster): its per-cluster code.  A call while a link to the
        same cluster id is being made joins that attempt and gets its code; a call when the link exists gets
        ``LLM_ALREADY_LINK``."""
        remote_id = cluster.remote_cluster_id
        assert remote_id is not None
        await self.torn_down(remote_id)  # an old link to it is being dropped: its peer must not meet it still there
        if remote_id in self._attempts:
            return await self._attempts.join(remote_id, timeout_ms / 1000)
        status = may_link(remote_id, own_id=self._cluster_id, links=self.links, linking=self._attempts,
                          max_links=MAX_LINKS)
        if status != S.LLM_SUCCESS:
            return status
        return await self._attempts.start(remote_id, self._link(cluster, remote_id, timeout_ms))

    async def _link(self, cluster: LLMClusterInfo, remote_id: int, timeout_ms: int) -> LLMStatusCode:
        """One link attempt (run by :class:`LinkAttempts`); cancelled, it leaves no link, socket or task behind and
        tells the server to drop its end."""
        ip, port = cluster.remote_ip_info_list[0]
        endpoint = f"tcp://{ip_int_to_str(ip)}:{port}"
        deadline = asyncio.get_running_loop().time() + timeout_ms / 1000
        client = self._client(endpoint, remote_id)
        try:
            return await self._link_over(client, remote_id, deadline)
        except BaseException:  # cancelled (or a bug): undo what was built, also if cancelled again meanwhile
            await wait_through_cancellation(self._undo_attempt(client))
            raise

    def _client(self, endpoint: str, remote_id: int) -> _Client:
        """A client socket to ``endpoint``, watched from before it connects, with its channel and reader."""
        name = f"{self._cluster_id}->{remote_id}"

        def watch(sock: zmq.Socket[Any]) -> ConnectionWatch:
            return ConnectionWatch(sock, self._tasks.spawn, name)

        sock, connection = connect_dealer(self._ctx, endpoint, b"c" + secrets.token_bytes(15), self._settings.curve,
                                          remote_id, watch=watch)
        channel = Channel(dealer_sender(sock), self._handle, name, self._messages(remote_id))
        reader = self._tasks.spawn(read_dealer(sock, channel, self._tasks), name=f"reader-{remote_id}",
                                   on_error=functools.partial(self._reader_failed, channel))
        return _Client(endpoint, sock, channel, reader, connection)

    async def _link_over(self, client: _Client, remote_id: int, deadline: float) -> LLMStatusCode:
        grant = secrets.token_bytes(FD_TOKEN_BYTES)  # this side's fd socket token for the server
        try:
            answer, nonces = await self._handshake_watched(client, remote_id, grant, deadline)
            reply = HelloReply.from_wire(answer)
            caps = await probe_peer_fds(reply.host, probe_peer(reply.host))
        except (LLMException, TimeoutError, ProtocolError) as exc:
            # (a BYE the handshake queued still goes out as the socket lingers, unless the connection failed)
            self._abandon(client, bye=False, linger=not client.watch.failed.done())
            return self._failed(remote_id, client.endpoint, exc)
        chosen = self._choose(reply.transport, caps)
        if isinstance(chosen, LLMException):
            log.info("link %d -> %d (%s) failed: %s", self._cluster_id, remote_id, client.endpoint, chosen)
            self._abandon(client, bye=True)
            return chosen.status_code
        link = Link(remote_id, client.channel, is_client=True, endpoint=client.endpoint, remote_role=reply.role,
                    sock=client.sock, reader=client.reader, peer_serves_reads=reply.reads, watch=client.watch)
        kind = client_plane(chosen, reply.plane)
        if self._planes.uses_connections(kind):
            client.conns = self._connections(link)
            error = await self._open_data(client.conns, _split_endpoint(client.endpoint)[0], reply, nonces,
                                          deadline - asyncio.get_running_loop().time())
            if error is not None:
                log.info("link %d -> %d (%s): %s", self._cluster_id, remote_id, client.endpoint, error)
                self._abandon(client, bye=True)
                await client.conns.aclose(LLMLinkError(error))
                return S.LLM_LINK_FAILED
        self._set_plane(link, kind, caps, client.conns, reply.fdt)
        client.link = link
        return await self._register(link, reply, grant, deadline)

    async def _register(self, link: Link, reply: HelloReply, grant: bytes, deadline: float) -> LLMStatusCode:
        """Client side: the handshake is done: list the link, watch its connection, map the peer's caches."""
        remote_id = link.remote_cluster_id
        self._grant(link, grant)
        link.channel.context = link
        self.links[remote_id] = link
        self._drops.forget(remote_id)
        link.watcher = self._tasks.spawn(self._watch(link), name=f"watch-{remote_id}")
        # Map the peer's caches now, and give their page tables the rest of the link timeout to fill in, so that
        # the first transfers do not pay for it (what is left continues in the background).
        populating = link.plane.adopt_announced(reply.directory, self._settings.directory, reply.segs)
        remaining = deadline - asyncio.get_running_loop().time()
        if populating and remaining > 0:
            await asyncio.wait(populating, timeout=remaining)
        if link.closed:  # it dropped meanwhile (the peer died or unlinked): calls name why
            return S.LLM_LINK_FAILED
        log.info("cluster %d linked to %d at %s (%s)", self._cluster_id, remote_id, link.endpoint, link.plane.kind)
        return S.LLM_SUCCESS

    def _failed(self, remote_id: int, endpoint: str, exc: BaseException) -> LLMStatusCode:
        """The code of a handshake that failed with ``exc``; an authentication failure is remembered, so that a
        transfer to that cluster names it."""
        code = exc.status_code if isinstance(exc, LLMException) else S.LLM_LINK_FAILED
        why = str(exc) or "no answer in time (with CURVE: the server lacks it or holds another key)"
        log.info("link %d -> %d (%s) failed: %s", self._cluster_id, remote_id, endpoint, why)
        if isinstance(exc, LLMLinkError) and exc.reason == LinkDropReason.AUTH_FAILED:
            self._drops.record(remote_id, LinkDropReason.AUTH_FAILED, why)
        return code

    async def _handshake_watched(self, client: _Client, remote_id: int, grant: bytes,
                                 deadline: float) -> tuple[dict[str, Any], tuple[bytes, bytes] | None]:
        """The handshake, bounded by ``deadline`` (``TimeoutError``), failing at once with ``LLMLinkError`` when
        the connection does (refused, closed, or a CURVE handshake refused): ZeroMQ would retry in silence."""
        handshake = asyncio.ensure_future(self._handshake(client.channel, remote_id, grant))
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.wait((handshake, client.watch.failed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not handshake.done():
                handshake.cancel()
                await asyncio.wait((handshake,))
        if not handshake.cancelled():
            return handshake.result()
        event = client.watch.failed.result()
        reason = LinkDropReason.AUTH_FAILED if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else None
        raise LLMLinkError(f"{describe_failure(event)} at {client.endpoint}", reason=reason)

    @staticmethod
    def _abandon(client: _Client, *, bye: bool, linger: bool = True) -> None:
        """Client side: give up a link the handshake did not complete (``bye``: the server admitted us, or may
        have: let it drop its end; what is queued, the BYE too, still goes out as the socket lingers, unless not
        ``linger``: nobody is there to take it)."""
        if bye:
            with contextlib.suppress(LLMException):
                client.channel.notify(Bye())
        client.channel.close()
        client.reader.cancel()
        client.watch.close()
        client.sock.close(linger=LINGER_MS if linger else 0)

    async def _undo_attempt(self, client: _Client) -> None:
        """A link attempt was cancelled: drop its link if it was listed, else close what it opened; either way the
        server is told to drop its end."""
        link = client.link
        if link is not None and self.links.get(link.remote_cluster_id) is link:
            with contextlib.suppress(LLMException):
                link.channel.notify(Bye())
            await self.drop(link, LLMLinkError(f"linking to cluster {link.remote_cluster_id} was cancelled"))
            return
        self._abandon(client, bye=True)
        if client.conns is not None:
            await client.conns.aclose(LLMLinkError("linking was cancelled"))

    async def _unlink_undone(self, remote_id: int) -> None:
        """Every caller of a link attempt was cancelled as it succeeded: unlink it (the peer is told)."""
        await self.unlink_one(remote_id, 0, force=True)

    def _start_nixl(self) -> LLMException | None:
        """Start this instance's NIXL plane for a link that chose it; the reason it cannot, or None."""
        if self._start_nixl_plane is None:
            return LLMException("this instance has no NIXL support", status_code=S.LLM_FEATURE_NOT_ENABLED)
        try:
            self._start_nixl_plane()
        except LLMException as exc:
            return exc
        return None

    def _reader_failed(self, channel: Channel, error: BaseException) -> None:
        """A link's reader task failed (a bug: it survives any input): nothing more arrives on the link, so its
        requests would only run into their deadlines.  Drop the link, failing them at once."""
        log.error("the reader of %s failed", channel.name, exc_info=error)
        failure = LLMLinkError(f"the reader of link {channel.name} failed: {error!r}", reason=R.INTERNAL_ERROR)
        link = channel.context
        if isinstance(link, Link) and not link.closed:
            self._tasks.spawn(self.drop(link, failure), name=f"drop-{link.remote_cluster_id}")
        else:
            channel.close(failure)

    # -- TCP data connections -------------------------------------------------------------------------------
    async def _handshake(self, channel: Channel, remote_id: int,
                         grant: bytes) -> tuple[dict[str, Any], tuple[bytes, bytes] | None]:
        """Client side of the handshake, with the challenge when either end has a key; returns the server's
        admission reply (to decode with ``HelloReply.from_wire``) and, for an authenticated link, the nonces."""
        client_nonce = auth.new_nonce()
        hello = self._hello(remote_id, client_nonce, grant)
        answer = await _refusal_named(channel.request(hello))
        challenge = None
        if is_challenge(answer):
            try:
                challenge = HelloChallenge.from_wire(answer)
            except ProtocolError:
                challenge = HelloChallenge(b"", b"")  # malformed: fails like a wrong one (or asks for a key)
        second = answer_challenge(self._auth_key, hello, challenge)
        if isinstance(second, Refused):
            if second.bye:
                channel.notify(Bye())  # the server admitted us: let it drop its end
                channel.flush()
            raise LLMLinkError(second.msg, status_code=S.from_code(second.code), reason=R.AUTH_FAILED)
        if second is None:
            return answer, None
        assert challenge is not None
        second = dataclasses.replace(second, fdt=grant)  # the server proved its key: it may fetch our segments
        return await _refusal_named(channel.request(second)), (client_nonce, challenge.challenge)

    async def _open_data(self, conns: Connections, host: str, reply: HelloReply, nonces: tuple[bytes, bytes] | None,
                         timeout: float) -> str | None:
        """Client side: open the data connections the server admits; returns what went wrong, or None."""
        offer = data_connections(reply, self._auth_key, nonces)
        if isinstance(offer, str):
            return offer
        return await connect_data(host, offer.port, offer.token, offer.count, timeout, conns.attach)

    async def _adopt_data(self, conn: socket.socket, token: bytes) -> None:
        """Server side: a data connection that presents a link's token joins that link."""
        link = self._data_tokens.get(token)
        if link is None or link.closed or link.offered is None:
            conn.close()
            return
        link.data_admits -= 1
        if link.data_admits <= 0:  # every agreed connection is in: nobody else gets in with this token
            self._data_tokens.pop(token, None)
        if not self._planes.uses_connections(link.plane.kind):
            # The client chose TCP (it may not reach this host's memory): so does this end.
            before = link.plane
            self._set_plane(link, "tcp", before.caps, link.offered, None)
            await before.stop(LLMLinkError("the link moved to TCP"))
            await before.close()
        link.offered.attach(conn)

    # -- unlinking -------------------------------------------------------------------------------------------
    async def unlink_one(self, remote_id: int, timeout_ms: int, force: bool) -> LLMStatusCode:
        link = self.links.get(remote_id)
        if link is None:
            return S.LLM_SUCCESS if force else S.LLM_UNLINK_FAILED
        code = S.LLM_SUCCESS
        link.unlinking = True
        if force:
            try:  # tell the peer without waiting for it (zmq queues the message at once)
                link.channel.notify(Bye())
            except LLMException:
                pass
        else:
            try:
                async with asyncio.timeout(timeout_ms / 1000):
                    await link.channel.request(Bye())
            except (LLMException, TimeoutError):
                code = S.LLM_NOTIFY_PROMPT_UNLINK_FAILED
        await self.drop(link, LLMLinkError(f"cluster {remote_id} was unlinked by this side", reason=R.UNLINKED))
        return code

    def spawn(self, coro: Any, name: str) -> None:
        """Run a background task owned by this instance (cancelled by ``close``)."""
        self._tasks.spawn(coro, name=name)

    @staticmethod
    def notify(link: Link, msg: Request) -> None:
        """Queue a message that needs no answer (sent with the channel's next frame)."""
        link.channel.notify(msg)

    async def _watch_server(self, server: Server) -> None:
        """Server side: when client connections break, find which links lost their peer (a PING to a vanished
        routing id fails at once) and drop them, so that their transfers fail fast instead of timing out.  Every
        connection that ends is counted at once, however many end (port scanners, probes, clients that never say
        hello): one round of pings serves all that ended before it."""
        disconnects = self._disconnects = Disconnects(server.sock.raw, self._tasks.spawn, server.endpoint)
        seen = 0
        try:
            while True:
                await disconnects.after(seen)
                seen = disconnects.total
                await self._sweep(disconnects, self._served)
        finally:
            if self._disconnects is disconnects:
                self._disconnects = None
            disconnects.close()

    def _served(self) -> list[Link]:
        return [link for link in self.links.values() if not link.is_client and not link.closed]

    async def _sweep(self, disconnects: Disconnects, links: Callable[[], list[Link]]) -> None:
        """Ping ``links()`` after connections ended, and drop those whose peer is gone.  zmq may still take a send
        to a routing id whose connection is being torn down (seen on a loaded machine): the pings go again after
        growing pauses (:data:`DISCONNECT_PINGS_S`) before every peer is taken to be alive, and start over when
        more connections ended meanwhile.  A slow but living peer is never dropped: only failed sends count."""
        step = 0
        while step < len(DISCONNECT_PINGS_S):
            seen = disconnects.total
            served = links()
            for link in served:  # a vanished routing id fails the send at once (ROUTER_MANDATORY)
                link.channel.notify(Ping())
            await asyncio.sleep(DISCONNECT_PINGS_S[step])
            gone = [link for link in served if link.channel.closed is not None and not link.closed]
            for link in gone:
                await self.drop(link, LLMLinkError(
                    f"the connection of cluster {link.remote_cluster_id} broke: its process died, or it "
                    f"stopped answering heartbeats ({R.CONNECTION_LOST})", reason=R.CONNECTION_LOST))
            if disconnects.total != seen:
                step = 0
            elif gone:
                return
            else:
                step += 1

    def _check_admitted(self, link: Link, seen: int) -> None:
        """Server side: connections ended while ``link``'s HELLO was being answered (``seen``: how many had before),
        perhaps its own (a client that said hello and vanished): ping it as after any disconnect, so that a
        half-open link goes at once instead of holding a slot."""
        disconnects = self._disconnects
        if disconnects is not None and disconnects.total != seen:
            self._tasks.spawn(self._sweep(disconnects, lambda: [] if link.closed else [link]),
                              name=f"check-{link.remote_cluster_id}")

    async def _watch(self, link: Link) -> None:
        """Client side: a broken connection (the server died, closed it, or stopped answering heartbeats) drops
        the link at once, so that waiting requests fail fast with a link error instead of running into their
        deadline."""
        assert link.watch is not None
        event = await link.watch.failed
        if not link.closed:
            await self._connection_lost(link, describe_failure(event), R.HEARTBEAT_LOST)

    def _unreachable(self, link: Link, error: LLMException) -> None:
        """Server side: a frame to the link's client could not be delivered (its connection is gone)."""
        if not link.closed and not link.unlinking:
            self._tasks.spawn(self.drop(link, LLMLinkError(
                f"the connection of cluster {link.remote_cluster_id} is gone: {error} ({R.CONNECTION_LOST})",
                reason=R.CONNECTION_LOST)),
                name=f"drop-{link.remote_cluster_id}")

    async def _connection_lost(self, link: Link, what: str, alive: LinkDropReason) -> None:
        """A connection of ``link`` broke (``what``): drop the link, saying why.  It is unlisted at once (calls
        meanwhile wait until the reason is known: :meth:`not_linked`); a client then probes the server's address:
        refused, the peer is gone; else (``alive``) it stopped answering, or only that connection broke."""
        if link.closed:
            return
        cluster = link.remote_cluster_id
        reason = alive if link.is_client else R.CONNECTION_LOST
        error = LLMLinkError(f"the connection to cluster {cluster} broke: {what} ({reason})", reason=reason)
        if self.links.get(cluster) is not link:  # already unlisted: by another failure of it (probing why), or not
            if cluster not in self._settling:  # (else that failure's drop names the reason)
                await self.drop(link, error)
            return
        with self._tearing_down(cluster):
            del self.links[cluster]
            await self._settle(link, what, alive, error)

    async def _settle(self, link: Link, what: str, alive: LinkDropReason, error: LLMLinkError) -> None:
        """The rest of :meth:`_connection_lost`, once ``link`` is unlisted: why it dropped, then the drop."""
        cluster = link.remote_cluster_id
        settled = self._settling[cluster] = asyncio.get_running_loop().create_future()
        try:
            if link.is_client:
                reason, why = await self._probe_reason(link, alive)
                error = LLMLinkError(f"the connection to cluster {cluster} broke: {what}{why} ({reason})",
                                     reason=reason)
            elif alive != R.HEARTBEAT_LOST:
                error = LLMLinkError(f"the connection to cluster {cluster} broke: {what} ({alive})", reason=alive)
            if cluster not in self.links:  # (not linked again meanwhile)
                self._drops.record(cluster, error.reason or R.CONNECTION_LOST, str(error))
        finally:  # also when cancelled (finalize): the unlisted link is torn down all the same
            settled.set_result(None)
            if self._settling.get(cluster) is settled:
                del self._settling[cluster]
            await wait_through_cancellation(self.drop(link, error))

    @staticmethod
    async def _probe_reason(link: Link, alive: LinkDropReason) -> tuple[LinkDropReason, str]:
        """Client side: why its connection broke, from a TCP connect to the server's address: refused, the peer
        is gone; else ``alive``.  Returns the reason and what the probe found."""
        host, port = _split_endpoint(link.endpoint)
        found = await probe(host, port, PROBE_S)
        if found == "accepted":
            await asyncio.sleep(PROBE_AGAIN_S)
            found = await probe(host, port, PROBE_S)
        reason = R.PEER_GONE if found == "refused" else alive
        return reason, {"refused": ", and its address refuses connections: the process died or stopped listening",
                        "accepted": ", and its address still accepts connections",
                        "silent": ", and its address does not answer"}[found]

    def _unlist(self, link: Link, reason: LinkDropReason | None, detail: str) -> None:
        """Take ``link`` out of the link table (no new call uses it), remembering why (``reason``)."""
        if self.links.get(link.remote_cluster_id) is link:
            del self.links[link.remote_cluster_id]
            if reason is not None and reason != R.FINALIZED:
                self._drops.record(link.remote_cluster_id, reason, detail)

    async def drop(self, link: Link, error: LLMException) -> None:
        """Tear a link down locally: fail its requests, stop its copies, release its leases."""
        if link.closed:
            return
        link.closed = True
        with self._tearing_down(link.remote_cluster_id):
            self._unlist(link, error.reason if isinstance(error, LLMLinkError) else None, str(error))
            link.channel.close(error)
            if link.data_token is not None:
                self._data_tokens.pop(link.data_token, None)
            if link.fd_grant is not None:
                self._fd_grants.pop(link.fd_grant, None)
            try:
                await link.plane.stop(error)  # no thread touches memory any more before leases are released
                if link.offered is not None:  # (closing twice is harmless: the TCP plane closed it if it owned it)
                    await link.offered.aclose(error)
                if self.on_link_closed is not None:
                    await self.on_link_closed(link, error)
                await link.plane.close()
            finally:
                await self._close_sockets(link)
        log.info("cluster %d dropped link to %d: %s", self._cluster_id, link.remote_cluster_id, error)

    @contextlib.contextmanager
    def _tearing_down(self, cluster: int) -> Iterator[None]:
        """A link to ``cluster`` is being torn down for the body (:meth:`torn_down` waits for it)."""
        done = asyncio.get_running_loop().create_future()
        self._dropping.setdefault(cluster, set()).add(done)
        try:
            yield
        finally:
            done.set_result(None)
            dropping = self._dropping[cluster]
            dropping.discard(done)
            if not dropping:
                del self._dropping[cluster]

    async def torn_down(self, cluster: int) -> None:
        """Return once no link to ``cluster`` is being torn down (its sockets closed, its peer told)."""
        while cluster in self._dropping:
            await asyncio.shield(asyncio.gather(*self._dropping[cluster]))

    async def _close_sockets(self, link: Link) -> None:
        if link.routing_id is not None and self._server is not None:
            self._server.channels.pop(link.routing_id, None)
        if link.reader is not None:
            link.reader.cancel()
        if link.watch is not None:  # before any await (a cancellation below must not leave it open), and before
            link.watch.close()  # the socket (disabling the monitor needs it open)
        if link.sock is not None and not link.sock.closed:
            link.sock.close(linger=LINGER_MS)
        if link.watcher is not None and link.watcher is not asyncio.current_task():
            link.watcher.cancel()  # (not awaited: it may be what awaits this drop)

    # -- requests from peers ---------------------------------------------------------------------------------
    async def _handle(self, channel: Channel, message: dict[str, Any]) -> dict[str, Any] | None:
        link: Link = channel.context
        kind = message["k"]
        if kind == Kind.PING:
            return Ping().to_wire()  # an empty reply
        if kind == Kind.BYE:
            await channel.reply(message["i"], {})
            await self.drop(link, LLMLinkError(f"{R.UNLINKED_BY_PEER} (cluster {link.remote_cluster_id} called "
                                               "unlink_clusters, unlink or finalize)", reason=R.UNLINKED_BY_PEER))
            return None
        if kind == Kind.HELLO:
            raise LLMException("already linked", status_code=S.LLM_ALREADY_LINK)
        assert self.on_request is not None
        result: dict[str, Any] | None = await self.on_request(link, message)
        return result

    # -- lifetime --------------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Unlink everything (peers are told), stop listening and free the sockets and context."""
        for link in list(self.links.values()):
            try:
                link.channel.notify(Bye())
            except LLMException:
                pass
            await self.drop(link, LLMLinkError(f"cluster {self._cluster_id} was finalized", reason=R.FINALIZED))
        await self.stop_listening()
        try:
            await self._tasks.close()  # raises the background failures nobody handled, once every task ended
        finally:
            # term() waits for every socket of the context to be closed: close any that a torn-down link or
            # watcher left open (closing twice is harmless), here on the loop thread that owns them.
            for sock in list(getattr(self._ctx, "_sockets", ())):
                if not sock.closed:
                    log.debug("closing a socket left open at finalize: %r", sock)
                    sock.close(linger=LINGER_MS)
            # Closed sockets linger briefly so that the BYEs reach the peers; term() waits for that, off the loop.
            await in_thread(self._ctx.term)
            self._abandoned.detach()
            if self._fds is not None:
                self._fds.close()
            self._probe.close()

    def describe(self) -> list[dict[str, Any]]:
        return [link.describe() for link in self.links.values()]


async def _refusal_named(reply: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """A handshake reply; a server's refusal for want of the right key is an ``LLMLinkError`` with reason
    ``AUTH_FAILED``."""
    try:
        return await reply
    except LLMLinkError as exc:
        if str(exc) in (AUTH_FAILED, AUTH_REQUIRED):
            exc.reason = R.AUTH_FAILED
        raise
