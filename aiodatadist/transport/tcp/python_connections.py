"""The TCP data plane of one link: parallel stream connections, I/O threads, and transfers as frame streams.

Each connection has a sender thread and a receiver thread (blocking sockets; the helper's ``sendmsg`` /
``recvmsg`` run without the GIL).  A transfer is a *send job* on one end and a *receive job* on the other, keyed
by ``(flag, transfer id)``: the flag says whether the id is the receiver's (a pull: the owner sends on the
requester's id) or the sender's (a push).  Send jobs are cut into frames of at most :data:`FRAME_BYTES`; sender
threads take frames round-robin across the link's send jobs, so concurrent transfers share the connections
fairly, and one transfer spreads over every connection.  Receivers put each frame's payload straight into the
destination spans at the frame's stream offset; a job is complete when every byte arrived, never earlier.

Stopping a job (cancellation, a timeout, the peer's abort) sets its stop word: a receiver writes at most one more
piece (1 MiB) and drops the rest of that transfer's frames, a sender finishes the frame it is writing (its
memory is only read) and sends no more.  Waiting for a stopped job returns once no thread touches its memory.
A connection that fails breaks the whole plane: every job fails with ``LLMLinkError`` and the link is dropped.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ..._aio import in_thread, settle
from ...errors import LLMException, LLMLinkError, LLMStatusCode
from ...jobs.chunks import split_spans
from ...layout.plans import Spans
from ...native import TID_MASK
from ...protocol.messages import MAX_DATA_CONNECTIONS  # per link (MAX_CONNS in native/src/net.c)
from ..base import Grid, PythonTransferJob, TransferJob, WaitingMixin, grid_spans
from .congestion import congestion_in_use, tune_congestion
from .frames import (
    FRAME_BYTES,
    HEADER,
    MAGIC,
    T_DATA,
    FrameError,
    drop_payload,
    recv_exact,
    recv_frame,
    send_frame,
)

__all__ = ["MAX_DATA_CONNECTIONS", "PythonConnections"]

log = logging.getLogger("aiodatadist.tcp")
SCRATCH_BYTES = 1 << 20
JOIN_TIMEOUT = 5.0  # seconds aclose() waits for each I/O thread (they end at once once their socket is shut down)


def _own(job: TransferJob) -> PythonTransferJob:
    """A job of these connections (the plane hands back what :meth:`PythonConnections.send`/``receive`` made)."""
    assert isinstance(job, PythonTransferJob)
    return job


class PythonConnections(WaitingMixin[TransferJob]):
    """The data connections of one link and the transfers running on them (Python I/O threads: the fallback
    where the native helper is not built; it does not serve one-sided reads)."""

    serves_reads = False

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop,
                 on_broken: Callable[[LLMException], None]) -> None:
        self.name = name
        self._loop = loop
        self._on_broken = on_broken
        self._cv = threading.Condition()
        self._queue: deque[PythonTransferJob] = deque()  # send jobs with frames left, round-robin
        self._receiving: dict[int, PythonTransferJob] = {}
        self._jobs: set[PythonTransferJob] = set()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.closed: LLMException | None = None
        self.congestion: str | None = None  # the data connections' congestion control (as the last one reads)

    @property
    def connections(self) -> int:
        return len(self._socks)

    # -- connections -----------------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        """Jobs not yet finished (either end)."""
        return len(self._jobs)

    def served_one_sided(self) -> None:
        """Python threads serve no one-sided reads or writes."""

    def attach(self, sock: socket.socket) -> None:
        """Start moving frames on a connected socket (this plane owns it from now on)."""
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tune_congestion(sock)
        self.congestion = congestion_in_use(sock)
        with self._cv:
            if self.closed is not None:
                sock.close()
                return
            self._socks.append(sock)
        for role, target in (("send", self._sender), ("recv", self._receiver)):
            # aclose() (every link's teardown, hence finalize) joins them.  Daemons only for an instance that is
            # never finalized: blocked in recv on a connection nobody closes, they must not keep the process
            # from exiting (the native plane's threads do not either).
            thread = threading.Thread(target=target, args=(sock,), name=f"aiodatadist-{role}-{self.name}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()

    # -- jobs (event loop thread) ----------------------------------------------------------------------------
    def send(self, flag: int, tid: int, grid: Grid, lengths: npt.NDArray[Any]) -> PythonTransferJob:
        """Queue the bytes of ``grid`` (:data:`~aiodatadist.transport.base.Grid`, in stream order) as transfer
        ``(flag, tid)``; await it with :meth:`wait`."""
        job = PythonTransferJob("send", flag, tid, self._loop)
        addr, length = grid_spans(grid, lengths)
        spans, bounds = split_spans(Spans(addr, addr, length), FRAME_BYTES)
        job.addr = np.ascontiguousarray(spans.src, dtype=np.uint64)
        job.length = np.ascontiguousarray(spans.length, dtype=np.uint64)
        ends = np.concatenate(([0], np.cumsum(job.length, dtype=np.uint64))) if len(job.length) else np.zeros(1)
        job.bounds = bounds.tolist()
        job.offsets = [int(ends[b]) for b in job.bounds]
        job.total = job.offsets[-1]
        with self._cv:
            self._check_open()
            self._jobs.add(job)
            if len(job.bounds) > 1:
                self._queue.append(job)
                self._cv.notify_all()
            self._finish_if_idle(job)
        return job

    def receive(self, flag: int, tid: int) -> PythonTransferJob:
        """Register the receiving end of ``(flag, tid)`` before its frames can arrive; frames wait for
        :meth:`set_destination` (a pull registers before it knows the owner's layout)."""
        job = PythonTransferJob("receive", flag, tid, self._loop)
        with self._cv:
            self._check_open()
            if job.key in self._receiving:
                raise LLMException(f"transfer {tid} is already being received", status_code=LLMStatusCode.LLM_FAILED)
            self._receiving[job.key] = job
            self._jobs.add(job)
        return job

    def set_destination(self, transfer_job: TransferJob, grid: Grid, lengths: npt.NDArray[Any]) -> None:
        """Where a receive job's stream lands (``grid`` as :meth:`send`'s)."""
        job = _own(transfer_job)
        job.addr, job.length = grid_spans(grid, lengths)
        job.ends = np.cumsum(job.length, dtype=np.uint64)
        with self._cv:
            job.total = int(job.ends[-1]) if len(job.ends) else 0
            job.ready.set()
            self._finish_if_idle(job)

    def cancel(self, transfer_job: TransferJob, error: BaseException | None = None) -> None:
        """Stop a job: no new frame is sent or written; its waiter gets ``error`` if given."""
        job = _own(transfer_job)
        job.stop.set()
        with self._cv:
            if error is not None and job.error is None and not job.done:
                job.error = error
            job.next_frame = len(job.bounds) - 1
            if job in self._queue:
                self._queue.remove(job)
            job.ready.set()  # a receiver waiting for the destination drops the frame instead
            self._finish_if_idle(job)

    # -- bookkeeping (under the condition's lock) -------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed is not None:
            raise self.closed

    def _finish_if_idle(self, job: PythonTransferJob) -> None:
        if job.done or job.inflight:
            return
        if job.kind == "send":
            finished = job.next_frame >= len(job.bounds) - 1
        else:
            finished = job.stop.is_set() or (job.ready.is_set() and job.moved >= job.total)
        if not finished:
            return
        job.done = True
        self._jobs.discard(job)
        if self._receiving.get(job.key) is job:
            del self._receiving[job.key]
        if job.error is None and job.stop.is_set():
            job.error = LLMException("the transfer was stopped", status_code=LLMStatusCode.LLM_FAILED)
        self._loop.call_soon_threadsafe(settle, job.future, job.error)

    # -- I/O threads -----------------------------------------------------------------------------------------
    def _sender(self, sock: socket.socket) -> None:
        while True:
            with self._cv:
                while not self._queue and self.closed is None:
                    self._cv.wait()
                if self.closed is not None:
                    return
                job = self._queue.popleft()
                frame = job.next_frame
                job.next_frame += 1
                if job.next_frame < len(job.bounds) - 1:
                    self._queue.append(job)  # round-robin: the next frame goes to the next transfer
                job.inflight += 1
            lo, hi = job.bounds[frame], job.bounds[frame + 1]
            start, end = job.offsets[frame], job.offsets[frame + 1]
            header = HEADER.pack(MAGIC, T_DATA, job.key, start, end - start, 0, 0)
            try:
                send_frame(sock, header, job.addr, job.length, lo, hi)
            except FrameError as exc:
                self._thread_failed(job, exc)
                return
            with self._cv:
                job.inflight -= 1
                job.moved += end - start
                self._finish_if_idle(job)

    def _receiver(self, sock: socket.socket) -> None:
        header = bytearray(HEADER.size)
        scratch = ctypes.create_string_buffer(SCRATCH_BYTES)
        while True:
            job: PythonTransferJob | None = None
            try:
                recv_exact(sock, header)
                magic, kind, key, offset, nbytes, _, _ = HEADER.unpack(header)
                if magic != MAGIC or kind != T_DATA:  # this end never offers one-sided reads
                    raise FrameError(0, "the data connection carried something that is not a data frame")
                tid = key & TID_MASK
                with self._cv:
                    job = self._receiving.get(key)
                    if job is not None:
                        job.inflight += 1
                if job is None:  # finished, stopped or unknown: drop the payload
                    drop_payload(sock, nbytes, scratch)
                    continue
                job.ready.wait()
                written, consumed = recv_frame(sock, job.addr, job.length, job.ends, offset, nbytes, job.stop.address,
                                               scratch)
            except FrameError as exc:
                self._thread_failed(job, exc)
                return
            with self._cv:
                job.inflight -= 1
                if not job.stop.is_set():
                    if written != nbytes:
                        job.error = LLMLinkError(f"the peer sent {nbytes} bytes at offset {offset} of transfer {tid}, "
                                                 f"beyond its {job.total} bytes")
                        job.stop.set()
                    job.moved += written
                self._finish_if_idle(job)
            if consumed < nbytes:  # stopped mid-frame: the rest is dropped without the job
                try:
                    drop_payload(sock, nbytes - consumed, scratch)
                except FrameError as exc:
                    self._thread_failed(None, exc)
                    return

    def _thread_failed(self, job: PythonTransferJob | None, exc: FrameError) -> None:
        error = LLMLinkError(f"data connection of link {self.name} failed: {exc.strerror or exc}")
        with self._cv:
            if job is not None:
                job.inflight -= 1
                # Its frame broke off (only part of it was written or sent): the job fails, even if its byte count
                # is reached by other frames (the helper's threads fail every job of a broken connection too).
                if job.error is None and not job.done:
                    job.error = error
                self._finish_if_idle(job)
        if self.closed is None:
            self._loop.call_soon_threadsafe(self._broken, error)

    def _broken(self, error: LLMException) -> None:
        if self.closed is None:
            self._on_broken(error)

    # -- lifetime --------------------------------------------------------------------------------------------
    def close(self, error: LLMException) -> list[PythonTransferJob]:
        """Fail every job, stop the threads (sockets shut down); returns the jobs to wait for."""
        with self._cv:
            if self.closed is None:
                self.closed = error
            jobs = list(self._jobs)
            self._queue.clear()
            self._cv.notify_all()
        for job in jobs:
            self.cancel(job, error)
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return jobs

    async def aclose(self, error: LLMException) -> None:
        """:meth:`close`, then wait until no thread touches any job's memory and the threads have ended."""
        jobs = self.close(error)
        for job in jobs:
            await self.wait_stopped(job)
        threads = [t for t in self._threads if t is not threading.current_thread()]
        if threads:
            await in_thread(_join, threads)
        for sock in self._socks:
            sock.close()


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(timeout=JOIN_TIMEOUT)
        if thread.is_alive():  # its socket is shut down and its jobs are stopped: this is a bug
            log.warning("%s has not ended %.0f s after its data plane was closed", thread.name, JOIN_TIMEOUT)

