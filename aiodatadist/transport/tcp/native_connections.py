"""The TCP data plane on the native helper (``native/src/net.c``): I/O threads that never take the GIL, and
one-sided reads.

Same interface as :class:`~aiodatadist.transport.tcp.python_connections.PythonConnections` (``send``/``receive``/``set_destination``/
``cancel``/``wait``/``aclose``), plus :meth:`NativeConnections.read`: a pull by an already-resolved key that the
owner's native threads serve straight from its cache directory, without its event loop and without a
control-plane round trip.  Job ends arrive through a pipe watched by the event loop, as for the copy pool.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
from collections.abc import Callable
from typing import Any

import numpy.typing as npt

from ..._aio import in_thread, settle
from ...errors import LLMException, LLMLinkError, LLMStatusCode
from ...jobs.completion import NotifyPipe
from ...native import (
    ANY_MODEL,
    KEY_FLAG_SHIFT,
    TID_MASK,
    JobState,
    OwnerStatus,
    native_extension,
    native_pool,
)
from ...stats import OneSided
from ..base import PULL, PUSH, Grid, TransferJob, WaitingMixin
from .congestion import congestion_in_use, tune_congestion
from .frames import FRAME_BYTES

_ext: Any = native_extension()  # the one-sided calls and the reaping, without ctypes

__all__ = ["NativeConnections"]

S = LLMStatusCode
READ_BATCH = 16
"""Deferred READ frames after which a sender thread is woken without waiting for the end of the loop iteration.
A burst of 64 requests takes the loop ~13 ms to issue on 2 vCPUs, and the owner serves nothing of it until the
READs go out: bursts of 64 concurrent 4 MiB reads, interleaved in one run (25 each, medians), took 61.7-62.9 ms
waking once per iteration (64), 59.3-61.0 ms every 16, 59.7-60.4 ms every 8, 62-63 ms every 2-4 (each wake-up
costs the loop more); the first read of a burst goes out at once from the loop thread anyway."""
_CANCEL, _CANCEL_TELL_PEER, _CANCEL_FENCE = 0, 1, 2  # adt_net_cancel's `how`
_OWNER_STATUS: dict[int, LLMStatusCode] = {
    OwnerStatus.RELEASED: S.LLM_KV_CACHE_NOT_EXIST,
    OwnerStatus.OUT_OF_MEMORY: S.LLM_OUT_OF_MEMORY,
    OwnerStatus.OUT_OF_RANGE: S.LLM_PARAM_INVALID,
}


class NativeConnections(WaitingMixin[TransferJob]):
    """One link's data connections, served by the helper's threads."""

    serves_reads = True

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop, on_broken: Callable[[LLMException], None],
                 directory: tuple[int, int] | None) -> None:
        lib = native_pool()
        if lib is None or _ext is None:
            raise RuntimeError("the native helper is not built")
        self._lib = lib
        self.name = name
        self._loop = loop
        self._on_broken = on_broken
        self._jobs: dict[int, TransferJob] = {}
        self.closed: LLMException | None = None
        self.congestion: str | None = None  # the data connections' congestion control (as the last one reads)
        self._notify = NotifyPipe(loop, self._on_finished)  # the helper writes the handles of finished jobs
        address, rows = directory or (0, 0)
        self._served = (0, 0, 0, 0, 0, 0)  # reads, then writes (see _counts)
        self._deferred = 0  # READ frames queued without waking a sender (flushed at the end of the iteration)
        self._rings: dict[bool, tuple[Any, Callable[[Any], None]]] = {}  # staging rings by direction (receiving)
        self._net: int | None = lib.adt_net_new(self._notify.fd, address or None, rows, FRAME_BYTES)
        if not self._net:
            self._notify.close()
            raise LLMException("cannot create the TCP data plane", status_code=S.LLM_OUT_OF_MEMORY)

    @property
    def connections(self) -> int:
        return int(self._lib.adt_net_connections(self._net)) if self._net else 0

    def served_reads(self) -> tuple[int, int, int]:
        """The peer's one-sided reads this link served, counted by the I/O threads: (accepted, their bytes,
        refused)."""
        counts = self._counts()
        return counts[0], counts[1], counts[2]

    def served_writes(self) -> tuple[int, int, int]:
        """The peer's one-sided writes (WRITE frames) this link's I/O threads served: (accepted frames, their
        bytes, refused frames)."""
        counts = self._counts()
        return counts[3], counts[4], counts[5]

    @property
    def running(self) -> int:
        """Jobs not yet finished (either end)."""
        return len(self._jobs)

    def served_one_sided(self) -> OneSided:
        """:meth:`served_reads` then :meth:`served_writes`."""
        return self._counts()

    def _counts(self) -> tuple[int, int, int, int, int, int]:
        if not self._net:
            return self._served
        out = (ctypes.c_uint64 * 6)()
        self._lib.adt_net_served(self._net, out)
        return int(out[0]), int(out[1]), int(out[2]), int(out[3]), int(out[4]), int(out[5])

    def attach(self, sock: socket.socket) -> None:
        """Hand a connected socket to the helper's threads (this plane owns its descriptor from now on)."""
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tune_congestion(sock)
        self.congestion = congestion_in_use(sock)
        if self.closed is not None or self._net is None:
            sock.close()
            return
        fd = sock.detach()
        err = self._lib.adt_net_attach(self._net, fd)
        if err:
            os.close(fd)
            raise LLMLinkError(f"cannot start the data connection's threads: {os.strerror(err)}")

    # -- staging rings ---------------------------------------------------------------------------------------
    def staged(self, receiving: bool) -> bool:
        """Whether the link has its staging ring for sending (False) or receiving (True) device memory."""
        return receiving in self._rings

    def stage(self, receiving: bool, ring: Any, give_back: Callable[[Any], None]) -> None:
        """Hand the I/O threads the staging ring of one direction (``ring.handle``); ``give_back(ring)`` runs
        once the threads have ended."""
        self._check_open()
        self._rings[receiving] = (ring, give_back)
        self._lib.adt_net_set_stage(self._net, int(receiving), ring.handle)

    def staging(self) -> dict[str, Any] | None:
        """The staging rings' slots and what moved through them (``links()``), or None without one."""
        if not self._rings:
            return None
        out: dict[str, Any] = {}
        for receiving, (ring, _) in sorted(self._rings.items()):
            chunks, nbytes, waits, failed, overlapped = ring.stats()
            out["receive" if receiving else "send"] = {
                "slots": ring.slots, "slot_bytes": ring.slot_bytes, "shared": ring.shared, "chunks": chunks,
                "bytes": nbytes, "slot_waits": waits, "device_failures": failed, "overlapped": overlapped}
        return out

    # -- jobs ------------------------------------------------------------------------------------------------
    def _track(self, kind: str, flag: int, tid: int, handle: int | None) -> TransferJob:
        if not handle:
            raise LLMException("cannot start a TCP transfer: out of memory", status_code=S.LLM_OUT_OF_MEMORY)
        job = TransferJob(kind, flag, tid, self._loop)
        job.handle = handle
        self._jobs[handle] = job
        return job

    def _check_open(self) -> None:
        if self.closed is not None:
            raise self.closed

    def send(self, flag: int, tid: int, grid: Grid, lengths: npt.NDArray[Any], staged: bool = False) -> TransferJob:
        """Send the bytes of ``grid`` (runs of ``lengths`` at ``bases[t] + offsets[r]``, tensor-major: a plan's order)
        as transfer ``(flag, tid)``; ``staged``: device memory, through the sending ring (:meth:`stage`)."""
        self._check_open()
        return self._track("send", flag, tid, _ext.net_send(self._net, flag << KEY_FLAG_SHIFT | tid, grid[0], grid[1],
                                                             lengths, staged))

    def receive(self, flag: int, tid: int) -> TransferJob:
        """Register the receiving end of ``(flag, tid)``; its frames wait for :meth:`set_destination`."""
        self._check_open()
        key = flag << KEY_FLAG_SHIFT | tid
        return self._track("receive", flag, tid, self._lib.adt_net_receive(self._net, key))

    def set_destination(self, job: TransferJob, grid: Grid, lengths: npt.NDArray[Any], staged: bool = False) -> None:
        """Where a receive job's stream lands: ``grid`` as :meth:`send`'s (the helper walks it into its spans);
        ``staged``: device memory, through the receiving ring (:meth:`stage`)."""
        if job.handle is not None and self._net is not None and _ext.net_set_destination(
                self._net, job.handle, grid[0], grid[1], lengths, staged):
            raise LLMException("cannot start a TCP transfer: out of memory", status_code=S.LLM_OUT_OF_MEMORY)

    def read(self, tid: int, row: int, stamp: int, cache_id: int, model_id: int | None, remote: Grid,
             lengths: npt.NDArray[Any], local: Grid, staged: bool = False) -> TransferJob:
        """One-sided pull: the owner's directory row ``(row, stamp, cache_id)`` (still answering to ``model_id``,
        if given) holds the ``remote`` grid ``(bases, offsets)`` of runs of ``lengths``: ``bases[t] + offsets[r]``,
        ``lengths[r]`` bytes for each tensor ``t`` then each run ``r`` (a plan's order; 8-byte integers, a few words
        on the wire however many spans); they land in the ``local`` grid, the same runs here (as many tensors),
        which the helper walks itself.  Fails with the owner's status if the cache was released or re-keyed, or a
        span is outside it.  ``staged``: the local grid is device memory, through the receiving ring."""
        job = self._one_sided("read", PULL, _ext.net_read, tid, row, stamp, cache_id, model_id, remote, lengths, local,
                              staged)
        # Concurrent reads of one iteration go out together: a sender thread is woken at the end of the
        # iteration (or every READ_BATCH reads), not once per read: each wake-up, and each READ the loop sent
        # itself (the kernel delivers a loopback segment and wakes the peer on the sending thread), took this
        # loop off the CPU for ~1 ms on a busy 2-core machine, so a burst went out one read at a time.
        self._deferred += 1
        if self._deferred == 1:
            self._loop.call_soon(self._flush)
        elif self._deferred % READ_BATCH == 0:
            self._lib.adt_net_flush(self._net)
        return job

    def _flush(self) -> None:
        self._deferred = 0
        if self._net is not None:
            self._lib.adt_net_flush(self._net)

    def write(self, tid: int, row: int, stamp: int, cache_id: int, model_id: int | None, remote: Grid,
              lengths: npt.NDArray[Any], local: Grid, staged: bool = False) -> TransferJob:
        """One-sided push: the bytes of the ``local`` grid (as :meth:`read`: runs of ``lengths`` at ``bases[t] +
        offsets[r]``) land at the same runs of the ``remote`` grid in the owner's directory row ``(row, stamp,
        cache_id)`` (still answering to ``model_id``, if given), validated and written by the owner's I/O threads
        (each WRITE frame names its slice of the owner's spans); the job completes once the owner acknowledged every
        byte.  Fails with the owner's status if the cache was released or re-keyed, or a span is outside it.  A
        stopped one must be fenced (:meth:`fence`) before its caller returns.  ``staged``: the local grid is device
        memory, through the sending ring."""
        return self._one_sided("write", PUSH, _ext.net_write, tid, row, stamp, cache_id, model_id, remote, lengths,
                               local, staged)

    def _one_sided(self, kind: str, flag: int, start: Callable[..., int], tid: int, row: int, stamp: int,
                   cache_id: int, model_id: int | None, remote: Grid, lengths: npt.NDArray[Any],
                   local: Grid, staged: bool) -> TransferJob:
        """Start a one-sided job (``start``: the helper's ``net_read`` or ``net_write``) and track it."""
        self._check_open()
        return self._track(kind, flag, tid, start(
            self._net, flag << KEY_FLAG_SHIFT | tid, row, stamp, cache_id,
            ANY_MODEL if model_id is None else model_id, remote[0], remote[1], lengths, local[0], local[1], staged))

    def fence(self, flag: int, tid: int) -> TransferJob:
        """Fence transfer ``(flag, tid)`` this end sent and stopped (a cut-short push): the job settles once the
        peer's I/O threads acknowledged on every connection that nothing of it is written any more (no event loop
        takes part), or fails with ``LLMLinkError`` if the link broke."""
        self._check_open()
        return self._track("fence", flag, tid, self._lib.adt_net_fence(self._net, flag << KEY_FLAG_SHIFT | tid))

    def cancel(self, job: TransferJob, error: BaseException | None = None) -> None:
        """Stop a job (a one-sided read also tells the owner to stop serving it: only a peer that serves reads
        gets an ABORT frame; the Python plane would take it for a broken connection)."""
        if error is not None and job.error is None:
            job.error = error
        if job.handle is not None and self._net is not None:
            self._lib.adt_net_cancel(self._net, job.handle, _CANCEL_TELL_PEER if job.kind == "read" else _CANCEL)

    def cancel_fenced(self, job: TransferJob) -> bool:
        """Stop a send job (a cut-short push) with its fence armed: the I/O threads send the FENCE of
        :meth:`fence` as soon as none of its frames is in flight, and the job settles once the peer acknowledged
        it on every connection, so the caller wakes up once instead of twice.  False: nothing was armed (the job
        had ended already, or the link is closed)."""
        if job.handle is None or self._net is None:
            return False
        return bool(self._lib.adt_net_cancel(self._net, job.handle, _CANCEL_FENCE))

    # -- completion ------------------------------------------------------------------------------------------
    def _on_finished(self, handle: int) -> None:
        # A job its waiter reaped (ended) is gone; its address may be a new job's by now, which may still run.
        job = self._jobs.get(handle)
        if job is not None:
            self.ended(job)

    def ended(self, job: TransferJob) -> bool:
        handle = job.handle
        if handle is None or self._net is None:
            return job.future.done()
        if not _ext.net_done(handle):
            return False
        self._jobs.pop(handle, None)
        self._finish(job)
        return True

    def _finish(self, job: TransferJob) -> None:
        state, err, status = _ext.net_reap(self._net, job.handle)
        job.handle = None
        job.done = True
        if job.error is None:
            if status & 0xFF == OwnerStatus.DEVICE:
                runtime_code = status >> 8
                where = f"here (the device runtime's code {runtime_code})" if runtime_code else "on the peer"
                job.error = LLMException(f"a device copy of transfer {job.key & TID_MASK} failed {where}",
                                         status_code=S.LLM_DEVICE_MEM_ERROR)
            elif status != OwnerStatus.NONE:
                code = _OWNER_STATUS.get(status, S.LLM_FAILED)
                job.error = LLMException(f"the owner refused transfer {job.key & TID_MASK} ({code.name})",
                                         status_code=code)
            elif err:
                job.error = LLMLinkError(f"data connection of link {self.name} failed: {os.strerror(err)}")
                if self.closed is None:
                    self._broken(job.error)
            elif state == JobState.STOPPED:
                job.error = LLMException("the transfer was stopped", status_code=S.LLM_FAILED)
        settle(job.future, job.error)

    def _broken(self, error: LLMException) -> None:
        self.closed = error
        self._on_broken(error)

    # -- lifetime --------------------------------------------------------------------------------------------
    async def aclose(self, error: LLMException) -> None:
        """Fail every job, end the threads and free the helper's state (no thread touches memory afterwards)."""
        if self._net is None:
            return
        if self.closed is None:
            self.closed = error
        for job in self._jobs.values():
            if job.error is None:
                job.error = error
        self._lib.adt_net_close(self._net)
        for job in list(self._jobs.values()):
            await self.wait_stopped(job)
        self._served = self._counts()  # kept: the link's statistics outlive it
        net, self._net = self._net, None
        await in_thread(self._lib.adt_net_free, net)
        self._notify.close()
        rings, self._rings = self._rings, {}
        for ring, give_back in rings.values():  # no I/O thread uses them any more
            give_back(ring)
