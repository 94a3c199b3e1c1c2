"""The plane factory: the one place that turns the handshake's choice into a link's :class:`DataPlane`.

Adding a plane is one class in :mod:`aiodatadist.transport` plus one branch here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..errors import LLMException
from ..protocol.messages import Plane
from ..transport.nixl_link import NixlAgentCaches, NixlLinkPlane
from ..transport.plane import Copies, DataPlane, OnUntrusted
from ..transport.same_host import PeerCapabilities
from ..transport.same_host_plane import SameHostPlane
from ..transport.tcp.native_connections import NativeConnections
from ..transport.tcp.plane import Connections, NativeTcpPlane, TcpPlane
from ..transport.tcp.python_connections import PythonConnections
from ..transport.tcp.staging import DeviceStaging

__all__ = ["PlaneFactory"]


class PlaneFactory:
    """Builds the data planes of one instance's links.

    ``copies``: the instance's copy engine (same-host copies); ``nixl``: its NIXL agent's caches; ``native_net``:
    TCP links use the native helper's I/O threads; ``directory``: ``(address, rows)`` of this instance's cache
    directory, which those threads check one-sided reads and writes against; ``device_staging``: TCP links move
    device caches staged through page-locked memory (``llm.DeviceStaging``), else refuse them; ``on_staged``:
    called when a link sets up a staging ring."""

    def __init__(self, cluster_id: int, copies: Copies, nixl: NixlAgentCaches, native_net: bool,
                 directory: tuple[int, int] | None, device_staging: bool = True,
                 on_staged: Callable[[], None] = lambda: None) -> None:
        self._cluster_id = cluster_id
        self._copies = copies
        self._staging = DeviceStaging(device_staging, lambda: copies.device().runtime, on_staged)
        self._nixl = nixl
        self.native_net = native_net
        self._directory = directory

    @staticmethod
    def needs_nixl(kind: Plane) -> bool:
        """The plane runs on this instance's NIXL agent (started before the link is admitted)."""
        return kind == "nixl"

    @staticmethod
    def offers_connections(kind: Plane) -> bool:
        """A server offers data connections on a link of this plane (its client may still choose TCP)."""
        return kind != "nixl"

    @staticmethod
    def uses_connections(kind: Plane) -> bool:
        """The plane moves bytes on the link's data connections."""
        return kind == "tcp"

    def connections(self, peer: int, on_broken: Callable[[LLMException], None]) -> Connections:
        """A link's (empty) set of data connections; ``on_broken``: one of them failed."""
        name, loop = f"{self._cluster_id}-{peer}", asyncio.get_running_loop()
        if not self.native_net:
            return PythonConnections(name, loop, on_broken)
        return NativeConnections(name, loop, on_broken, self._directory)

    def plane(self, kind: Plane, peer: int, caps: PeerCapabilities, on_untrusted: OnUntrusted, *,
              conns: Connections | None = None, fd_token: bytes | None = None,
              peer_serves_reads: bool = False) -> DataPlane:
        """The plane the handshake chose (``kind``) for the link to cluster ``peer``."""
        name = f"{self._cluster_id}-{peer}"
        if kind == "nixl":
            return NixlLinkPlane(peer, name, caps, on_untrusted, self._nixl)
        if kind == "tcp":
            assert conns is not None
            if peer_serves_reads and conns.serves_reads:  # both ends run the native helper's I/O threads
                assert isinstance(conns, NativeConnections)
                return NativeTcpPlane(peer, name, caps, on_untrusted, conns, self._staging)
            return TcpPlane(peer, name, caps, on_untrusted, conns, self._staging)
        return SameHostPlane(peer, name, caps, on_untrusted, self._copies, fd_token)
