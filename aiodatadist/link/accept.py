"""The server side of one instance's links: its listening sockets, the HELLOs it answers, and the data
connections that join the links it admitted."""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import socket
import time
from typing import Any

import zmq

from .._aio import wait_through_cancellation
from .._log_limits import LimitedWarning
from ..control.channel import Channel, TaskSet
from ..control.monitor import Disconnects
from ..control.sockets import Context, Server
from ..errors import LinkDropReason, LLMException, LLMLinkError, LLMStatusCode
from ..protocol import auth
from ..protocol.codec import ProtocolError
from ..protocol.handshake import AUTH_FAILED, MAX_LINKS, Refused, admit, authenticate
from ..protocol.messages import FD_TOKEN_BYTES, DataOffer, Hello, HelloChallenge, Plane, reply_to_wire
from ..settings.options import Settings
from ..transport.same_host import PeerCapabilities, probe_peer, probe_peer_fds
from ..transport.tcp.connect import accept_data, data_listener
from .fd_socket import FdSocket
from .link import Link, split_endpoint
from .local_end import LocalEnd
from .plane_setup import PlaneSetup
from .side import LinkSide
from .table import LinkTable

__all__ = ["Acceptor"]

R = LinkDropReason
S = LLMStatusCode

log = logging.getLogger("aiodatadist.link")
_at_link_limit = LimitedWarning(log)
_challenges_full = LimitedWarning(log)


