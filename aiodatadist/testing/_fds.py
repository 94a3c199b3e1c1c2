"""What a file descriptor of this process is, for leak reports (Linux ``/proc``): its kind, the end of a pipe,
a socket's addresses, and the Python object that holds it.

Nothing here closes, shuts down or changes a descriptor it looks at: a socket is read through a duplicate
(closing a duplicate leaves the original and its connection as they are).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import socket
import stat
import sysconfig
import tracemalloc
from collections.abc import Collection
from typing import Any

__all__ = ["fd_detail", "fd_holders", "fd_kind"]

_ANON = {"eventpoll": "epoll"}


def fd_kind(fd: int, target: str) -> str:
    """The kind of descriptor ``fd``, whose ``/proc/self/fd`` link reads ``target``: ``pipe``, ``socket``,
    ``eventfd``, ``epoll``, ``timerfd``, ``signalfd``, ``inotify``, ``pidfd``, ... (an anonymous inode's
    name), ``memfd``, ``shm`` (``/dev/shm``), ``device`` (``/dev``), ``directory``, ``file``."""
    if target.startswith("anon_inode:"):
        name = target[len("anon_inode:"):].strip("[]")
        return _ANON.get(name, name)
    if target.startswith("/memfd:"):
        return "memfd"
    if target.startswith("/dev/shm/"):
        return "shm"
    if target.startswith("/dev/"):
        return "device"
    if target.startswith("/"):
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                return "directory"
        return "file"
    return target.split(":", 1)[0]  # pipe:[N], socket:[N], net:[N], ...


def fd_detail(fd: int, kind: str) -> str:
    """What else can be told of descriptor ``fd`` of ``kind``: a pipe's end (``read end``, ``write end``), a
    socket's protocol and addresses (``tcp 127.0.0.1:40000 -> 127.0.0.1:39163``, ``tcp listening on ...``,
    ``unix stream /run/x.sock``); ``""`` when nothing (or the descriptor was closed meanwhile)."""
    if kind == "pipe":
        return _pipe_end(fd)
    if kind == "socket":
        return _socket_detail(fd)
    return ""


def _pipe_end(fd: int) -> str:
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            flags = next((int(line.split()[1], 8) for line in f if line.startswith("flags:")), None)
    except (OSError, ValueError, IndexError):
        return ""
    if flags is None:
        return ""
    return {os.O_RDONLY: "read end", os.O_WRONLY: "write end"}.get(flags & os.O_ACCMODE, "read-write")


def _socket_detail(fd: int) -> str:
    try:
        dup = os.dup(fd)
    except OSError:
        return ""
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return ""
    with sock:  # closes the duplicate only
        return _describe_socket(sock)


def _describe_socket(sock: socket.socket) -> str:
    family, kind = sock.family, sock.type
    if family in (socket.AF_INET, socket.AF_INET6):
        proto = {socket.SOCK_STREAM: "tcp", socket.SOCK_DGRAM: "udp"}.get(kind, f"inet {_name(kind)}")
    elif family == socket.AF_UNIX:
        proto = f"unix {_name(kind)}"
    else:
        proto = _name(family)
    try:
        local = _address(family, sock.getsockname())
    except OSError:
        return proto
    with contextlib.suppress(OSError):
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return f"{proto} listening on {local}"
    try:
        peer = _address(family, sock.getpeername())
    except OSError:
        return f"{proto} {local}, not connected"
    if local == peer == "unnamed":
        return f"{proto}, unnamed, connected"
    return f"{proto} {local} -> {peer}"


def _name(value: Any) -> str:
    """``SOCK_STREAM`` -> ``stream``, ``AF_NETLINK`` -> ``netlink``."""
    name = getattr(value, "name", str(value))
    return str(name).split("_", 1)[-1].lower()


def _address(family: int, address: Any) -> str:
    if family == socket.AF_INET and isinstance(address, tuple):
        return f"{address[0]}:{address[1]}"
    if family == socket.AF_INET6 and isinstance(address, tuple):
        return f"[{address[0]}]:{address[1]}"
    if family == socket.AF_UNIX:
        if isinstance(address, bytes):  # the abstract namespace
            return "@" + address[1:].decode(errors="replace") if address else "unnamed"
        return str(address) or "unnamed"
    return str(address)


def fd_holders(fds: Collection[int]) -> dict[int, str]:
    """The Python object holding each of ``fds`` (sockets and file objects alive in this process), as
    ``socket.socket`` or ``_io.TextIOWrapper '/tmp/x.log'``; with ``where it was created`` when tracemalloc
    traces (``python -X tracemalloc=10``).  A descriptor no such object holds (``os.pipe()``, ``os.open()``,
    native code) is not in the result."""
    wanted = set(fds)
    found: dict[int, tuple[int, Any]] = {}
    if not wanted:
        return {}
    for obj in gc.get_objects():
        rank = _rank(type(obj))
        if rank is None:
            continue
        try:
            fd = obj.fileno()
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            continue  # closed, or no descriptor
        if fd in wanted and (fd not in found or rank < found[fd][0]):
            found[fd] = (rank, obj)
    return {fd: _describe_holder(obj) for fd, (_, obj) in found.items()}


def _rank(kind: type) -> int | None:
    """Which holder of a descriptor to name: the socket, else the outermost file object (what the code opened:
    a text file wraps a buffered one, which wraps the raw one); None for other objects."""
    # issubclass(type(obj)), not isinstance(obj): isinstance reads __class__, which some objects turn into a
    # warning or an error
    for rank, base in enumerate((socket.socket, io.TextIOBase, io.BufferedIOBase, io.RawIOBase)):
        if issubclass(kind, base):
            return rank
    return None


def _describe_holder(obj: Any) -> str:
    kind = type(obj)
    text = f"{kind.__module__}.{kind.__qualname__}"
    name = getattr(obj, "name", None) if not isinstance(obj, socket.socket) else None
    if isinstance(name, str):
        text += f" {name!r}"
    where = _created_at(obj)
    return f"{text} created at {where}" if where else text


def _created_at(obj: Any) -> str:
    """Where ``obj`` was allocated (the innermost frame outside the standard library), if tracemalloc traced it."""
    if not tracemalloc.is_tracing():
        return ""
    trace = tracemalloc.get_object_traceback(obj)
    if trace is None or not len(trace):
        return ""
    stdlib = sysconfig.get_paths()["stdlib"]
    frames = list(trace)  # the oldest first
    frame = next((f for f in reversed(frames)
                  if not f.filename.startswith(stdlib) or "-packages" in f.filename), frames[-1])
    return f"{frame.filename}:{frame.lineno}"
