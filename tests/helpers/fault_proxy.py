"""A fault-injecting TCP proxy in the test's own event loop: it forwards, stalls or cuts every connection to a
local port, so that tests can break a real network path on demand."""

from __future__ import annotations

import asyncio

__all__ = ["FaultProxy"]


class FaultProxy:
    """A TCP proxy: ``pass`` forwards, ``stall`` holds every byte (delivered on ``pass`` again), ``cut`` closes
    every connection and refuses new ones."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.mode = "pass"
        self._resume = asyncio.Event()
        self._resume.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def set(self, mode: str) -> None:
        self.mode = mode
        if mode == "stall":
            self._resume.clear()
        else:
            self._resume.set()
        if mode == "cut":
            for writer in list(self._writers):
                writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "cut":
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
        self._writers -= {writer, up_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                await self._resume.wait()
                if self.mode == "cut":
                    break
                writer.write(data)
                await writer.drain()
        finally:
            writer.transport.abort()

    async def close(self) -> None:
        self.set("cut")
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
