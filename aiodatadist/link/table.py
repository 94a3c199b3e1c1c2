"""The link table of one instance: its links by remote cluster id and those being made, how a link leaves it
(unlinked, dropped, its connection found dead, and why: :mod:`.drops`), and the requests its peer sends on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn

from .._aio import wait_through_cancellation
from ..control.channel import Channel, TaskSet
from ..control.monitor import Disconnects, describe_failure, probe
from ..control.sockets import LINGER_MS
from ..errors import LinkDropReason, LLMException, LLMLinkError, LLMStatusCode
from ..protocol.codec import Kind
from ..protocol.messages import Bye, Ping
from ..stats import MessageCounter
from .attempts import LinkAttempts
from .drops import DropLog
from .link import Link, split_endpoint

__all__ = ["ClosedHook", "LinkTable", "Release", "RequestHook"]

DISCONNECT_PINGS_S = (0.05, 0.25, 1.0)  # after a client connection broke: ping the server's links, then wait
PROBE_S = 0.25  # a client's connection broke: how long a TCP connect to the server's address may take
PROBE_AGAIN_S = 0.02  # ... and, accepted, when to try once more (a dying process closes its listener last)
R = LinkDropReason
S = LLMStatusCode

log = logging.getLogger("aiodatadist.link")

RequestHook = Callable[[Link, dict[str, Any]], Awaitable["dict[str, Any] | None"]]
"""Serves a peer's transfer request on a link; returns the reply body (None: answered later, or never)."""
ClosedHook = Callable[[Link, LLMException], Awaitable[None]]
"""Told when a link is torn down, after its data plane stopped, before its peer memory is let go."""
Release = Callable[[Link], None]
"""Lets go of what the link's side handed out for it (its tokens, grants and server route), as it is torn down."""


