"""Setting up a link's TCP data connections: the server's listener, the client's connections, and the
``DATA_HELLO`` (magic + the link's token) a connection presents before the server adopts it.

These functions know nothing of links: the link layer tells them where a connection goes (``attach``) and
which token is whose.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any, cast

from ..._listen import LISTEN_BACKLOG
from ..._log_limits import LimitedWarning
from .frames import DATA_HELLO, MAGIC

__all__ = ["MAX_UNNAMED", "accept_data", "connect_data", "data_listener", "read_data_hello"]

HELLO_TIMEOUT = 5.0  # an accepted connection that does not present its token by then is closed
MAX_UNNAMED = 256
"""Accepted data connections that may wait at once to present their token."""

log = logging.getLogger("aiodatadist.transport.tcp")
_unnamed = LimitedWarning(log)
_accept_failed = LimitedWarning(log)


def data_listener(ip: str) -> socket.socket:
    """A TCP listener for data connections on ``ip`` (an ephemeral port, announced in the handshake)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, 0))
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def connect_data(host: str, port: int, token: bytes, count: int, timeout: float,
                       attach: Callable[[socket.socket], None]) -> str | None:
    """Client side: open ``count`` data connections to ``host:port``, each presenting ``token``, and hand each
    to ``attach``; returns what went wrong, or None."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(max(timeout, 0.001)):
            for _ in range(count):
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                conn = socket.socket(family, socket.SOCK_STREAM)
                try:
                    conn.setblocking(False)
                    await loop.sock_connect(conn, (host, port))
                    await loop.sock_sendall(conn, DATA_HELLO.pack(MAGIC, token))
                except BaseException:
                    conn.close()
                    raise
                attach(conn)
    except (OSError, TimeoutError) as exc:
        return f"cannot open data connections to {host}:{port}: {exc or 'no answer in time'}"
    return None


async def accept_data(listener: socket.socket,
                      adopt: Callable[[socket.socket, bytes], Coroutine[Any, Any, None]],
                      spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]) -> None:
    """Server side: accept data connections until the listener closes; each that presents a token in time is handed
    to ``adopt`` with it (others are closed).  At most :data:`MAX_UNNAMED` connections wait to present theirs (a
    real peer sends it with its connect); beyond that the one that has waited longest is closed."""
    loop = asyncio.get_running_loop()
    waiting: dict[asyncio.Task[None], socket.socket] = {}  # in accepting order
    while True:
        try:
            conn, _ = await loop.sock_accept(listener)
        except OSError:
            if listener.fileno() == -1:
                return  # stopped listening
            _accept_failed("cannot accept data connections: %s", sys.exc_info()[1])
            await asyncio.sleep(0.05)  # e.g. out of descriptors: try again shortly
            continue
        if len(waiting) >= MAX_UNNAMED:
            oldest = next(iter(waiting))
            _unnamed("closing a data connection that did not present a token: %d are waiting, the most kept",
                     len(waiting))
            oldest.cancel()
            waiting.pop(oldest).close()
        task = spawn(_named(conn, adopt, waiting))
        waiting[task] = conn
        task.add_done_callback(lambda done: waiting.pop(done, None))


async def _named(conn: socket.socket, adopt: Callable[[socket.socket, bytes], Coroutine[Any, Any, None]],
                 waiting: dict[asyncio.Task[None], socket.socket]) -> None:
    """Read the token ``conn`` presents, then (no longer waiting) hand it over; closed without one."""
    try:
        token = await read_data_hello(conn)
    except BaseException:
        conn.close()
        raise
    current = asyncio.current_task()
    if current is not None:
        waiting.pop(cast(asyncio.Task[None], current), None)
    if token is None:
        conn.close()
        return
    await adopt(conn, token)


async def read_data_hello(conn: socket.socket) -> bytes | None:
    """The token an accepted connection presents (None: a wrong magic, or nothing in time)."""
    loop = asyncio.get_running_loop()
    conn.setblocking(False)
    data = b""
    try:
        async with asyncio.timeout(HELLO_TIMEOUT):
            while len(data) < DATA_HELLO.size:
                chunk = await loop.sock_recv(conn, DATA_HELLO.size - len(data))
                if not chunk:
                    break
                data += chunk
    except (OSError, TimeoutError):
        pass
    if len(data) != DATA_HELLO.size:
        return None
    magic, token = DATA_HELLO.unpack(data)
    return bytes(token) if magic == MAGIC else None
