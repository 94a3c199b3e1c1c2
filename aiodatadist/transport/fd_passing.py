"""Same-host peers under different users: shared-memory segments handed over an abstract Unix socket
(``SCM_RIGHTS``) instead of opened through ``/proc/<pid>/fd``, which needs ptrace rights over the owner.

Every instance listens on an abstract Unix socket (:class:`FdServer`; the name is announced in the handshake).
Two requests are served:

* ``PROBE``: a read-only descriptor of the instance's one-page probe segment, to anyone who connects.  It holds
  only the random nonce the handshake announced, so reading it proves that the peer shares this kernel (the
  abstract socket name is also only reachable from the same network namespace) and nothing more.
* ``SEGMENT``: a read-write descriptor of one of the instance's shared-memory caches, to a peer that presents the
  token this instance gave it over the admitted link (the server's in its HELLO answer, the client's in a
  ``GRANT`` right after), and only for a segment of a remote-accessible cache (the lookup is the caller's).

What a peer gets is exactly what the shared-memory plane already lets a peer with ptrace rights map: the caches'
memory, not the process.  See docs/security.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
from collections.abc import Callable

from .._aio import drop_cancellation
from ..protocol.messages import FD_TOKEN_BYTES, FDS_PREFIX

__all__ = ["PROBE", "SEGMENT", "FdServer", "request_fd"]

log = logging.getLogger("aiodatadist.transport.fds")
PROBE, SEGMENT = b"P", b"S"
_REQUEST = struct.Struct(f"<c{FD_TOKEN_BYTES}sQQ")  # kind, token, inode, device
REQUEST_TIMEOUT = 2.0

Lookup = Callable[[bytes, int, int], int | None]
"""(token, inode, device) -> a descriptor of that segment for the peer holding ``token``, or None."""


class FdServer:
    """This instance's abstract Unix socket handing out segment descriptors (see the module docstring)."""

    def __init__(self, probe_fd: int, lookup: Lookup) -> None:
        self.name = f"{FDS_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self._lookup = lookup
        self._probe = os.open(f"/proc/self/fd/{probe_fd}", os.O_RDONLY | os.O_CLOEXEC)  # read-only: never writable
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.name)
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._serve())
        self._task.add_done_callback(drop_cancellation)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError:
                if self._sock.fileno() == -1:
                    return
                await asyncio.sleep(0.05)
                continue
            with contextlib.closing(conn):
                await self._answer(loop, conn)

    async def _answer(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        conn.setblocking(False)
        data = b""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                while len(data) < _REQUEST.size:
                    chunk = await loop.sock_recv(conn, _REQUEST.size - len(data))
                    if not chunk:
                        return
                    data += chunk
        except (OSError, TimeoutError):
            return
        kind, token, inode, device = _REQUEST.unpack(data)
        fd = self._probe if kind == PROBE else self._lookup(token, inode, device) if kind == SEGMENT else None
        with contextlib.suppress(OSError):
            conn.setblocking(True)
            conn.settimeout(REQUEST_TIMEOUT)
            if fd is None:
                conn.sendall(b"N")
            else:
                socket.send_fds(conn, [b"Y"], [fd])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._sock.close()
        with contextlib.suppress(OSError):
            os.close(self._probe)


def request_fd(name: str, kind: bytes, token: bytes = bytes(FD_TOKEN_BYTES), inode: int = 0, device: int = 0,
               timeout: float = REQUEST_TIMEOUT) -> int:
    """Ask the instance listening on ``name`` for a descriptor (blocking; run it in a thread); raises ``OSError``
    when it refuses or cannot be reached."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(name)
        sock.sendall(_REQUEST.pack(kind, token, inode, device))
        message, fds, _, _ = socket.recv_fds(sock, 1, 1)
        if message != b"Y" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(0, f"the peer refused the descriptor ({kind.decode()}, inode {inode})")
        return fds[0]

