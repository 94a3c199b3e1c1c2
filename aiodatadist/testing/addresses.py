"""The loopback helpers of test suites: :func:`cluster_info` (``aiodatadist.cluster_info_for`` on 127.0.0.1),
free ports and fresh cluster ids."""

from __future__ import annotations

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
    """A TCP port that is free on 127.0.0.1 right now (it may be taken before you bind it: where you can, bind
    port 0 and read the port bound, as ``PeerProcess.init`` and ``PromptServer`` do)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Random per process (several test processes may link to each other), then counting.
_ids = itertools.count(random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little")).randrange(1 << 40,
                                                                                                    1 << 48))


def new_cluster_id() -> int:
    """A cluster id not used before in this process, and very unlikely to be used by another one."""
    return next(_ids)