class LinkTable:
    """The links of one instance (:attr:`links`, by remote cluster id) and the link attempts in progress
    (:attr:`attempts`), from the moment a handshake lists a link until it is torn down.

    ``tasks``: the instance's background tasks; ``release``: see :data:`Release`.  The hooks
    :attr:`on_request` and :attr:`on_link_closed` are set once by the transfer layer."""

    def __init__(self, cluster_id: int, tasks: TaskSet, release: Release,
                 messages: Callable[[int], MessageCounter]) -> None:
        self._cluster_id = cluster_id
        self.messages = messages  # a remote cluster's control-message counter (for the channels of its links)
        self._tasks = tasks
        self._release = release
        self.links: dict[int, Link] = {}
        self.attempts = LinkAttempts(tasks.spawn, self._unlink_undone)  # links being made, by cluster id
        self._drops = DropLog()  # why recent links went away, by cluster id
        self._settling: dict[int, asyncio.Future[None]] = {}  # links unlisted, being dropped once it is known why
        self._dropping: dict[int, set[asyncio.Future[None]]] = {}  # links being torn down, by cluster id
        self.on_request: RequestHook | None = None
        self.on_link_closed: ClosedHook | None = None

    def add(self, link: Link) -> None:
        """List ``link``, whose handshake is done: calls to its cluster use it from now on."""
        self.links[link.remote_cluster_id] = link
        self._drops.forget(link.remote_cluster_id)

    def record_failure(self, cluster: int, reason: LinkDropReason, detail: str) -> None:
        """A link attempt to ``cluster`` failed for ``reason``: calls to it name that until it is linked."""
        self._drops.record(cluster, reason, detail)

    def describe(self) -> list[dict[str, Any]]:
        """What ``LLMDataDist.links()`` shows: each link's :meth:`Link.describe`."""
        return [link.describe() for link in self.links.values()]

    # -- calls to a cluster ------------------------------------------------------------------------------------
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
        if not await self.alive(link, timeout):
            raise LLMException(f"cluster {remote_id} did not answer within {timeout:g} s",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)

    @staticmethod
    async def alive(link: Link, timeout: float = 0.5) -> bool:
        """Whether ``link``'s peer answers a ping within ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await link.channel.request(Ping())
            return True
        except (LLMException, TimeoutError):
            return False

    # -- unlinking and drops -----------------------------------------------------------------------------------
    async def unlink_one(self, remote_id: int, timeout_ms: int, force: bool) -> LLMStatusCode:
        """Unlink ``remote_id`` (``unlink_clusters`` of one cluster): tell the peer (``force``: without waiting for
        its answer, else for at most ``timeout_ms``), then drop the link; its per-cluster code."""
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

    async def _unlink_undone(self, remote_id: int) -> None:
        """Every caller of a link attempt was cancelled as it succeeded: unlink it (the peer is told)."""
        await self.unlink_one(remote_id, 0, force=True)

    async def close_all(self) -> None:
        """Drop every link, telling each peer (at finalize)."""
        for link in list(self.links.values()):
            try:
                link.channel.notify(Bye())
            except LLMException:
                pass
            await self.drop(link, LLMLinkError(f"cluster {self._cluster_id} was finalized", reason=R.FINALIZED))

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
            try:
                await link.plane.stop(error)  # no thread touches memory any more before leases are released
                if link.offered is not None:  # (closing twice is harmless: the TCP plane closed it if it owned it)
                    await link.offered.aclose(error)
                if self.on_link_closed is not None:
                    await self.on_link_closed(link, error)
                await link.plane.close()
            finally:
                self._close_sockets(link)
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

    def _close_sockets(self, link: Link) -> None:
        # (a closed link's tokens and grants open nothing before this: their holders check ``link.closed``)
        self._release(link)
        if link.reader is not None:
            link.reader.cancel()
        if link.watch is not None:  # before any await (a cancellation below must not leave it open), and before
            link.watch.close()  # the socket (disabling the monitor needs it open)
        if link.sock is not None and not link.sock.closed:
            link.sock.close(linger=LINGER_MS)
        if link.watcher is not None and link.watcher is not asyncio.current_task():
            link.watcher.cancel()  # (not awaited: it may be what awaits this drop)

    # -- liveness ----------------------------------------------------------------------------------------------
    def served(self) -> list[Link]:
        """The live links this instance's server admitted."""
        return [link for link in self.links.values() if not link.is_client and not link.closed]

    async def sweep(self, disconnects: Disconnects, links: Callable[[], list[Link]]) -> None:
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

    async def watch(self, link: Link) -> None:
        """Client side: a broken connection (the server died, closed it, or stopped answering heartbeats) drops
        the link at once, so that waiting requests fail fast with a link error instead of running into their
        deadline."""
        assert link.watch is not None
        event = await link.watch.failed
        if not link.closed:
            await self.connection_lost(link, describe_failure(event), R.HEARTBEAT_LOST)

    def unreachable(self, link: Link, error: LLMException) -> None:
        """Server side: a frame to the link's client could not be delivered (its connection is gone)."""
        if not link.closed and not link.unlinking:
            self._tasks.spawn(self.drop(link, LLMLinkError(
                f"the connection of cluster {link.remote_cluster_id} is gone: {error} ({R.CONNECTION_LOST})",
                reason=R.CONNECTION_LOST)),
                name=f"drop-{link.remote_cluster_id}")

    async def connection_lost(self, link: Link, what: str, alive: LinkDropReason) -> None:
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
        """The rest of :meth:`connection_lost`, once ``link`` is unlisted: why it dropped, then the drop."""
        cluster = link.remote_cluster_id
        settled = self._settling[cluster] = asyncio.get_running_loop().create_future()
        try:
            if link.is_client:
                reason, why = await _probe_reason(link, alive)
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

    # -- requests from peers -----------------------------------------------------------------------------------
    async def handle(self, channel: Channel, message: dict[str, Any]) -> dict[str, Any] | None:
        """Serve a request the peer sent on a link's channel: pings and BYE here, transfers by :attr:`on_request`."""
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


async def _probe_reason(link: Link, alive: LinkDropReason) -> tuple[LinkDropReason, str]:
    """Client side: why its connection broke, from a TCP connect to the server's address: refused, the peer
    is gone; else ``alive``.  Returns the reason and what the probe found."""
    host, port = split_endpoint(link.endpoint)
    found = await probe(host, port, PROBE_S)
    if found == "accepted":
        await asyncio.sleep(PROBE_AGAIN_S)
        found = await probe(host, port, PROBE_S)
    reason = R.PEER_GONE if found == "refused" else alive
    return reason, {"refused": ", and its address refuses connections: the process died or stopped listening",
                    "accepted": ", and its address still accepts connections",
                    "silent": ", and its address does not answer"}[found]
