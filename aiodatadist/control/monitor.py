"""What happens to a client socket's connection: ZeroMQ's socket monitor, watched from before it connects, and a
plain TCP probe of a peer's address.

ZeroMQ hides connection failures: a DEALER connecting to a port where nothing listens retries for ever, and a
connection that broke is re-made silently.  :class:`ConnectionWatch` reports the first such failure of one
socket (a refused connection, a failed ZMTP/CURVE handshake, a dropped connection), so that a link attempt fails
at once instead of at its timeout, and a link is dropped as soon as its connection is.  :func:`probe` then tells
a dead peer (its address refuses connections) from one that stopped answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
from collections.abc import Callable
from typing import Any, Final, Literal, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

__all__ = ["FAILURES", "ConnectionWatch", "Disconnects", "Probe", "describe_failure", "open_monitor", "probe"]

FAILURES: Final = (zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
"""The monitor events that end a connection (a refused connect is followed by a retry: ``CONNECT_RETRIED``)."""

_DESCRIPTIONS: Final[dict[int, str]] = {
    zmq.EVENT_CONNECT_RETRIED: "connection refused (nothing listens there)",
    zmq.EVENT_DISCONNECTED: "the connection closed",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the connection closed during its handshake",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the ZeroMQ handshake failed (CURVE on one end only?)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the CURVE handshake was refused (key not trusted)",
}

Probe = Literal["refused", "accepted", "silent"]
"""What a TCP connect to an address gave: refused at once, accepted, or no answer in time."""


_monitor_ids = itertools.count()


def open_monitor(sock: zmq.Socket[Any], events: int) -> zmq.asyncio.Socket:
    """A monitor of ``sock``'s ``events`` (an asyncio PAIR socket) that can never stop ZeroMQ's I/O thread.

    libzmq sends monitor events from its I/O thread with a blocking send: once a monitor holds its high-water mark
    of unread events (1000 by default), that thread stops, and every connection of the context with it (a burst
    of a few thousand connections to a listen port did this for good).  This monitor's reading end has no
    high-water mark, so unread events wait in memory; its readers read them as they come.  Its inproc address is
    unique to it (never named after a descriptor number that a later socket may reuse)."""
    address = f"inproc://aiodatadist-monitor-{os.getpid()}-{next(_monitor_ids)}"
    sock.monitor(address, events)
    monitor = cast(zmq.asyncio.Socket, sock.context.socket(zmq.PAIR))  # (an asyncio context: an asyncio socket)
    try:
        monitor.setsockopt(zmq.RCVHWM, 0)  # read before connect: libzmq sizes the pipe at connect
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
    except BaseException:
        monitor.close(linger=0)
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        raise
    return monitor


def describe_failure(event: int) -> str:
    """A phrase for a monitor event of :data:`FAILURES`."""
    return _DESCRIPTIONS.get(event, f"connection event {event}")


class ConnectionWatch:
    """The first failure event (one of :data:`FAILURES`) of a socket's connection.

    Created before the socket connects, so that no event is missed.  :attr:`failed` is a task that ends with that
    event's number; it is the monitor's only reader.  :meth:`close` stops it and closes the monitor socket."""

    def __init__(self, sock: zmq.Socket[Any], spawn: Callable[..., asyncio.Task[Any]], name: str) -> None:
        self._sock = sock
        # (an asyncio socket: the watched socket's context is an asyncio one)
        self._monitor = open_monitor(sock, FAILURES)
        self.failed: asyncio.Task[int] = spawn(self._first_failure(), name=f"monitor-{name}")

    async def _first_failure(self) -> int:
        frames = await self._monitor.recv_multipart()
        return int(parse_monitor_message(frames)["event"])

    def close(self) -> None:
        """Stop watching (idempotent; the watched socket may already be closed)."""
        self.failed.cancel()
        if not self._sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
        self._monitor.close(linger=0)


class Disconnects:
    """The connections of a (server) socket that ended, counted as fast as they end, whatever the rate.

    A reader task (spawned with ``spawn``) reads every ``EVENT_DISCONNECTED`` at once into :attr:`total`;
    :meth:`after` waits until it passes a value seen before.  :meth:`close` stops watching (before the watched
    socket is closed)."""

    def __init__(self, sock: zmq.Socket[Any], spawn: Callable[..., asyncio.Task[Any]], name: str) -> None:
        self._sock = sock
        self._monitor = open_monitor(sock, zmq.EVENT_DISCONNECTED)
        self.total = 0
        """How many connections ended so far."""
        self._ended = asyncio.Event()
        self._reader = spawn(self._read(), name=f"disconnects-{name}")

    async def _read(self) -> None:
        while True:
            await self._monitor.recv_multipart()  # (a ready event is read without a loop iteration)
            self.total += 1
            self._ended.set()

    async def after(self, seen: int) -> None:
        """Return once more than ``seen`` connections ended."""
        while self.total <= seen:
            self._ended.clear()
            await self._ended.wait()

    def close(self) -> None:
        """Stop watching (idempotent; the watched socket may already be closed)."""
        self._reader.cancel()
        if not self._sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
        self._monitor.close(linger=0)


async def probe(host: str, port: int, timeout: float) -> Probe:
    """Try a TCP connection to ``host:port`` (closed at once): ``"refused"`` when nothing listens there (a reset
    counts too), ``"accepted"`` when something does, ``"silent"`` when no answer came within ``timeout`` s."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, (host, port))
        except TimeoutError:
            return "silent"
        except (ConnectionRefusedError, ConnectionResetError):
            return "refused"
        except OSError:  # unreachable network or host: nobody answers there
            return "silent"
    return "accepted"
