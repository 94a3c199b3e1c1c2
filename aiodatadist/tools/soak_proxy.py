"""The fault-injecting TCP proxy of ``soak --chaos``, in a process of its own.

``python -m aiodatadist.tools.soak_proxy TARGET_PORT`` listens on a free port of 127.0.0.1, prints it on the first
line of stdout, and forwards every connection to ``127.0.0.1:TARGET_PORT``.  It reads one command per line on
stdin and answers each with ``ok`` once it is in effect:

* ``pass``: forward (bytes held by a stall are delivered now);
* ``stall``: hold every byte in both directions (connections stay open, new ones are accepted and held too);
* ``cut``: close every connection (RST) and refuse new ones until ``pass``;
* ``target PORT``: later connections go to ``PORT`` (a restarted server on another port).

It exits when stdin closes.  Running it in its own process keeps the soaked decoder's descriptors, threads and
event loop free of the proxy's.  The test suite runs :class:`FaultProxy` in its own event loop instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

__all__ = ["FaultProxy"]


class FaultProxy:
    """A TCP proxy to ``127.0.0.1:target_port``: ``pass``, ``stall`` or ``cut`` (see the module docstring)."""

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
        self.port = int(self._server.sockets[0].getsockname()[1])

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
                writer.write(data)
                await writer.drain()
        finally:
            writer.transport.abort()

    async def close(self) -> None:
        self.set("cut")
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def _main(target_port: int) -> None:
    proxy = FaultProxy(target_port)
    await proxy.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    sys.stdout.write(f"{proxy.port}\n")
    sys.stdout.flush()
    try:
        while line := await reader.readline():
            words = line.decode().split()
            if not words:
                continue
            if words[0] == "target":
                proxy.target_port = int(words[1])
            elif words[0] in ("pass", "stall", "cut"):
                proxy.set(words[0])
            else:
                sys.stdout.write(f"error: unknown command {words[0]!r}\n")
                sys.stdout.flush()
                continue
            sys.stdout.write("ok\n")
            sys.stdout.flush()
    finally:
        await proxy.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(int(sys.argv[1])))
