"""What every data plane shares: a transfer's end on a plane (:class:`TransferJob`) and how it is awaited.

A transfer is a *send job* on one end and a *receive job* on the other, keyed by ``(flag, transfer id)``: the
flag says whether the id is the receiver's (:data:`PULL`: the owner sends on the requester's id) or the
sender's (:data:`PUSH`).  Whatever the plane, a job's future settles only once no I/O thread touches its
memory, and a cancelled waiter returns only after that (:class:`WaitingMixin`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from .._aio import wait_through_cancellation
from .._arrays import UInt64Array
from ..jobs.completion import Polling
from ..layout.plans import CopyPlan, coalesce
from ..native import KEY_FLAG_SHIFT, StopFlag

__all__ = ["PULL", "PUSH", "Grid", "PlaneJob", "PythonTransferJob", "TransferJob", "WaitingMixin", "grid_spans",
           "plan_grid"]

Grid = tuple[npt.NDArray[Any], npt.NDArray[Any]]
"""One side's runs of a transfer: its tensors' base addresses and the runs' offsets in them (8-byte integers, C
order); with the runs' lengths, run ``r`` of tensor ``t`` is ``lengths[r]`` bytes at ``bases[t] + offsets[r]``, and
a transfer's stream is every run of the first tensor, then of the next (a plan's order)."""
PULL = 1  # frame flag: the transfer id is the receiver's own (the owner sends a pull)
PUSH = 0  # the transfer id is the sender's (the requester sends a push)


class TransferJob:
    """One end of one transfer on a data plane (``send`` or ``receive``).  The native helper keeps the rest of a
    job in C (``handle``); :class:`PythonTransferJob` holds what the Python I/O threads need."""

    __slots__ = ("done", "error", "fenced", "future", "handle", "key", "kind", "polling")

    def __init__(self, kind: str, flag: int, tid: int, loop: asyncio.AbstractEventLoop) -> None:
        self.kind = kind
        self.key = flag << KEY_FLAG_SHIFT | tid
        self.future: asyncio.Future[None] = loop.create_future()
        self.future.add_done_callback(_retrieved)  # an owner-side job may end with nobody awaiting it
        self.error: BaseException | None = None
        self.done = False
        self.handle: int | None = None  # native plane: the helper's job
        self.fenced = False  # send: cut short, and the peer confirmed that nothing of it is written any more
        self.polling: Polling | None = None  # short enough for its waiter to poll for its end (Polling.poll)


class PythonTransferJob(TransferJob):
    """A job of the Python I/O threads: its spans, frames and progress, and the flags those threads poll."""

    __slots__ = ("addr", "bounds", "ends", "inflight", "length", "moved", "next_frame", "offsets", "ready", "stop",
                 "total")

    def __init__(self, kind: str, flag: int, tid: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(kind, flag, tid, loop)
        self.stop = StopFlag()
        self.ready = threading.Event()  # receive jobs: the destination spans are known
        self.inflight = 0
        self.total = 0
        self.moved = 0
        self.addr: UInt64Array = _NO_SPANS
        self.length: UInt64Array = _NO_SPANS
        self.ends: UInt64Array = _NO_SPANS  # receive: running byte sums of the spans
        self.bounds: list[int] = [0]  # send: frame boundaries (span indices)
        self.offsets: list[int] = [0]  # send: stream offset of each frame boundary
        self.next_frame = 0


_NO_SPANS: UInt64Array = np.empty(0, dtype=np.uint64)
_NO_SPANS.flags.writeable = False


class PlaneJob(Protocol):
    """A data plane's job: its future settles once no thread of the plane touches its memory."""

    @property
    def future(self) -> asyncio.Future[None]: ...


JobT = TypeVar("JobT", bound=PlaneJob)


class WaitingMixin(Generic[JobT]):
    """Awaiting a data plane's jobs (every plane): cancellation stops the job, and the waiter returns only once
    no I/O thread touches its memory."""

    def cancel(self, job: JobT, error: BaseException | None = None) -> None:
        raise NotImplementedError

    def ended(self, job: JobT) -> bool:
        """Whether ``job`` ended, its future settled (a plane whose threads say so directly settles it here)."""
        return job.future.done()

    async def settled(self, job: JobT) -> None:
        """Await ``job``'s future, shielded (a cancellation of the caller leaves the job to it), polling for its end
        first where the job is short enough (:attr:`TransferJob.polling`)."""
        if isinstance(job, TransferJob) and job.polling is not None:
            await job.polling.poll(functools.partial(self.ended, job))
        await asyncio.shield(job.future)

    async def wait(self, job: JobT) -> None:
        """Await a job; if the caller is cancelled, stop the job and return only once no thread touches it."""
        try:
            await self.settled(job)
        except asyncio.CancelledError:
            self.cancel(job)
            await self.wait_stopped(job)
            raise

    async def wait_stopped(self, job: JobT) -> None:
        """Wait, through further cancellations, until no thread touches the job's memory (its error, if any, is
        its waiter's business; a cancellation meanwhile is re-raised)."""
        with contextlib.suppress(Exception):
            await wait_through_cancellation(job.future)


def _retrieved(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


def plan_grid(plan: CopyPlan, tensor_addrs: npt.NDArray[Any], src: bool) -> Grid:
    """One side of ``plan`` as a :data:`Grid` (``src``: its source side) over tensors at ``tensor_addrs``; the
    runs' lengths are ``plan.runs.length``.  A few small arrays, whatever the number of spans."""
    tensors, offsets = (plan.src_tensor, plan.runs.src_offset) if src else (plan.dst_tensor, plan.runs.dst_offset)
    return np.ascontiguousarray(tensor_addrs[tensors], dtype=np.uint64), np.ascontiguousarray(offsets)


def grid_spans(grid: Grid, lengths: npt.NDArray[Any]) -> tuple[UInt64Array, UInt64Array]:
    """A grid's spans in stream order (addresses, lengths), merged where the memory continues."""
    bases, offsets = grid
    start = (np.asarray(bases, dtype=np.uint64)[:, None] + offsets.astype(np.uint64)[None, :]).ravel()
    length = np.broadcast_to(lengths.astype(np.uint64), (len(bases), len(lengths))).ravel()
    merged, _, merged_length = coalesce(start, start, length)  # both "sides" this end: merged where it continues
    return merged.astype(np.uint64, copy=False), np.ascontiguousarray(merged_length, dtype=np.uint64)
