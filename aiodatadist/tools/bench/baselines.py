"""The machine's own limits, measured in the benchmark's run: memory copies and a plain TCP stream.

* ``copyto_gbps``: one ``np.copyto`` of N contiguous, pre-faulted bytes in this process (same host): one thread,
  ordinary stores.
* ``stream_copy_gbps`` (:class:`StreamCopy`, to measure it in turn with a workload): the same N bytes copied by
  T threads (one contiguous share each, copied as the pool copies: streaming (non-temporal) stores, the share cut
  into the lanes that run together) in the native helper: the most this machine's memory gives a big copy, and so
  the honest ceiling for a same-host transfer that may use T threads.
* ``socket_stream_gbps``: N bytes from one process to another over a plain loopback TCP connection, ``sendall``
  from one contiguous buffer into ``recv_into`` of another (the best a TCP data plane can do between two
  processes on this machine), with the data connections' congestion control
  (:func:`~aiodatadist.transport.tcp.congestion.tune_congestion`).
"""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import time
from typing import Any

import numpy as np

from ...transport.tcp.congestion import tune_congestion

__all__ = ["StreamCopy", "copyto_gbps", "gbps", "socket_stream_gbps", "stream_copy_gbps"]


def gbps(nbytes: int, seconds: float) -> float:
    """Bytes per second, in GB/s."""
    return nbytes / seconds / 1e9


def copyto_gbps(nbytes: int, repeat: int) -> float:
    """Median GB/s of ``np.copyto`` of ``nbytes`` contiguous bytes (pre-faulted arrays)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return gbps(nbytes, statistics.median(times))


class StreamCopy:
    """The streaming-copy limit as an instrument: ``nbytes`` contiguous, pre-faulted bytes copied by ``threads``
    threads with streaming stores, one copy per :meth:`seconds` call.  Kept alive beside a workload, it is
    measured in turn with it: this VM's memory bandwidth moves by a third from one minute to the next, so a limit
    measured apart from the workload says more about the minute than about the workload."""

    def __init__(self, copy: Any, nbytes: int, threads: int, within: tuple[int, int] | None = None,
                 name: str | None = None) -> None:
        self._copy, self.nbytes, self.threads = copy, nbytes, threads
        self.name = name or f"streaming copy {nbytes >> 20} MiB, {threads} threads"
        self._own: tuple[np.ndarray, np.ndarray] | None = None
        if within is None:
            self._own = (np.zeros(nbytes, dtype=np.uint8), np.ones(nbytes, dtype=np.uint8))
            within = (self._own[0].ctypes.data, self._own[1].ctypes.data)
        self._dst_addr, self._src_addr = within
        self.seconds()  # warms the threads' stacks and the destination's pages up

    @classmethod
    def create(cls, nbytes: int, threads: int, within: tuple[int, int] | None = None,
               name: str | None = None) -> StreamCopy | None:
        """The instrument (on buffers of its own, or ``within`` = (destination, source) addresses of memory the
        caller keeps alive, ``nbytes`` each), or None without the native helper."""
        from ...native import native_pool

        lib = native_pool()
        copy = getattr(lib, "adt_stream_copy_limit", None) if lib is not None else None
        return None if copy is None else cls(copy, nbytes, threads, within, name)

    def seconds(self) -> float:
        """One copy's wall time."""
        start = time.perf_counter()
        if self._copy(self._dst_addr, self._src_addr, self.nbytes, self.threads) != 0:
            raise RuntimeError("the streaming-copy baseline could not start its threads")
        return time.perf_counter() - start

    def check(self) -> None:
        """Raise if the copies did not copy the bytes (of its own buffers; nothing to check ``within``)."""
        if self._own is None:
            return
        dst, src = self._own
        step = max(1, self.nbytes // 4096)
        if not np.array_equal(dst[::step], src[::step]):
            raise RuntimeError("the streaming-copy baseline copied wrong bytes")


def stream_copy_gbps(nbytes: int, repeat: int, threads: int) -> float | None:
    """Median GB/s of ``nbytes`` contiguous, pre-faulted bytes copied by ``threads`` threads with streaming
    stores (None without the native helper)."""
    limit = StreamCopy.create(nbytes, threads)
    if limit is None:
        return None
    times = [limit.seconds() for _ in range(repeat)]
    limit.check()
    return gbps(nbytes, statistics.median(times))


def _stream_sender(port: int, nbytes: int, rounds: int) -> None:
    data = np.ones(nbytes, dtype=np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tune_congestion(sock)  # the data plane's own setting: the stream is its best on this machine too
        view = data.data
        for _ in range(rounds):
            if sock.recv(1) != b"g":
                return
            sock.sendall(view)


def socket_stream_gbps(nbytes: int, repeat: int) -> float:
    """Median GB/s of ``nbytes`` sent over a plain loopback TCP connection from another process."""
    ctx: Any = multiprocessing.get_context("spawn")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        child = ctx.Process(target=_stream_sender, args=(listener.getsockname()[1], nbytes, repeat + 1), daemon=True)
        child.start()
        try:
            listener.settimeout(60)
            conn, _ = listener.accept()
            tune_congestion(conn)
            with conn:
                conn.settimeout(60)
                buf = np.zeros(nbytes, dtype=np.uint8)
                view = buf.data
                times = []
                for i in range(repeat + 1):  # the first round warms the connection up
                    start = time.perf_counter()
                    conn.sendall(b"g")
                    got = 0
                    while got < nbytes:
                        n = conn.recv_into(view[got:], nbytes - got)
                        if not n:
                            raise RuntimeError("the stream baseline's sender went away")
                        got += n
                    if i:
                        times.append(time.perf_counter() - start)
        finally:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
    return gbps(nbytes, statistics.median(times))
