"""Setting up a link's TCP data connections: the server's listener, the client's connections, and the
``DATA_HELLO`` (magic + the link's token) a connection presents before the server adopts it.

These functions know nothing of links: the link layer tells them where a connection goes (``attach``) and
which token is whose.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from .frames import DATA_HELLO, MAGIC

__all__ = ["accept_data", "connect_data", "data_listener", "read_data_hello"]

HELLO_TIMEOUT = 5.0  # an accepted connection that does not present its token by then is closed


def data_listener(ip: str) -> socket.socket:
    """A TCP listener for data connections on ``ip`` (an ephemeral port, announced in the handshake)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, 0))
        sock.listen(128)
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
                      adopt: Callable[[socket.socket], Coroutine[Any, Any, None]],
                      spawn: Callable[[Coroutine[Any, Any, None]], object]) -> None:
    """Server side: accept data connections until the listener closes; each is adopted in a task of its own."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn, _ = await loop.sock_accept(listener)
        except OSError:
            if listener.fileno() == -1:
                return  # stopped listening
            await asyncio.sleep(0.05)  # e.g. out of descriptors: try again shortly
            continue
        spawn(adopt(conn))


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
