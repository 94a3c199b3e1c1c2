"""Hostile clients of a listen port, in a process of their own: ``python -m aiodatadist_benchmarks.port_churn KIND PORT
N [VERSION]``, or ``... mixed PORT SECONDS`` (used by ``soak --chaos``, its ``port_churn`` event, and the tests).

Kinds (each opens ``N`` connections, one after another unless said otherwise, and prints ``done N`` at the end):

``zmq``        a ZeroMQ DEALER connects and closes without sending anything;
``raw``        a TCP connection carrying random bytes, then closed;
``greeting``   a TCP connection carrying the first 1-63 bytes of a ZMTP greeting, then closed;
``msgpack``    a DEALER sending a few random msgpack maps (some of them of a real message kind), then closed;
``hello``      a DEALER saying a well-formed HELLO (a new cluster id each time, protocol version of this build,
               addressed to cluster 1), then closed at once without reading the answer;
``hello-open`` as ``hello`` with ``N`` DEALERs that stay connected until stdin closes (``open N`` once sent);
``hold``       ``N`` TCP connections that each send a partial ZMTP greeting and then nothing, held open until
               stdin closes (slow-loris); ``open N`` is printed once they are all connected;
``mixed``      for ``SECONDS`` (the third argument), connections of the kinds ``zmq``, ``raw``, ``greeting`` and
               ``msgpack`` in turn, a few at a time; prints ``done COUNT``.

``VERSION`` is the protocol version HELLOs claim (1 by default: give the real one for well-formed HELLOs).

Random content comes from a generator seeded with the process's arguments (the same run sends the same bytes).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
import zlib

import msgpack  # type: ignore[import-untyped]
import numpy as np
import zmq

GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL" + b"\x00" * 16 + b"\x00" + b"\x00" * 31
KINDS = ("begin", "end", "abort", "ping", "hello", "reply", "bye", "nonsense")
MIXED = ("zmq", "raw", "greeting", "msgpack")

__all__: list[str] = []


def _context() -> zmq.Context[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 16384)  # closed sockets linger while what they sent goes out
    return ctx


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], port: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)  # what was sent still goes out after close(), however busy the server is
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _random_map(rng: np.random.Generator) -> dict[str, object]:
    message: dict[str, object] = {"k": KINDS[int(rng.integers(len(KINDS)))], "i": int(rng.integers(0, 2**63))}
    for _ in range(int(rng.integers(0, 6))):
        key = rng.bytes(int(rng.integers(1, 6))).hex()
        message[key] = [int(rng.integers(-(2**62), 2**62)), rng.bytes(int(rng.integers(0, 64)))][
            int(rng.integers(2))]
    return message


def _hello(cluster: int, version: int) -> bytes:
    return bytes(msgpack.packb({"k": "hello", "i": 1, "v": version, "cluster": cluster, "to": 1, "role": 0,
                                "transport": "auto", "cn": bytes(32)}))


def _one(ctx: zmq.Context[zmq.Socket[bytes]], kind: str, port: int, i: int, rng: np.random.Generator,
         version: int) -> None:
    if kind in ("raw", "greeting"):
        payload = rng.bytes(int(rng.integers(1, 256))) if kind == "raw" else \
            GREETING[:int(rng.integers(1, len(GREETING)))]
        # a full backlog, or the server closed it already: on to the next
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(payload)
        return
    sock = _dealer(ctx, port)
    if kind == "zmq":
        time.sleep(0.001)  # long enough for the connection to be made
    elif kind == "msgpack":
        for _ in range(int(rng.integers(1, 4))):
            sock.send(msgpack.packb(_random_map(rng)))
    elif kind == "hello":
        sock.send(_hello(100_000 + i, version))
    sock.close()


def churn(kind: str, port: int, n: float, rng: np.random.Generator, version: int) -> int:
    """``n`` connections of ``kind`` (``mixed``: for ``n`` seconds); how many were made."""
    ctx = _context()
    made = 0
    try:
        if kind != "mixed":
            for made in range(1, int(n) + 1):
                _one(ctx, kind, port, made, rng, version)
            return made
        end = time.monotonic() + n
        while time.monotonic() < end:
            _one(ctx, MIXED[made % len(MIXED)], port, made, rng, version)
            made += 1
            time.sleep(0.0005)  # (most of a core all the same, leaving the soaked processes the other one)
        return made
    finally:
        ctx.term()


def hold(kind: str, port: int, n: int, version: int) -> None:
    """Open ``n`` connections that stay until stdin closes."""
    ctx = _context()
    held: list[object] = []
    try:
        for i in range(n):
            if kind == "hold":
                conn = socket.create_connection(("127.0.0.1", port), timeout=5)
                conn.sendall(GREETING[:10])
                held.append(conn)
            else:
                sock = _dealer(ctx, port)
                sock.send(_hello(200_000 + i, version))
                held.append(sock)
        print(f"open {n}", flush=True)
        sys.stdin.read()
    finally:
        for thing in held:
            thing.close()  # type: ignore[attr-defined]
        ctx.term()


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    n = float(sys.argv[3]) if kind == "mixed" else int(sys.argv[3])
    version = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    rng = np.random.default_rng(zlib.crc32(" ".join(sys.argv[1:]).encode()))
    if kind in ("hold", "hello-open"):
        made = int(n)
        hold(kind, port, made, version)
    else:
        made = churn(kind, port, n, rng, version)
    print(f"done {made}", flush=True)


if __name__ == "__main__":
    main()
