"""The congestion control of a TCP data connection (``AIODATADIST_TCP_CONGESTION``).

BBR paces every send: without a pacing qdisc the kernel spaces a connection's segments by hrtimer at the rate
BBR has estimated, and its estimate for a connection that moved a few bursts (a KV transfer is bursts) is far
below what loopback does.  On a 2-vCPU VM whose default is ``bbr``, a data connection between two processes of
one host ran a 256 MiB paged pull at 4.6-4.7 GB/s with BBR and 6.2-6.7 with CUBIC, and an 8192-span pull at
344-350 us against 257-293.  Pacing only helps where a bottleneck queue sits between the ends, which a
connection to this host does not have; across hosts the machine's own choice stands, since whoever set it knew
their network.

* ``auto`` (default): a connection to this host (loopback, or the host's own address) whose algorithm paces
  (``bbr*``) is switched to ``cubic``, or ``reno`` where the kernel refuses ``cubic`` to this process (only the
  algorithms in ``net.ipv4.tcp_allowed_congestion_control`` are open to unprivileged processes; ``reno`` always
  is); any other connection keeps the system's algorithm.
* ``system``: every connection keeps the system's algorithm.
* an algorithm's name (``cubic``, ``dctcp``, ...): every data connection, to this host or not, uses it; where the
  kernel refuses it, the connection keeps its algorithm and a warning is logged once.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

from ...settings.environment import env_knobs

__all__ = ["UNPACED", "congestion_in_use", "congestion_of", "is_this_host", "tune_congestion"]

log = logging.getLogger("aiodatadist.transport")

UNPACED = ("cubic", "reno")
"""What ``auto`` switches a pacing connection to, in order of preference."""

_NAME_MAX = 16  # TCP_CA_NAME_MAX
_warned: set[str] = set()


def congestion_of(sock: socket.socket) -> str:
    """The congestion control algorithm ``sock`` uses."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, _NAME_MAX)
    return raw.split(b"\0", 1)[0].decode("ascii", "replace")


def congestion_in_use(sock: socket.socket) -> str | None:
    """What ``sock`` uses, or None where that cannot be read (no ``TCP_CONGESTION`` here, a closed socket)."""
    try:
        return congestion_of(sock) if hasattr(socket, "TCP_CONGESTION") else None
    except OSError:
        return None


def is_this_host(sock: socket.socket) -> bool:
    """Whether a connected socket's peer is this host: a loopback address, or the socket's own address."""
    try:
        peer, local = sock.getpeername()[0], sock.getsockname()[0]
        address = ipaddress.ip_address(peer)
    except (OSError, ValueError):
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # an IPv4 peer on a dual-stack socket: ::ffff:a.b.c.d
    return address.is_loopback or (mapped is not None and mapped.is_loopback) or peer == local


def tune_congestion(sock: socket.socket) -> str | None:
    """Set a new data connection's congestion control as ``AIODATADIST_TCP_CONGESTION`` says (module docstring);
    returns the algorithm set, or None where the connection keeps its own."""
    setting = env_knobs().tcp_congestion
    if setting == "system" or not hasattr(socket, "TCP_CONGESTION"):  # (Linux and FreeBSD have it)
        return None
    if setting == "auto":
        current = congestion_in_use(sock) if is_this_host(sock) else None
        if current is None or not current.startswith("bbr"):
            return None
        candidates: tuple[str, ...] = UNPACED
    else:
        candidates = (setting,)
    for name in candidates:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode("ascii"))
            return name
        except OSError as exc:
            refused = exc
    if setting != "auto" and setting not in _warned:
        _warned.add(setting)
        log.warning("AIODATADIST_TCP_CONGESTION=%s: the kernel refused it (%s); data connections keep the "
                    "system's congestion control", setting, refused)
    return None
