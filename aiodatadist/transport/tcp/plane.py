"""The TCP data planes of a link: two-sided transfers over the link's data connections, and one-sided ones.

:class:`TcpPlane` moves every transfer through the owner: the owner's end sends (pull) or receives (push) on
the data connections once it accepted ``BEGIN``; a push ends with ``END(confirm)``, answered once every byte
landed.  It runs on either connection set (the native helper's threads or the Python fallback).

:class:`NativeTcpPlane` (both ends run the native helper's threads) adds what those threads serve without the
owner's event loop: one-sided reads and writes of caches the owner published before (validated against its
cache directory), and the fence of a cut-short push (FENCE/FENCE_ACK on every connection).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..._aio import wait_through_cancellation
from ..._checks import I64_MAX
from ...errors import LLMException, LLMLinkError, LLMStatusCode
from ...jobs.completion import Polling
from ...layout.plans import CopyPlan
from ...protocol.messages import Descriptor
from ...stats import OneSided
from ..base import PULL, PUSH, TransferJob, plan_grid
from ..directory import Resolved
from ..plane import DataPlane, LocalCache, OfferedSource, OnUntrusted, Route, ServedCache, Transfer
from ..same_host import PeerCapabilities
from .native_connections import NativeConnections
from .python_connections import PythonConnections
from .staging import DeviceStaging

__all__ = ["POLL_RATE", "STOP_ACK_TIMEOUT", "NativeTcpPlane", "TcpPlane"]

STOP_ACK_TIMEOUT = 1.0  # a cut-short push waits this long for the owner to stop writing, then drops the link
POLL_RATE = 2e9
"""Bytes/s a transfer is assumed to move at when deciding whether its end is polled for (:class:`Polling`):
loopback pulls of 4 KiB take 120-230 us and of 512 KiB in 8192 spans 350-450 us on a 2-vCPU VM; a 2 MiB pull
(0.6-0.8 ms) is not polled: there the polling loop took a CPU the I/O threads needed (0.68 -> 0.87 ms)."""
S = LLMStatusCode
Connections = NativeConnections | PythonConnections


class TcpPlane(DataPlane):
    """Transfers through the owner on the link's data connections."""

    kind = "tcp"
    confirms_push = True

    def __init__(self, peer: int, name: str, caps: PeerCapabilities, on_untrusted: OnUntrusted,
                 conns: Connections, staging: DeviceStaging) -> None:
        super().__init__(peer, name, caps, on_untrusted)
        self.conns = conns
        self._staging = staging
        self._polling = Polling(POLL_RATE)

    @property
    def device_path(self) -> str:
        return self._staging.path(self.conns)

    def staging(self) -> dict[str, Any] | None:
        return self.conns.staging() if isinstance(self.conns, NativeConnections) else None

    def _stage(self, receiving: bool) -> NativeConnections:
        """This link's staging ring of one direction, ready (device memory moves through it)."""
        conns = self.conns
        assert isinstance(conns, NativeConnections)  # (refused otherwise: check_local, refusal)
        self._staging.prepare(conns, receiving)
        return conns

    @property
    def connections(self) -> int:
        return self.conns.connections

    @property
    def congestion(self) -> str | None:
        return self.conns.congestion

    # -- requester side --------------------------------------------------------------------------------------
    def check_local(self, local: LocalCache, cluster_id: int) -> None:
        if local.on_device:
            refusal = self._staging.refusal(self.conns, f"this side's cache (the link to cluster {cluster_id})")
            if refusal is not None:
                raise refusal

    def expect(self, tid: int, pull: bool) -> TransferJob | None:
        # A pull's receiving end exists before BEGIN: the owner starts sending as soon as it accepts.
        return self.conns.receive(PULL, tid) if pull else None

    async def move(self, transfer: Transfer) -> None:
        conns, plan = self.conns, transfer.plan
        # This side as a grid: the helper walks it into its frames or its destination, no span list built here.
        grid, lengths = plan_grid(plan, transfer.local.addrs, not transfer.pull), np.ascontiguousarray(plan.runs.length)
        staged = transfer.local.on_device
        if transfer.pull:
            job = transfer.pending
            assert job is not None
            if staged:
                self._stage(True).set_destination(job, grid, lengths, True)
            else:
                conns.set_destination(job, grid, lengths)
        elif staged:
            job = transfer.job = self._stage(False).send(PUSH, transfer.tid, grid, lengths, True)
        else:
            job = transfer.job = conns.send(PUSH, transfer.tid, grid, lengths)
        self._track(transfer, job)
        try:
            await self._await(transfer, job)
        finally:
            self._jobs.pop(transfer.tid, None)

    def _track(self, transfer: Transfer, job: TransferJob) -> None:
        """A transfer's job, awaited from now on (a short one polled for by its waiter)."""
        self._jobs[transfer.tid] = job
        if self._polling.polls(transfer.plan.total_bytes):
            job.polling = self._polling

    async def _await(self, transfer: Transfer, job: TransferJob) -> None:
        await self.conns.wait(job)

    async def discard(self, pending: Any) -> None:
        if isinstance(pending, TransferJob) and not pending.done:
            self.conns.cancel(pending)  # BEGIN failed or was cancelled: drop what may still come
            await self.conns.wait_stopped(pending)

    def needs_fence(self, transfer: Transfer) -> bool:
        job = transfer.job
        return not transfer.pull and job is not None and not job.fenced

    def _cancel(self, job: Any, error: LLMException) -> None:
        self.conns.cancel(job, error)

    # -- owner side ------------------------------------------------------------------------------------------
    def refusal(self, cache_id: int, on_device: bool) -> LLMException | None:
        return self._staging.refusal(self.conns, f"cache {cache_id}") if on_device else None

    def serve(self, tid: int, pull: bool, plan: CopyPlan, cache: ServedCache,
              source: OfferedSource | None) -> TransferJob:
        grid, lengths = plan_grid(plan, cache.addrs, pull), np.ascontiguousarray(plan.runs.length)
        if cache.on_device:
            conns = self._stage(not pull)
            if pull:
                return conns.send(PULL, tid, grid, lengths, True)
            job = conns.receive(PUSH, tid)
            conns.set_destination(job, grid, lengths, True)
            return job
        if pull:  # start sending now: the requester's receiving end already exists
            return self.conns.send(PULL, tid, grid, lengths)
        job = self.conns.receive(PUSH, tid)
        self.conns.set_destination(job, grid, lengths)
        return job

    async def finish_served(self, job: Any, complete: bool) -> None:
        if complete:
            await self.conns.wait(job)
        else:
            self.conns.cancel(job)
            await self.conns.wait_stopped(job)

    def cancel_served(self, job: Any) -> None:
        self.conns.cancel(job)

    def served_done(self, job: Any) -> bool:
        return bool(job.done)

    def publishes(self, tcp_readable: bool) -> bool:
        return tcp_readable

    # -- lifetime and diagnostics ----------------------------------------------------------------------------
    def idle(self) -> bool:
        return super().idle() and not self.conns.running

    def served_one_sided(self) -> OneSided | None:
        return self.conns.served_one_sided()

    async def stop(self, error: LLMException) -> None:
        await super().stop(error)
        await self.conns.aclose(error)


