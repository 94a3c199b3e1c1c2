"""The machine's own memory limits, measured in the benchmark's run (the TCP ceiling: :mod:`.tcp_ceiling`).

* ``copyto_gbps``: one ``np.copyto`` of N contiguous, pre-faulted bytes in this process (same host): one thread,
  ordinary stores.
* ``stream_copy_gbps`` (:class:`StreamCopy`, to measure it in turn with a workload): the same N bytes copied by
  T threads (one contiguous share each, copied as the pool copies: streaming (non-temporal) stores, the share cut
  into the lanes that run together) in the native helper: the most this machine's memory gives a big copy, and so
  the honest ceiling for a same-host transfer that may use T threads.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from aiodatadist.testing.probes import StreamCopyFn, stream_copy_function

__all__ = ["StreamCopy", "copyto_gbps", "gbps", "stream_copy_gbps"]


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

    def __init__(self, copy: StreamCopyFn, nbytes: int, threads: int, within: tuple[int, int] | None = None,
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
        copy = stream_copy_function()
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
