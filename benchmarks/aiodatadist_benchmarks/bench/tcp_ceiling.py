"""The TCP ceiling of the ``tcp`` rows: the same bytes between two processes over as many loopback connections as
the link's data plane uses, moved by native code as iperf moves them (:file:`tcp_ceiling.c`: a sender and a
receiver thread per connection, large ``send``/``recv`` calls from and into buffers touched beforehand), with the
data connections' ``TCP_NODELAY`` and congestion control.  Nothing a TCP data plane does on these connections
can beat it, so a row's ratio above 1 means a mistake in the row or in the ceiling.

The program is compiled at bench time with the system's C compiler (``$CC``, else ``cc``), once per process.
Without one, the ceiling is a Python fallback, named as such: a ``sendall``/``recv_into`` thread per connection
on each side, which the native program outruns.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from .baselines import gbps

__all__ = ["TcpCeiling", "compiled_ceiling", "tcp_ceiling"]

SOURCE = "tcp_ceiling.c"
RUN_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class TcpCeiling:
    """A measured ceiling: what the rows print as their baseline (``name``), its median GB/s, and whether it is
    the native one (False: the Python fallback)."""

    name: str
    gbps: float
    native: bool


@functools.cache
def compiled_ceiling() -> str | None:
    """The path of the compiled ceiling program (built on first use, removed at exit), or None where no C compiler
    is found or the build fails."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    folder = tempfile.mkdtemp(prefix="aiodatadist-tcp-ceiling-")
    atexit.register(shutil.rmtree, folder, True)
    binary = os.path.join(folder, "tcp_ceiling")
    source = resources.files(__package__).joinpath(SOURCE)
    with resources.as_file(source) as path:
        built = subprocess.run([compiler, "-O2", "-pthread", "-o", binary, str(path)], capture_output=True,
                               text=True, check=False, timeout=120)
    return binary if built.returncode == 0 else None


def tcp_ceiling(nbytes: int, repeat: int, connections: int, congestion: str | None,
                progress: Callable[[str], None] = lambda _: None) -> TcpCeiling:
    """Median GB/s of ``nbytes`` moved ``repeat`` times (after one warm-up) over ``connections`` loopback
    connections with congestion control ``congestion`` (None: the system's), by the native program, else by
    the Python fallback (``progress`` says why)."""
    binary = compiled_ceiling()
    size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes} B"
    streams = f"{connections} connection{'s' if connections != 1 else ''}"
    if binary is not None:
        seconds = _native_seconds(binary, nbytes, repeat, connections, congestion)
        return TcpCeiling(f"native TCP {size}, {streams}", gbps(nbytes, statistics.median(seconds)), True)
    progress("no C compiler (cc, or $CC) to build the native TCP ceiling: the TCP rows compare with Python "
             "streams instead, which are slower than the ceiling")
    seconds = _python_seconds(nbytes, repeat, connections, congestion)
    return TcpCeiling(f"Python TCP {size}, {streams} (fallback: no C compiler, not the ceiling)",
                      gbps(nbytes, statistics.median(seconds)), False)


def _native_seconds(binary: str, nbytes: int, repeat: int, connections: int, congestion: str | None) -> list[float]:
    done = subprocess.run([binary, str(nbytes), str(connections), str(repeat), congestion or "-"],
                          capture_output=True, text=True, check=False, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"the TCP ceiling failed (status {done.returncode}): {done.stderr.strip()}")
    return [float(line) for line in done.stdout.split()]


# -- the Python fallback --------------------------------------------------------------------------------------
def _tune(sock: socket.socket, congestion: str | None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode("ascii"))


def _shares(nbytes: int, connections: int) -> list[int]:
    return [nbytes // connections + (nbytes % connections if i == connections - 1 else 0)
            for i in range(connections)]


def _send_side(port: int, nbytes: int, connections: int, rounds: int, congestion: str | None) -> None:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]

    def send(sock: socket.socket, share: int) -> None:
        data = np.ones(share, dtype=np.uint8)
        with sock:
            _tune(sock, congestion)
            for _ in range(rounds):
                if sock.recv(1) != b"g":
                    return
                sock.sendall(data.data)

    threads = [threading.Thread(target=send, args=(s, n)) for s, n in zip(socks, _shares(nbytes, connections))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _receive(sock: socket.socket, buf: np.ndarray, errors: list[BaseException]) -> None:
    view, got = buf.data, 0
    try:
        while got < len(buf):
            n = sock.recv_into(view[got:], len(buf) - got)
            if not n:
                raise RuntimeError("the TCP ceiling's sender went away")
            got += n
    except (OSError, RuntimeError) as exc:
        errors.append(exc)


def _python_seconds(nbytes: int, repeat: int, connections: int, congestion: str | None) -> list[float]:
    ctx: Any = multiprocessing.get_context("spawn")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(connections)
        child = ctx.Process(target=_send_side, args=(listener.getsockname()[1], nbytes, connections, repeat + 1,
                                                     congestion), daemon=True)
        child.start()
        socks: list[socket.socket] = []
        try:
            listener.settimeout(60)
            for _ in range(connections):
                sock = listener.accept()[0]
                sock.settimeout(60)
                _tune(sock, congestion)
                socks.append(sock)
            buffers = [np.zeros(n, dtype=np.uint8) for n in _shares(nbytes, connections)]
            seconds: list[float] = []
            errors: list[BaseException] = []
            for i in range(repeat + 1):  # the first round warms the connections up
                start = time.perf_counter()
                threads = [threading.Thread(target=_receive, args=(s, b, errors)) for s, b in zip(socks, buffers)]
                for sock in socks:
                    sock.sendall(b"g")
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if errors:
                    raise RuntimeError(f"the TCP ceiling's Python fallback failed: {errors[0]}")
                if i:
                    seconds.append(time.perf_counter() - start)
        finally:
            for sock in socks:
                sock.close()
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
    return seconds