class NativeTcpPlane(TcpPlane):
    """Both ends run the native helper's I/O threads: one-sided reads and writes, fenced pushes."""

    conns: NativeConnections

    def _fenceable(self) -> bool:
        return self.conns.closed is None

    # -- requester side --------------------------------------------------------------------------------------
    def route(self, resolved: Resolved, descriptor: Descriptor | None, pull: bool, local: LocalCache) -> Route:
        if descriptor is None:
            return Route.OWNER
        if pull:
            return Route.ONE_SIDED
        # Into caller-owned memory too: unregistering it withdraws its row (no WRITE frame lands afterwards) and
        # WITHDRAWs this side's running writes first, as on one host.
        return Route.ONE_SIDED if self._fenceable() else Route.OWNER

    def remembers(self, model_id: int) -> bool:
        return model_id <= I64_MAX

    async def move_published(self, transfer: Transfer, resolved: Resolved) -> bool:
        conns, plan, descriptor, local = self.conns, transfer.plan, transfer.descriptor, transfer.local
        where = (resolved.row, resolved.stamp, resolved.cache_id, resolved.model_id)
        # Both sides as grids: a few words on the wire, and no span list built here, however many spans.
        pull = transfer.pull
        src_addrs, dst_addrs = (descriptor.addrs, local.addrs) if pull else (local.addrs, descriptor.addrs)
        src, dst = plan_grid(plan, src_addrs, True), plan_grid(plan, dst_addrs, False)
        lengths = np.ascontiguousarray(plan.runs.length)
        staged = local.on_device  # (this side's device memory through its ring; the owner's is host memory)
        if staged:
            self._stage(pull)
        if pull:
            job = conns.read(transfer.tid, *where, src, lengths, dst, staged)
        else:
            job = transfer.job = conns.write(transfer.tid, *where, dst, lengths, src, staged)
        self._track(transfer, job)
        try:
            if transfer.pull:
                await conns.wait(job)
            else:
                await self._await_written(transfer, job)
        except LLMException as exc:
            if exc.status_code == S.LLM_KV_CACHE_NOT_EXIST and (transfer.pull or self.closed is None):
                return False  # released or re-keyed (nothing of it was written): ask the owner again
            raise
        finally:
            self._jobs.pop(transfer.tid, None)
        return True

    async def _await_written(self, transfer: Transfer, job: TransferJob) -> None:
        try:
            await self._await_send(transfer, job)
        except BaseException:
            # Frames of it may still be in socket buffers: fence them before returning or asking again.
            if not job.fenced and self._fenceable():
                await wait_through_cancellation(self._fence(transfer.tid))
            raise

    async def _await(self, transfer: Transfer, job: TransferJob) -> None:
        if job.kind == "send" and self._fenceable():
            await self._await_send(transfer, job)
        else:
            await self.conns.wait(job)

    async def _await_send(self, transfer: Transfer, job: TransferJob) -> None:
        """Await a push's send or one-sided write job.  Cancelled, the job stops with its fence armed in the same
        step, and this returns once the owner's I/O threads confirmed that nothing of it is written any more
        (``job.fenced``), with one wake-up of this loop, whatever the owner's loop is doing."""
        try:
            await self.conns.settled(job)
        except asyncio.CancelledError:
            armed = self.conns.cancel_fenced(job)
            if armed or self._fenceable():
                await wait_through_cancellation(self._fence(transfer.tid, job if armed else None))
                job.fenced = True
            else:  # the link is closed: nothing is written any more once the job ended
                await self.conns.wait_stopped(job)
            raise

    async def cut_short(self, transfer: Transfer) -> bool:
        if not self._fenceable():
            return False
        await wait_through_cancellation(self._fence(transfer.tid))
        return True

    async def _fence(self, tid: int, job: TransferJob | None = None) -> None:
        """A cut-short push: returns once the owner's I/O threads confirmed on every data connection that
        nothing of it is written any more, whatever its event loop is doing; drops the link if that does not
        come within :data:`STOP_ACK_TIMEOUT`.  ``job``: its send job, stopped with the fence armed
        (:meth:`NativeConnections.cancel_fenced`); None: it has ended, and a fence job of its own is sent."""
        conns = self.conns
        if job is None:
            job = conns.fence(PUSH, tid)
        try:
            async with asyncio.timeout(STOP_ACK_TIMEOUT):
                await asyncio.shield(job.future)
            return
        except (LLMException, TimeoutError):
            pass
        if self.closed is None:  # it may still write what it receives: the link cannot be trusted any more
            await self.untrusted(LLMLinkError(
                f"cluster {self.peer} did not confirm the end of a cut-short push; link dropped"))
        await conns.wait_stopped(job)  # the job ends with the link (a send job may still have a frame going out)

