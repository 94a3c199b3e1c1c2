"""The loopback helpers of test suites: :func:`cluster_info` (``aiodatadist.cluster_info_for`` on 127.0.0.1),
free ports and fresh cluster ids."""

from __future__ import annotations

import collections
import itertools
import os
import random
import socket

from ..types import LLMClusterInfo, cluster_info_for

__all__ = ["cluster_info", "cluster_info_for", "free_port", "new_cluster_id"]


def cluster_info(remote_cluster_id: int, port: int, ip: str = "127.0.0.1") -> LLMClusterInfo:
    """An ``LLMClusterInfo`` for a server listening on ``ip:port`` (loopback by default); see
    :func:`cluster_info_for`."""
    return cluster_info_for(remote_cluster_id, ip, port)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now, chosen below the kernel's ephemeral range.

    A port from ``bind(("127.0.0.1", 0))`` lies in the ephemeral range, where any outgoing connection or any
    other ``bind(0)`` of the machine may take it before the caller binds it (a test suite's peers open both all
    the time); below that range only an explicit bind can. Where you can, still bind port 0 and read the port
    bound, as ``PeerProcess.init`` and ``PromptServer`` do."""
    low = _ephemeral_low()
    if low > _FIRST_PORT + 1024:
        for _ in range(64):
            port = _picks.randrange(_FIRST_PORT, low)
            if port not in _given and _bindable(port):
                _given.append(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_FIRST_PORT = 10000
_picks = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
_given: collections.deque[int] = collections.deque(maxlen=256)  # handed out lately: maybe not bound yet


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152  # IANA's dynamic range, used by macOS and Windows


def _bindable(port: int) -> bool:
    with socket.socket() as s:  # no SO_REUSEADDR: a port with a socket in TIME_WAIT is refused too
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# Random per process (several test processes may link to each other), then counting.
_ids = itertools.count(random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little")).randrange(1 << 40,
                                                                                                    1 << 48))


def new_cluster_id() -> int:
    """A cluster id not used before in this process, and very unlikely to be used by another one."""
    return next(_ids)
