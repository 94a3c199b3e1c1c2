"""How long a queue the kernel keeps for a listening socket: the control port and the data listener share it."""

from __future__ import annotations

from typing import Final

__all__ = ["LISTEN_BACKLOG"]

LISTEN_BACKLOG: Final = 4096
"""Connections the kernel queues for a listening socket before it drops SYNs (it caps the figure at
``net.core.somaxconn``).  ZeroMQ's default of 100 overflows under a burst of connections (health checks, scanners,
a HELLO flood), and each dropped SYN costs a legitimate client the kernel's retransmission timeout: 1 s, then 3 s,
then 7 s."""
