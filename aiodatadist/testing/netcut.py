"""Cut a process's TCP data connections to a prompt from outside the library (Linux ``/proc``).

A TCP link's data listener has an ephemeral port announced in the handshake, so no proxy can sit in front of
it; :func:`cut_data_connections` shuts the connections down instead, through duplicates of this process's
descriptors, so the library's own descriptors stay valid and its threads see the connections break.
(The same cut as ``soak --chaos``'s ``data_cut`` event.)
"""

from __future__ import annotations

import contextlib
import os
import socket

__all__ = ["cut_data_connections", "listening_ports", "tcp_sockets"]

_ESTABLISHED, _LISTEN = "01", "0A"


def tcp_sockets() -> dict[int, tuple[int, int, str]]:
    """Every TCP socket of this network namespace: inode -> (local port, remote port, state in hex)."""
    out: dict[int, tuple[int, int, str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
                out[int(fields[9])] = (local, remote, fields[3])
    return out


def _socket_fds(pid: int | str) -> dict[int, int]:
    """A process's socket descriptors: inode -> descriptor."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    out[int(target[8:-1])] = int(fd)
    return out


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on."""
    table = tcp_sockets()
    return {table[i][0] for i in _socket_fds(pid) if i in table and table[i][2] == _LISTEN}


def cut_data_connections(prompt_pid: int, control_port: int) -> int:
    """Shut down this process's TCP connections to the prompt's data listener (its listening ports other than
    ``control_port``); returns how many.  Each is shut down through a duplicate of its descriptor, checked to
    still be such a connection."""
    table = tcp_sockets()
    data_ports = listening_ports(prompt_pid) - {control_port}
    cut = 0
    for inode, fd in _socket_fds("self").items():
        entry = table.get(inode)
        if entry is None or entry[2] != _ESTABLISHED or entry[1] not in data_ports:
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        sock = socket.socket(fileno=dup)
        try:
            if sock.type == socket.SOCK_STREAM and sock.getpeername()[1] in data_ports:
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
        except OSError:
            pass
        finally:
            sock.close()
    return cut
