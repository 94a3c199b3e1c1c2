"""One link to a remote cluster: its control channel, its data plane, and what the link layer keeps for it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..control.channel import Channel
from ..control.loop_socket import LoopSocket
from ..control.monitor import ConnectionWatch
from ..transport.plane import DataPlane
from ..transport.tcp.plane import Connections

__all__ = ["Link", "split_endpoint"]


@dataclass(eq=False)
class Link:
    """One link to a remote cluster (client or server side): a control channel plus a data plane."""

    remote_cluster_id: int
    channel: Channel
    is_client: bool
    endpoint: str
    remote_role: int = 0
    plane: DataPlane = field(init=False)  # set once chosen (the factory's closures refer to the link)
    sock: LoopSocket | None = None
    reader: asyncio.Task[Any] | None = None
    watcher: asyncio.Task[Any] | None = None
    watch: ConnectionWatch | None = None  # client side: the first failure of its connection
    routing_id: bytes | None = None
    peer_serves_reads: bool = False  # the peer's native I/O threads serve one-sided reads and writes
    offered: Connections | None = None  # server side: the data connections offered, until the client opens them
    data_token: bytes | None = None  # server side: what the client's data connections present
    data_admits: int = 0  # server side: data connections still admitted with that token (then it is retired)
    fd_grant: bytes | None = None  # what the peer presents to this side's fd socket for this link's segments
    closed: bool = False
    unlinking: bool = False  # this side sent BYE: the peer closing the data connections is expected

    def describe(self) -> dict[str, Any]:
        """What ``LLMDataDist.links()`` shows of the link."""
        return {
            "remote_cluster_id": self.remote_cluster_id,
            "side": "client" if self.is_client else "server",
            "endpoint": self.endpoint,
            "plane": self.plane.kind,
            "peer": self.plane.caps.describe(),
            "data_connections": self.plane.connections,
            "data_congestion": self.plane.congestion,
            "device_path": self.plane.device_path,
            "staging": self.plane.staging(),
        }


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``(host, port)`` of a ``tcp://host:port`` endpoint."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)
