"""The fault proxy of ``soak --chaos`` (:class:`~aiodatadist.testing.fault_proxy.FaultProxy`), in a process of
its own.

``python -m aiodatadist_benchmarks.soak_proxy TARGET_PORT`` listens on a free port of 127.0.0.1, prints it on the first
line of stdout, and forwards every connection to ``127.0.0.1:TARGET_PORT``.  It reads one command per line on
stdin and answers each with ``ok`` once it is in effect:

* ``pass``: forward (bytes held by a stall are delivered now);
* ``stall``: hold every byte in both directions (connections stay open, new ones are accepted and held too);
* ``cut``: close every connection (RST) and refuse new ones until ``pass``;
* ``target PORT``: later connections go to ``PORT`` (a restarted server on another port).

It exits when stdin closes.  Running it in its own process keeps the soaked decoder's descriptors, threads and
event loop free of the proxy's.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

from aiodatadist.testing.fault_proxy import FaultProxy

__all__: list[str] = []


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
