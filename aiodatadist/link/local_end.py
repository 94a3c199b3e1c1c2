"""This instance as both sides of its handshakes describe it to a peer: who it is and what it announces."""

from __future__ import annotations

from typing import Protocol

from ..protocol.handshake import PROTOCOL_VERSION
from ..protocol.identity import SegmentIdentity
from ..protocol.messages import DataOffer, Hello, HelloReply, Plane
from ..transport.same_host import HostProbe
from ..types import LLMRole, Transport

__all__ = ["LocalEnd", "Publications"]


class Publications(Protocol):
    """What this instance announces to its peers at link time (its cache registry)."""

    def announced_segments(self) -> tuple[tuple[SegmentIdentity, int], ...]:
        """The shared segments of its remote-accessible caches, with their addresses here."""
        ...

    def directory_identity(self) -> SegmentIdentity | None:
        """Its cache directory's segment, if any."""
        ...

    def device_identity(self) -> tuple[str, int] | None:
        """This process's device runtime and the PID its IPC imports present, once it opened one."""
        ...

    def shared_fd(self, inode: int, device: int) -> int | None:
        """The memfd of a remote-accessible cache's segment ``(inode, device)``, or None."""
        ...


class LocalEnd:
    """This end of every link: its cluster id, its role (``switch_role`` sets :attr:`role`), its transport
    setting, its host and the caches it announces, as the client's HELLO and the server's reply carry them.

    ``native_net``: TCP links use the native helper's I/O threads here, so this end serves one-sided reads."""

    def __init__(self, cluster_id: int, role: LLMRole, transport: Transport, probe: HostProbe,
                 publications: Publications, native_net: bool) -> None:
        self.cluster_id = cluster_id
        self.role = role
        self.transport = transport
        self._probe = probe
        self._publications = publications
        self.native_net = native_net

    def hello(self, remote_cluster_id: int, client_nonce: bytes, grant: bytes | None) -> Hello:
        """The first HELLO of a link to ``remote_cluster_id`` (``grant``: this side's fd socket token for the
        server, or None: an authenticated link sends it in the second HELLO, once the server proved its key)."""
        return Hello(PROTOCOL_VERSION, self.cluster_id, remote_cluster_id, int(self.role), self.transport,
                     self._probe.info(), self._publications.announced_segments(),
                     self._publications.directory_identity(), self.native_net, cn=client_nonce, fdt=grant,
                     dev=self._publications.device_identity())

    def reply(self, plane: Plane, data: DataOffer | None, dconns: int | None, grant: bytes) -> HelloReply:
        """The server's answer admitting a link on ``plane`` (``data``, ``dconns``: its offer of data connections;
        ``grant``: this side's fd socket token for the client)."""
        return HelloReply(self.cluster_id, int(self.role), self._probe.info(), self.transport,
                          self._publications.announced_segments(), self._publications.directory_identity(), plane,
                          self.native_net, data, dconns, grant,
                          self._publications.device_identity())
