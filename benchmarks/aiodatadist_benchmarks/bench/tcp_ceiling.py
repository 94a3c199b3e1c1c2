"""The TCP ceiling of the ``tcp`` rows: the same bytes between two processes over as many loopback connections as
the link's data plane uses, moved by native code as iperf moves them (:file:`tcp_ceiling.c`: a sender and a
receiver thread per connection, large ``send``/``recv`` calls from and into buffers touched beforehand), with the
data connections' ``TCP_NODELAY`` and congestion control.  Nothing a TCP data plane does on these connections
can beat it, so a row's ratio above 1 means a mistake in the row or in the ceiling.

:class:`TcpCeiling` is an instrument, read in turn with a workload (one round after each of its runs), as the
same-host copy limit is: loopback throughput moves with the machine's load from one second to the next, and a
ceiling measured apart from the workload would say more about that second than about the workload.

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
from importlib import resources
from types import TracebackType
from typing import Any, Protocol, Self

import numpy as np

__all__ = ["TcpCeiling", "compiled_ceiling", "tcp_ceiling_gbps"]

SOURCE = "tcp_ceiling.c"
ROUND_TIMEOUT_S = 120.0


class _Rounds(Protocol):
    def seconds(self) -> float: ...
    def close(self) -> None: ...


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
    with resources.as_file(resources.files(__package__).joinpath(SOURCE)) as path:
        built = subprocess.run([compiler, "-O2", "-pthread", "-o", binary, str(path)], capture_output=True,
                               text=True, check=False, timeout=120)
    return binary if built.returncode == 0 else None


class TcpCeiling:
    """``nbytes`` moved from another process over ``connections`` loopback connections, one round per
    :meth:`seconds` call, by the native program (``native``), else by the Python fallback; ``name`` says which,
    as the rows print it.  Close it (or use it as a context manager) to end its processes."""

    def __init__(self, rounds: _Rounds, nbytes: int, connections: int, native: bool) -> None:
        self._rounds, self.nbytes, self.native = rounds, nbytes, native
        size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes} B"
        streams = f"{connections} connection{'s' if connections != 1 else ''}"
        self.name = (f"native TCP {size}, {streams}" if native
                     else f"Python TCP {size}, {streams} (fallback: no C compiler, not the ceiling)")

    @classmethod
    def start(cls, nbytes: int, connections: int, congestion: str | None,
              progress: Callable[[str], None] = lambda _: None) -> TcpCeiling:
        """Connect and warm up (``congestion``: the connections' congestion control, None: the system's); the
        Python fallback where the native program cannot be built (``progress`` says so)."""
        binary = compiled_ceiling()
        if binary is not None:
            return cls(_NativeRounds(binary, nbytes, connections, congestion), nbytes, connections, True)
        progress("no C compiler (cc, or $CC) to build the native TCP ceiling: the TCP rows compare with Python "
                 "streams instead, which are slower than the ceiling")
        return cls(_PythonRounds(nbytes, connections, congestion), nbytes, connections, False)

    def seconds(self) -> float:
        """One round's wall time: every connection's share sent and received."""
        return self._rounds.seconds()

    def close(self) -> None:
        self._rounds.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def tcp_ceiling_gbps(nbytes: int, repeat: int, connections: int, congestion: str | None,
                     progress: Callable[[str], None] = lambda _: None) -> tuple[str, float]:
    """The ceiling's name and median GB/s over ``repeat`` rounds in a row (not in turn with anything)."""
    with TcpCeiling.start(nbytes, connections, congestion, progress) as ceiling:
        seconds = [ceiling.seconds() for _ in range(repeat)]
    return ceiling.name, nbytes / statistics.median(seconds) / 1e9


class _NativeRounds:
    """The native program in its interactive mode: a round per line written to its stdin."""

    def __init__(self, binary: str, nbytes: int, connections: int, congestion: str | None) -> None:
        self._proc = subprocess.Popen([binary, str(nbytes), str(connections), "0", congestion or "-"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        try:
            self._expect("ready")
        except BaseException:
            self.close()
            raise

    def _line(self) -> str:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line:
            self.close()
            error = self._proc.stderr.read().strip() if self._proc.stderr is not None else ""
            raise RuntimeError(f"the TCP ceiling failed (status {self._proc.returncode}): {error}")
        return line

    def _expect(self, word: str) -> None:
        line = self._line()
        if line != word:
            raise RuntimeError(f"the TCP ceiling said {line!r}, not {word!r}")

    def seconds(self) -> float:
        assert self._proc.stdin is not None
        self._proc.stdin.write("g\n")
        self._proc.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()  # the program ends its sender and exits
        try:
            self._proc.wait(timeout=ROUND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


# -- the Python fallback --------------------------------------------------------------------------------------
def _tune(sock: socket.socket, congestion: str | None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode("ascii"))


def _shares(nbytes: int, connections: int) -> list[int]:
    return [nbytes // connections + (nbytes % connections if i == connections - 1 else 0)
            for i in range(connections)]


def _send_side(port: int, nbytes: int, connections: int, congestion: str | None) -> None:
    """The fallback's sending process: a round per byte received on each connection, until it closes."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]

    def send(sock: socket.socket, share: int) -> None:
        data = np.ones(share, dtype=np.uint8)
        with sock:
            _tune(sock, congestion)
            while sock.recv(1) == b"g":
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


class _PythonRounds:
    """The fallback: a sending process of its own, a receiving thread per connection here for each round."""

    def __init__(self, nbytes: int, connections: int, congestion: str | None) -> None:
        ctx: Any = multiprocessing.get_context("spawn")
        self._socks: list[socket.socket] = []
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(connections)
            self._child = ctx.Process(target=_send_side, args=(listener.getsockname()[1], nbytes, connections,
                                                               congestion), daemon=True)
            self._child.start()
            try:
                listener.settimeout(60)
                for _ in range(connections):
                    sock = listener.accept()[0]
                    sock.settimeout(ROUND_TIMEOUT_S)
                    _tune(sock, congestion)
                    self._socks.append(sock)
                self._buffers = [np.zeros(n, dtype=np.uint8) for n in _shares(nbytes, connections)]
                self.seconds()  # the warm-up
            except BaseException:
                self.close()
                raise

    def seconds(self) -> float:
        errors: list[BaseException] = []
        start = time.perf_counter()
        threads = [threading.Thread(target=_receive, args=(s, b, errors)) for s, b in zip(self._socks, self._buffers)]
        for sock in self._socks:
            sock.sendall(b"g")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"the TCP ceiling's Python fallback failed: {errors[0]}")
        return time.perf_counter() - start

    def close(self) -> None:
        for sock in self._socks:
            sock.close()
        self._child.join(timeout=10)
        if self._child.is_alive():
            self._child.kill()
