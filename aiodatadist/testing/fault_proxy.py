"""A fault-injecting TCP proxy for tests: :class:`FaultProxy` forwards connections on loopback and can stall or
cut them on command.

Put it between a decoder and a prompt's control port (link to ``proxy.port``) to see what the library does
when the network hangs or breaks.  ``soak --chaos`` runs it in a process of its own
(:mod:`aiodatadist_benchmarks.soak_proxy`); tests run it in their own event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["FaultProxy"]


class FaultProxy:
    """A TCP proxy from ``127.0.0.1:port`` to ``127.0.0.1:target_port``, in one of three modes (:meth:`set`):

    * ``pass``: forward (bytes held by a stall are delivered now);
    * ``stall``: hold every byte in both directions (connections stay open, new ones are accepted and held too);
    * ``cut``: close every connection (RST) and refuse new ones until ``pass``.

    ``target_port`` may be changed at any time: later connections go there (a restarted server on another
    port).  ``on_forward``, if given, is called with every chunk of bytes forwarded, in either direction.
    """

    def __init__(self, target_port: int, *, on_forward: Callable[[bytes], object] | None = None) -> None:
        self.target_port = target_port
        self.mode = "pass"
        self.port = 0
        self._on_forward = on_forward
        self._resume = asyncio.Event()
        self._resume.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen on a free port of 127.0.0.1 (then in :attr:`port`)."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def set(self, mode: str) -> None:
        """Switch to ``pass``, ``stall`` or ``cut``; in effect when this returns."""
        self.mode = mode
        if mode == "stall":
            self._resume.clear()
        else:
            self._resume.set()
        if mode == "cut":
            for writer in list(self._writers):
                writer.transport.abort()

    async def close(self) -> None:
        """Cut every connection and stop listening."""
        self.set("cut")
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "cut":
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:  # the server is down (being restarted): refuse like it would
            writer.transport.abort()
            return
        if self.mode == "cut":  # cut while connecting
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
        self._writers -= {writer, up_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                await self._resume.wait()
                if self.mode == "cut":
                    break
                if self._on_forward is not None:
                    self._on_forward(data)
                writer.write(data)
                await writer.drain()
        finally:
            writer.transport.abort()
