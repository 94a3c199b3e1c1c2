"""The client side of one instance's links: linking to a server (its socket, the handshake, the data
connections it offers), and undoing an attempt that failed or was cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
from collections.abc import Awaitable
from typing import Any

import zmq

from .._aio import wait_through_cancellation
from ..control.channel import Channel
from ..control.loop_socket import LoopSocket
from ..control.monitor import ConnectionWatch, describe_failure
from ..control.sockets import LINGER_MS, connect_dealer, dealer_sender, read_dealer
from ..errors import LinkDropReason, LLMException, LLMLinkError, LLMStatusCode
from ..protocol import auth
from ..protocol.codec import ProtocolError
from ..protocol.handshake import (
    AUTH_FAILED,
    AUTH_REQUIRED,
    MAX_LINKS,
    Refused,
    answer_challenge,
    client_plane,
    data_connections,
    may_link,
)
from ..protocol.messages import FD_TOKEN_BYTES, Bye, HelloChallenge, HelloReply, is_challenge
from ..transport.same_host import probe_peer, probe_peer_fds
from ..transport.tcp.connect import connect_data
from ..transport.tcp.plane import Connections
from ..types import LLMClusterInfo, ip_int_to_str
from .link import Link, split_endpoint
from .side import LinkSide

__all__ = ["Dialer"]

R = LinkDropReason
S = LLMStatusCode

log = logging.getLogger("aiodatadist.link")


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


class Dialer(LinkSide):
    """Links to servers: one attempt per remote cluster at a time (``table.attempts``, joined by concurrent
    callers), each a DEALER socket watched from before it connects, the handshake, the data connections of a TCP
    link, and the link listed in ``table``."""

    async def link_one(self, cluster: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        """Link to ``cluster`` (``link_clusters`` of one cluster): its per-cluster code.  A call while a link to the
        same cluster id is being made joins that attempt and gets its code; a call when the link exists gets
        ``LLM_ALREADY_LINK``."""
        remote_id = cluster.remote_cluster_id
        assert remote_id is not None
        table = self._table
        await table.torn_down(remote_id)  # an old link to it is being dropped: its peer must not meet it still there
        if remote_id in table.attempts:
            return await table.attempts.join(remote_id, timeout_ms / 1000)
        status = may_link(remote_id, own_id=self._local.cluster_id, links=table.links, linking=table.attempts,
                          max_links=MAX_LINKS)
        if status != S.LLM_SUCCESS:
            return status
        return await table.attempts.start(remote_id, self._link(cluster, remote_id, timeout_ms))

    async def _link(self, cluster: LLMClusterInfo, remote_id: int, timeout_ms: int) -> LLMStatusCode:
        """One link attempt (run by :class:`~.attempts.LinkAttempts`); cancelled, it leaves no link, socket or task
        behind and tells the server to drop its end."""
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
        name = f"{self._local.cluster_id}->{remote_id}"

        def watch(sock: zmq.Socket[Any]) -> ConnectionWatch:
            return ConnectionWatch(sock, self._tasks.spawn, name)

        sock, connection = connect_dealer(self._ctx, endpoint, b"c" + secrets.token_bytes(15), self._settings.curve,
                                          remote_id, watch=watch)
        channel = Channel(dealer_sender(sock), self._table.handle, name, self._table.messages(remote_id))
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
            _abandon(client, bye=False, linger=not client.watch.failed.done())
            return self._failed(remote_id, client.endpoint, exc)
        chosen = self._planes.choose(reply.transport, caps)
        if isinstance(chosen, LLMException):
            log.info("link %d -> %d (%s) failed: %s", self._local.cluster_id, remote_id, client.endpoint, chosen)
            _abandon(client, bye=True)
            return chosen.status_code
        link = Link(remote_id, client.channel, is_client=True, endpoint=client.endpoint, remote_role=reply.role,
                    sock=client.sock, reader=client.reader, peer_serves_reads=reply.reads, watch=client.watch)
        kind = client_plane(chosen, reply.plane)
        if self._planes.uses_connections(kind):
            client.conns = self._planes.connections(link)
            error = await self._open_data(client.conns, split_endpoint(client.endpoint)[0], reply, nonces,
                                          deadline - asyncio.get_running_loop().time())
            if error is not None:
                log.info("link %d -> %d (%s): %s", self._local.cluster_id, remote_id, client.endpoint, error)
                _abandon(client, bye=True)
                await client.conns.aclose(LLMLinkError(error))
                return S.LLM_LINK_FAILED
        self._planes.set_plane(link, kind, caps, client.conns, reply.fdt)
        client.link = link
        return await self._register(link, reply, grant, deadline)

    async def _register(self, link: Link, reply: HelloReply, grant: bytes, deadline: float) -> LLMStatusCode:
        """The handshake is done: list the link, watch its connection, map the peer's caches."""
        remote_id = link.remote_cluster_id
        self._fds.grant(link, grant)
        link.channel.context = link
        self._table.add(link)
        link.watcher = self._tasks.spawn(self._table.watch(link), name=f"watch-{remote_id}")
        # Map the peer's caches now, and give their page tables the rest of the link timeout to fill in, so that
        # the first transfers do not pay for it (what is left continues in the background).
        populating = link.plane.adopt_announced(reply.directory, self._settings.directory, reply.segs)
        remaining = deadline - asyncio.get_running_loop().time()
        if populating and remaining > 0:
            await asyncio.wait(populating, timeout=remaining)
        if link.closed:  # it dropped meanwhile (the peer died or unlinked): calls name why
            return S.LLM_LINK_FAILED
        log.info("cluster %d linked to %d at %s (%s)", self._local.cluster_id, remote_id, link.endpoint,
                 link.plane.kind)
        return S.LLM_SUCCESS

    def _failed(self, remote_id: int, endpoint: str, exc: BaseException) -> LLMStatusCode:
        """The code of a handshake that failed with ``exc``; an authentication failure is remembered, so that a
        transfer to that cluster names it."""
        code = exc.status_code if isinstance(exc, LLMException) else S.LLM_LINK_FAILED
        why = str(exc) or "no answer in time (with CURVE: the server lacks it or holds another key)"
        log.info("link %d -> %d (%s) failed: %s", self._local.cluster_id, remote_id, endpoint, why)
        if isinstance(exc, LLMLinkError) and exc.reason == LinkDropReason.AUTH_FAILED:
            self._table.record_failure(remote_id, LinkDropReason.AUTH_FAILED, why)
        return code

    async def _undo_attempt(self, client: _Client) -> None:
        """A link attempt was cancelled: drop its link if it was listed, else close what it opened; either way the
        server is told to drop its end."""
        link = client.link
        if link is not None and self._table.links.get(link.remote_cluster_id) is link:
            with contextlib.suppress(LLMException):
                link.channel.notify(Bye())
            await self._table.drop(link, LLMLinkError(f"linking to cluster {link.remote_cluster_id} was cancelled"))
            return
        _abandon(client, bye=True)
        if client.conns is not None:
            await client.conns.aclose(LLMLinkError("linking was cancelled"))

    def _reader_failed(self, channel: Channel, error: BaseException) -> None:
        """A link's reader task failed (a bug: it survives any input): nothing more arrives on the link, so its
        requests would only run into their deadlines.  Drop the link, failing them at once."""
        log.error("the reader of %s failed", channel.name, exc_info=error)
        failure = LLMLinkError(f"the reader of link {channel.name} failed: {error!r}", reason=R.INTERNAL_ERROR)
        link = channel.context
        if isinstance(link, Link) and not link.closed:
            self._tasks.spawn(self._table.drop(link, failure), name=f"drop-{link.remote_cluster_id}")
        else:
            channel.close(failure)

    # -- the handshake and the data connections ----------------------------------------------------------------
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

    async def _handshake(self, channel: Channel, remote_id: int,
                         grant: bytes) -> tuple[dict[str, Any], tuple[bytes, bytes] | None]:
        """The client side of the handshake, with the challenge when either end has a key; returns the server's
        admission reply (to decode with ``HelloReply.from_wire``) and, for an authenticated link, the nonces."""
        client_nonce = auth.new_nonce()
        # (an authenticated link sends the grant in the second HELLO, once the server proved its key)
        hello = self._local.hello(remote_id, client_nonce, None if self._auth_key is not None else grant)
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
        """Open the data connections the server admits; returns what went wrong, or None."""
        offer = data_connections(reply, self._auth_key, nonces)
        if isinstance(offer, str):
            return offer
        return await connect_data(host, offer.port, offer.token, offer.count, timeout, conns.attach)


def _abandon(client: _Client, *, bye: bool, linger: bool = True) -> None:
    """Give up a link the handshake did not complete (``bye``: the server admitted us, or may have: let it drop
    its end; what is queued, the BYE too, still goes out as the socket lingers, unless not ``linger``: nobody is
    there to take it)."""
    if bye:
        with contextlib.suppress(LLMException):
            client.channel.notify(Bye())
    client.channel.close()
    client.reader.cancel()
    client.watch.close()
    client.sock.close(linger=LINGER_MS if linger else 0)


async def _refusal_named(reply: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """A handshake reply; a server's refusal for want of the right key is an ``LLMLinkError`` with reason
    ``AUTH_FAILED``."""
    try:
        return await reply
    except LLMLinkError as exc:
        if str(exc) in (AUTH_FAILED, AUTH_REQUIRED):
            exc.reason = R.AUTH_FAILED
        raise