class Acceptor(LinkSide):
    """Listens for links: the server socket (ROUTER) and the data listener, HELLOs answered (the challenge when
    this instance has a key, admission, the plane), the admitted links listed in ``table``, and connections that
    end watched so that a link whose client vanished goes at once."""

    def __init__(self, local: LocalEnd, settings: Settings, auth_key: bytes | None, ctx: Context, tasks: TaskSet,
                 table: LinkTable, planes: PlaneSetup, fds: FdSocket) -> None:
        super().__init__(local, settings, auth_key, ctx, tasks, table, planes, fds)
        self._server: Server | None = None
        self._server_task: asyncio.Task[Any] | None = None
        self._server_watch: asyncio.Task[Any] | None = None
        self._disconnects: Disconnects | None = None  # the server's ended connections, counted
        self._accept_task: asyncio.Task[Any] | None = None
        self.data_listener: socket.socket | None = None  # where the clients of TCP links open data connections
        self._data_tokens: dict[bytes, Link] = {}
        self.challenges = auth.ChallengeTable()  # authentication challenges pending, by routing id

    # -- listening ---------------------------------------------------------------------------------------------
    @property
    def listening(self) -> str | None:
        """The bound endpoint (``tcp://ip:port``, the real port when asked for port 0), or None."""
        return self._server.endpoint if self._server is not None else None

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(ip, port)`` of the bound server socket (the real port when asked for port 0), or None."""
        return split_endpoint(self._server.endpoint) if self._server is not None else None

    async def listen(self, ip: str, port: int) -> None:
        """Listen on ``ip:port`` (replacing the current address; the same address is kept as it is)."""
        endpoint = f"tcp://{ip}:{port}"
        if self._server is not None and self._server.requested == endpoint:
            return
        old = self._server.endpoint if self._server is not None else None
        if old is not None and split_endpoint(old)[1] == port:
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
        self.data_listener = listener
        self._accept_task = self._tasks.spawn(
            accept_data(listener, self._adopt_data, functools.partial(self._tasks.spawn, name="adopt-data")),
            name=f"data-{endpoint}")
        log.info("cluster %d listening on %s", self._local.cluster_id, server.endpoint)

    async def stop_listening(self) -> None:
        """Stop serving: the server's tasks end before its sockets close.  A socket's descriptor number names what
        the event loop registered for it (its reader), and a server listening again at once may get the same
        numbers: nothing of the old one may be left then."""
        server, listener = self._server, self.data_listener
        tasks = [task for task in (self._server_watch, self._server_task, self._accept_task) if task is not None]
        self._server = self._server_task = self._server_watch = self._accept_task = None
        self.data_listener = None
        for task in tasks:
            task.cancel()
        await wait_through_cancellation(asyncio.gather(*tasks, return_exceptions=True))
        if listener is not None:
            listener.close()
        if server is not None:
            server.close()

    def release(self, link: Link) -> None:
        """``link`` is being torn down: its data token admits nobody, its routing id reaches no channel."""
        if link.data_token is not None:
            self._data_tokens.pop(link.data_token, None)
        if link.routing_id is not None and self._server is not None:
            self._server.channels.pop(link.routing_id, None)

    # -- the handshake -----------------------------------------------------------------------------------------
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
        table = self._table
        stale = table.links.get(cluster)
        if stale is not None and not stale.is_client and not await table.alive(stale):
            # The peer restarted (or its old connection died): its old link must not block the new one.
            await table.drop(stale, LLMLinkError(f"cluster {cluster} reconnected; its old link was dead",
                                                 reason=R.CONNECTION_LOST))
        code, msg = admit(hello.version, cluster, hello.target, own_id=self._local.cluster_id, links=table.links,
                          linking=table.attempts, max_links=MAX_LINKS)
        if code == 0:
            caps = await probe_peer_fds(hello.host, probe_peer(hello.host))
            chosen = self._planes.choose(hello.transport, caps)
            if isinstance(chosen, LLMException):
                code, msg = int(chosen.status_code), str(chosen)
            else:
                await self._accept(server, routing_id, req_id, hello, nonces, caps, chosen)
                link = table.links.get(cluster)
                if link is not None:
                    self._check_admitted(link, seen)
                return
        if code == S.LLM_CLUSTER_NUM_EXCEED_LIMIT:
            _at_link_limit("cluster %d refused a link from cluster %d: it has %d links, the most it admits "
                           "(without llm.AuthKey any client that says hello is a link)", self._local.cluster_id,
                           cluster, MAX_LINKS)
        server.reply_raw(routing_id, reply_to_wire(req_id, code=code, msg=msg))

    async def _accept(self, server: Server, routing_id: bytes, req_id: Any, hello: Hello,
                      nonces: tuple[bytes, bytes] | None, caps: PeerCapabilities, plane: Plane) -> None:
        """Admit the link (the handshake agreed on ``plane``) and answer the HELLO."""
        cluster = hello.cluster
        channel = Channel(server.sender(routing_id), self._table.handle, f"{self._local.cluster_id}<-{cluster}",
                          self._table.messages(cluster))
        link = Link(cluster, channel, is_client=False, endpoint=server.endpoint, remote_role=hello.role,
                    routing_id=routing_id)
        channel.context = link
        channel.on_failed = functools.partial(self._table.unreachable, link)
        data, dconns = None, None
        if self.data_listener is not None and self._planes.offers_connections(plane):  # the client may choose TCP
            port = self.data_listener.getsockname()[1]
            if nonces is not None and self._auth_key is not None:  # derived on both ends, never sent
                link.data_token = auth.data_token(self._auth_key, *nonces)
            else:
                link.data_token = secrets.token_bytes(16)
            data = DataOffer(port, None if nonces is not None else link.data_token)
            self._data_tokens[link.data_token] = link
            link.data_admits = dconns = self._settings.tcp_connections
            link.offered = self._planes.connections(link)
        link.peer_serves_reads = hello.reads
        self._planes.set_plane(link, plane, caps, link.offered, hello.fdt)
        grant = secrets.token_bytes(FD_TOKEN_BYTES)
        self._fds.grant(link, grant)
        self._table.add(link)
        server.channels[routing_id] = channel
        await channel.reply(req_id, self._local.reply(plane, data, dconns, grant).to_wire())
        # In the background: nobody waits for the peer's segments to be mapped here.
        link.plane.adopt_announced(hello.directory, self._settings.directory, hello.segs)
        log.info("cluster %d accepted link from %d (%s)", self._local.cluster_id, cluster, link.plane.kind)

    async def _authenticate(self, server: Server, routing_id: bytes, req_id: Any,
                            hello: Hello) -> tuple[bytes, bytes] | None:
        """The server side of the challenge (see :mod:`aiodatadist.protocol.auth`): the nonces once the client
        proved it holds the key; None after answering with a challenge or a refusal."""
        assert self._auth_key is not None
        outcome = authenticate(self._auth_key, self.challenges, routing_id, hello, self._local.cluster_id,
                               time.monotonic())
        if isinstance(outcome, HelloChallenge):
            if len(self.challenges) >= auth.MAX_PENDING:
                _challenges_full("cluster %d has %d authentication challenges pending, the most it keeps: a HELLO "
                                 "flood? (each new one replaces the oldest)", self._local.cluster_id,
                                 auth.MAX_PENDING)
            server.reply_raw(routing_id, outcome.reply_to_wire(req_id))
            return None
        if isinstance(outcome, Refused):
            if outcome.msg == AUTH_FAILED:
                log.warning("cluster %d refused a link from cluster %d: authentication failed",
                            self._local.cluster_id, hello.cluster)
            server.reply_raw(routing_id, reply_to_wire(req_id, code=outcome.code, msg=outcome.msg))
            return None
        return outcome

    async def _adopt_data(self, conn: socket.socket, token: bytes) -> None:
        """A data connection that presents a link's token joins that link."""
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
            self._planes.set_plane(link, "tcp", before.caps, link.offered, None)
            await before.stop(LLMLinkError("the link moved to TCP"))
            await before.close()
        link.offered.attach(conn)

    # -- clients that vanish -----------------------------------------------------------------------------------
    async def _watch_server(self, server: Server) -> None:
        """When client connections break, find which links lost their peer (a PING to a vanished routing id fails
        at once) and drop them, so that their transfers fail fast instead of timing out.  Every connection that
        ends is counted at once, however many end (port scanners, probes, clients that never say hello): one
        round of pings serves all that ended before it."""
        disconnects = self._disconnects = Disconnects(server.sock.raw, self._tasks.spawn, server.endpoint)
        seen = 0
        try:
            while True:
                await disconnects.after(seen)
                seen = disconnects.total
                await self._table.sweep(disconnects, self._table.served)
        finally:
            if self._disconnects is disconnects:
                self._disconnects = None
            disconnects.close()

    def _check_admitted(self, link: Link, seen: int) -> None:
        """Connections ended while ``link``'s HELLO was being answered (``seen``: how many had before), perhaps
        its own (a client that said hello and vanished): ping it as after any disconnect, so that a half-open link
        goes at once instead of holding a slot."""
        disconnects = self._disconnects
        if disconnects is not None and disconnects.total != seen:
            self._tasks.spawn(self._table.sweep(disconnects, lambda: [] if link.closed else [link]),
                              name=f"check-{link.remote_cluster_id}")
