"""A link's data plane as both sides of the handshake set it up: chosen with the peer, built by the
:class:`~.planes.PlaneFactory`, and wired to drop the link when the plane or its data connections fail."""

from __future__ import annotations

from collections.abc import Callable

from ..control.channel import TaskSet
from ..errors import LinkDropReason, LLMException, LLMLinkError, LLMStatusCode
from ..protocol.handshake import choose_plane, plane_refusal
from ..protocol.messages import Plane
from ..transport.same_host import PeerCapabilities
from ..transport.tcp.plane import Connections
from ..types import Transport
from .link import Link
from .planes import PlaneFactory
from .table import LinkTable

__all__ = ["PlaneSetup"]

R = LinkDropReason
S = LLMStatusCode


class PlaneSetup:
    """Chooses and builds the data planes of one instance's links.

    ``transport``: this instance's transport setting; ``start_nixl`` starts its NIXL plane (raises
    ``LLMException``) for a link that chose it, None where there is none; a failure drops the link from
    ``table`` (in a task of ``tasks`` where it is reported outside a coroutine)."""

    def __init__(self, transport: Transport, factory: PlaneFactory, start_nixl: Callable[[], object] | None,
                 table: LinkTable, tasks: TaskSet) -> None:
        self._transport = transport
        self._factory = factory
        self._start_nixl_plane = start_nixl
        self._table = table
        self._tasks = tasks

    def choose(self, peer_transport: Transport, caps: PeerCapabilities) -> Plane | LLMException:
        """The plane of a link with a peer set to ``peer_transport``, or why there is none."""
        plane = choose_plane(self._transport, peer_transport, caps.same_host)
        if plane is None:
            return LLMException(plane_refusal(self._transport, peer_transport), status_code=S.LLM_LINK_FAILED)
        refusal = self._start_nixl() if self._factory.needs_nixl(plane) else None
        return refusal if refusal is not None else plane

    def _start_nixl(self) -> LLMException | None:
        """Start this instance's NIXL plane for a link that chose it; the reason it cannot, or None."""
        if self._start_nixl_plane is None:
            return LLMException("this instance has no NIXL support", status_code=S.LLM_FEATURE_NOT_ENABLED)
        try:
            self._start_nixl_plane()
        except LLMException as exc:
            return exc
        return None

    @staticmethod
    def offers_connections(kind: Plane) -> bool:
        """A server offers data connections on a link of this plane (its client may still choose TCP)."""
        return PlaneFactory.offers_connections(kind)

    @staticmethod
    def uses_connections(kind: Plane) -> bool:
        """The plane moves bytes on the link's data connections."""
        return PlaneFactory.uses_connections(kind)

    def set_plane(self, link: Link, kind: Plane, caps: PeerCapabilities, conns: Connections | None,
                  fd_token: bytes | None) -> None:
        """Give ``link`` the plane ``kind`` (on ``conns``, its data connections, for TCP); a peer that breaks
        the plane's rules drops the link."""
        async def untrusted(error: LLMException) -> None:
            if isinstance(error, LLMLinkError) and error.reason is None:
                error.reason = R.PROTOCOL_ERROR
            await self._table.drop(link, error)

        link.plane = self._factory.plane(kind, link.remote_cluster_id, caps, untrusted, conns=conns,
                                         fd_token=fd_token, peer_serves_reads=link.peer_serves_reads)

    def connections(self, link: Link) -> Connections:
        """A link's data connections: a failure drops the link."""
        def broken(error: LLMException) -> None:
            # A peer answering our BYE closes its data connections: that end is expected, the BYE's reply is not
            # lost because of it (the unlink drops the link itself).
            if not link.closed and not link.unlinking:
                if isinstance(error, LLMLinkError) and error.reason is None:
                    error.reason = R.DATA_CONNECTION_LOST  # (its transfers raise it now: the probe comes later)
                self._tasks.spawn(self._table.connection_lost(link, str(error), R.DATA_CONNECTION_LOST),
                                  name=f"drop-{link.remote_cluster_id}")

        return self._factory.connections(link.remote_cluster_id, broken)
