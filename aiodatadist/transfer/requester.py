"""Requester side of pulls and pushes: one deadline, and the round-trip, published and one-sided paths.

The requester sends ``BEGIN`` with what it wants; the owner resolves the key at that moment, validates the
whole transfer, takes a lease on its cache and answers with the cache's addresses.  The requester computes the
same plan, copies the bytes itself (mapping the owner's shared-memory segment, or with
``process_vm_readv``/``writev``; on the TCP plane its data plane receives or sends them) and ends with ``END``.
A cache the owner published in its directory (same host) or one-sided TCP reads skip the round trip.

A transfer's notification (``notify=``) goes to the owner only once the transfer succeeded: in ``END`` (for a TCP
push, the confirmed one: the owner delivers it once every byte landed), or, on the paths without a round trip, as a
NOTIFY sent right after the data is complete.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable
from typing import Any

import numpy as np

from .._checks import I64_MAX, U64_LIMIT, check_int, require
from .._settings import Settings
from ..control.links import Link, LinkManager
from ..copy.completion import wait_through_cancellation
from ..copy.spans import STREAMING_THRESHOLD
from ..errors import LLMException, LLMLinkError, LLMStatusCode, LLMTimeoutError
from ..layout import CacheGeometry, CopyPlan, TransferParams, plan_side_spans, transfer_plan
from ..memory import SegmentIdentity
from ..protocol.codec import ProtocolError
from ..protocol.messages import (
    Abort,
    Begin,
    BeginReply,
    Descriptor,
    End,
    EndReply,
    Freed,
    IpcAllocation,
    Notify,
    WireKey,
)
from ..registry import CacheEntry, CacheRegistry
from ..stats import StatsRecorder
from ..transport.base import PULL, PUSH, TransferJob
from ..transport.device import LinkDeviceState
from ..transport.directory import Resolved
from ..transport.nixl import NixlPlane
from ..transport.tcp.native_plane import NativeDataPlane
from ..types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from .engine import CopyEngine
from .nixl_caches import NixlCaches
from .state import LinkTransfers, TransferStates, transfer_id

__all__ = ["Requester"]

log = logging.getLogger("aiodatadist.transfer")
END_ACK_TIMEOUT = 1.0
STOP_ACK_TIMEOUT = 1.0  # a cut-short TCP push waits this long for the owner to stop writing, then drops the link
SLOW_STOP_ACK = 0.05  # a confirmation slower than this is logged, with the owner's own share of it
S = LLMStatusCode


def wire_key(key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey) -> WireKey:
    """A cache key as the owner indexes it."""
    if isinstance(key, CacheKeyByIdAndIndex):
        return WireKey("id", key.cache_id, key.batch_index)
    if isinstance(key, BlocksCacheKey):
        return WireKey("blocks", check_int("model_id", key.model_id, "uint64"), 0)
    kind, ident, model = key.index_key()
    return WireKey(kind, ident, model)


class Requester:
    """The requester side of every link of one instance."""

    def __init__(self, cluster_id: int, settings: Settings, links: LinkManager, registry: CacheRegistry,
                 engine: CopyEngine, states: TransferStates, stats: StatsRecorder, nixl: NixlCaches) -> None:
        self._cluster_id = cluster_id
        self._nixl = nixl
        self._settings = settings
        self._links = links
        self._registry = registry
        self._engine = engine
        self._states = states
        self.stats = stats

    async def run(self, key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, local: CacheEntry,
                  params: TransferParams, note: bytes | None = None) -> None:
        """One pull or push, bounded by ``sync_kv_timeout``; raises ``LLMTimeoutError`` on expiry.  ``note``: a
        notification for the owner, sent only if the transfer succeeds."""
        timeout_ms = self._settings.sync_kv_timeout_ms
        started = time.perf_counter()
        failure: str | None = "LLM_FAILED"
        nbytes = 0
        try:
            try:
                async with asyncio.timeout(timeout_ms / 1000):
                    release, nbytes = await self._run(key, local, params, note)
            except TimeoutError as exc:
                if isinstance(exc, LLMException):
                    raise
                raise LLMTimeoutError(
                    f"{params.op}_{params.api} from cluster {key.cluster_id} exceeded sync_kv_timeout={timeout_ms} ms"
                ) from None
            failure = None
        except LLMException as exc:
            failure = exc.status_code.name
            raise
        except asyncio.CancelledError:
            failure = "CANCELLED"
            raise
        finally:
            link = self._links.links.get(key.cluster_id)
            self.stats.record(key.cluster_id, params.op, link.plane if link is not None else "",
                              time.perf_counter() - started, nbytes, failure)
        if release is not None:
            # The data is complete: the owner's key release is confirmed outside the deadline (bounded), so a
            # late acknowledgement never turns a finished pull into a timeout.
            try:
                async with asyncio.timeout(END_ACK_TIMEOUT):
                    await release
            except (LLMException, TimeoutError) as exc:
                log.warning("cluster %d did not confirm the end of a pull: %s", key.cluster_id, exc or "timeout")

    def _noted(self, link: Link, note: bytes | None) -> bytes | None:
        """``note``, counted as sent to the link's peer (called when it goes out with a successful transfer)."""
        if note is not None:
            self.stats.notification_sent(link.remote_cluster_id)
        return note

    def _send_note(self, link: Link, note: bytes | None) -> None:
        """A successful transfer without END: its notification goes out on its own (NOTIFY, answer not awaited)."""
        if note is not None:
            self._links.notify(link, Notify(note))
            self._noted(link, note)

    async def _run(self, key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, local: CacheEntry,
                   params: TransferParams, note: bytes | None) -> tuple[Awaitable[Any] | None, int]:
        """Do the transfer; returns the owner's pending key-release acknowledgement (if any) and the bytes."""
        links = self._links
        require(key.cluster_id != self._cluster_id, "data can not be pulled from own cluster.")
        link = links.links.get(key.cluster_id)
        if link is None:
            raise LLMException(f"cluster {key.cluster_id} is not linked", status_code=S.LLM_NOT_YET_LINK)
        st = self._states.of(link)
        wkey = wire_key(key)
        tcp = link.plane == "tcp"
        if tcp and local.on_device:
            raise LLMException(f"device caches move only between processes on one host (CUDA IPC); the link to "
                               f"cluster {key.cluster_id} uses TCP", status_code=S.LLM_FEATURE_NOT_ENABLED)
        if tcp:
            remembered = st.resolved.get((wkey.kind, wkey.a, wkey.b))
            moved = None
            if remembered is not None and params.op == "pull":
                moved = await self._read_published(link, wkey, remembered, local, params)
            elif remembered is not None and self._writable(link, remembered):
                moved = await self._write_published(link, wkey, remembered, local, params)
            if moved is not None:
                self._send_note(link, note)
                return None, moved
        else:
            resolved = self._published(link, wkey)
            if resolved is not None and params.op == "push" and st.descriptors[resolved.cache_id].borrowed:
                resolved = None  # caller-owned memory: a push goes through the owner, so unregistering aborts it
            if resolved is not None:
                moved = await self._run_published(link, wkey, resolved, local, params)
                self._send_note(link, note)
                return None, moved
        if tcp and link.data is None:
            raise LLMLinkError(f"the link to cluster {key.cluster_id} has no data connections")
        tid = transfer_id(st.running)
        pull = params.op == "pull"
        consumes_key = pull and wkey.kind in ("req", "prefix")
        ok = ended = streaming = False
        sent: TransferJob | None = None
        st.running.add(tid)
        with self._registry.lease(local):
            # A TCP pull's receiving end exists before BEGIN: the owner starts sending as soon as it accepts.
            receiving = link.data.receive(PULL, tid) if tcp and pull and link.data is not None else None
            try:
                reply = await link.channel.request(Begin(tid, wkey, local.geometry, params, tuple(st.descriptors)))
                plan, descriptor, cid = self._plan_from_reply(link, wkey, reply, local, params)
                if tid in st.aborted:
                    raise LLMException(f"cluster {key.cluster_id} released the cache before the copy started",
                                       status_code=S.LLM_KV_CACHE_NOT_EXIST)
                if tcp:
                    assert link.data is not None
                    streaming = True
                    if pull:
                        assert receiving is not None
                        link.data.set_destination(receiving, *plan_side_spans(plan, local.addrs, "dst"))
                    else:
                        sent = link.data.send(PUSH, tid, *plan_side_spans(plan, local.addrs, "src"))
                    await self._stream(link, tid, receiving if pull else sent)
                    if not pull:  # the bytes are sent; the owner confirms once they have all landed
                        await link.channel.request(End(tid, True, confirm=True, note=note))
                        ended = True
                        self._noted(link, note)
                elif link.plane == "nixl":
                    await self._move_nixl(link, tid, plan, cid, descriptor, local, pull)
                else:
                    await self._copy(link, tid, plan, descriptor, local, params)
                ok = True
            finally:
                if receiving is not None and not receiving.done and link.data is not None:
                    link.data.cancel(receiving)  # BEGIN failed or was cancelled: drop what may still come
                    await link.data.wait_stopped(receiving)
                # Always end the transfer on the owner (it may have taken a lease even if we never saw the
                # reply).  Only a successful pull by CacheKey waits, so that the key is gone on return.
                st.aborted.discard(tid)
                st.running.discard(tid)
                if streaming and not pull and not ended and not (sent is not None and sent.fenced):
                    # Bytes we sent may still sit in socket buffers: the push returns only once the owner
                    # confirmed that its receiving end stopped writing (its I/O threads answer a fence on the
                    # data connections; a peer without them answers END over the control plane).
                    if self._fenceable(link):
                        await wait_through_cancellation(self._fence_push(links, link, tid))
                        links.notify(link, End(tid, False))  # the owner's lease
                    else:
                        await wait_through_cancellation(self._stop_remote_receive(links, link, tid))
                elif not ended and not (ok and consumes_key):
                    links.notify(link, End(tid, ok, note=self._noted(link, note) if ok else None))
        if ok and consumes_key:
            return link.channel.request(End(tid, True, note=self._noted(link, note))), plan.total_bytes
        return None, plan.total_bytes

    @staticmethod
    def _fenceable(link: Link) -> bool:
        """Both ends' native I/O threads: a cut-short push is fenced on the data connections."""
        return link.peer_serves_reads and isinstance(link.data, NativeDataPlane) and link.data.closed is None

    async def _await_send(self, link: Link, tid: int, job: TransferJob) -> None:
        """Await a push's send or one-sided write job on a fenceable link.  Cancelled, the job stops with its
        fence armed in the same step, and this returns once the owner's I/O threads confirmed that nothing of it
        is written any more (``job.fenced``), with one wake-up of this loop, whatever the owner's loop is doing."""
        plane = link.data
        assert isinstance(plane, NativeDataPlane)
        try:
            await asyncio.shield(job.future)
        except asyncio.CancelledError:
            armed = plane.cancel_fenced(job)
            if armed or self._fenceable(link):
                await wait_through_cancellation(self._fence_push(self._links, link, tid, job if armed else None))
                job.fenced = True
            else:  # the link is closed: nothing is written any more once the job ended
                await plane.wait_stopped(job)
            raise

    @staticmethod
    async def _fence_push(links: Any, link: Link, tid: int, job: TransferJob | None = None) -> None:
        """A cut-short push: returns once the owner's I/O threads confirmed on every data connection that
        nothing of it is written any more, whatever its event loop is doing; drops the link if that does not
        come within :data:`STOP_ACK_TIMEOUT`.  ``job``: its send job, stopped with the fence armed
        (:meth:`NativeDataPlane.cancel_fenced`); None: it has ended, and a fence job of its own is sent."""
        plane = link.data
        assert isinstance(plane, NativeDataPlane)
        if job is None:
            job = plane.fence(PUSH, tid)
        try:
            async with asyncio.timeout(STOP_ACK_TIMEOUT):
                await asyncio.shield(job.future)
            return
        except (LLMException, TimeoutError):
            pass
        if not link.closed:  # it may still write what it receives: the link cannot be trusted any more
            await links.drop(link, LLMLinkError(
                f"cluster {link.remote_cluster_id} did not confirm the end of a cut-short push; link dropped"))
        await plane.wait_stopped(job)  # the job ends with the link (a send job may still have a frame going out)

    @staticmethod
    async def _stop_remote_receive(links: Any, link: Link, tid: int) -> None:
        started = time.perf_counter()
        try:
            async with asyncio.timeout(STOP_ACK_TIMEOUT):
                reply = await link.channel.request(End(tid, False))
            took = time.perf_counter() - started
            if took > SLOW_STOP_ACK:
                owner = EndReply.from_wire(reply).waited
                log.warning("cluster %d took %.1f ms to confirm the end of a cut-short push (its receiving end "
                            "stopped after %s ms)", link.remote_cluster_id, took * 1e3,
                            f"{owner:.1f}" if owner is not None else "?")
        except (LLMException, TimeoutError):
            if not link.closed:  # it may still write what it receives: the link cannot be trusted any more
                await links.drop(link, LLMLinkError(
                    f"cluster {link.remote_cluster_id} did not confirm the end of a cut-short push; link dropped"))

    async def _stream(self, link: Link, tid: int, job: TransferJob | None) -> None:
        """Await a TCP transfer's receive or send job (the caller holds a lease on the local memory); a push
        cut short is fenced here where it can be (:meth:`_await_send`)."""
        st = self._states.of(link)
        plane = link.data
        assert plane is not None and job is not None
        st.tcp_jobs[tid] = job
        try:
            if job.kind == "send" and self._fenceable(link):
                await self._await_send(link, tid, job)
            else:
                await plane.wait(job)
        finally:
            st.tcp_jobs.pop(tid, None)

    async def _copy(self, link: Link, tid: int, plan: CopyPlan, descriptor: Descriptor, local: CacheEntry,
                    params: TransferParams) -> None:
        """Move the bytes (the caller holds a lease on ``local``); link closure cancels the job."""
        st = self._states.of(link)
        engine = self._engine
        geometry, remote_addrs, segment = descriptor.geometry, descriptor.addrs, descriptor.segment
        ipc = list(descriptor.ipc) if descriptor.ipc is not None else None
        pull = params.op == "pull"
        if segment is not None and link.caps.fds:  # a peer under another user hands its segments over (once)
            try:
                await link.memory.ensure(segment[0])
            except OSError as exc:
                raise LLMLinkError(f"cluster {link.remote_cluster_id} did not hand over its cache: {exc}") from exc
        # The peer may free this cache meanwhile (FREED): its mapping here stays until the copy is done.
        held = link.memory.hold(segment[0]) if segment is not None else None
        device = None
        try:
            if ipc is not None:
                device = self._link_device(link)
                device.hold(ipc)
            if local.on_device or ipc is not None:  # the GPU copies (see aiodatadist.transport.device)
                remote = self._device_view(link, geometry, remote_addrs, segment, ipc)
                mine = engine.device_addrs(local)
                src, dst = (remote, mine) if pull else (mine, remote)
                job = engine.start_job(plan, src, dst, None, (local,), on_device=True)
            else:
                copy = link.memory.copier(remote_is_src=pull, segment=segment,
                                          streaming=plan.total_bytes >= STREAMING_THRESHOLD)
                src, dst = (remote_addrs, local.addrs) if pull else (local.addrs, remote_addrs)
                job = engine.start_job(plan, src, dst, copy, (local,))
            st.jobs[tid] = job
            try:
                await engine.wait_job(job, (local,))
            finally:
                st.jobs.pop(tid, None)
        except OSError as exc:
            if isinstance(exc, LLMException):  # LLMTimeoutError / LLMLinkError are OSErrors too
                raise
            raise LLMLinkError(f"copy with cluster {link.remote_cluster_id} failed: {exc}") from exc
        finally:
            if held is not None:
                link.memory.release(held)
            if device is not None and ipc is not None:
                device.release(ipc)

    async def _move_nixl(self, link: Link, tid: int, plan: CopyPlan, cid: int, descriptor: Descriptor,
                         local: CacheEntry, pull: bool) -> None:
        """Move the bytes with NIXL (READ for a pull, WRITE for a push); the caller holds a lease on ``local``."""
        st = self._states.of(link)
        plane = self._nixl.plane
        if plane is None:
            raise LLMLinkError("the NIXL plane is not running")
        while st.nixl_rebuilt is not None:
            await asyncio.shield(st.nixl_rebuilt)
        remote = st.nixl_remote.get(cid)
        if remote is None:
            reach = descriptor.nixl
            if reach is None:
                raise LLMLinkError(f"cluster {link.remote_cluster_id} described cache {cid} without NIXL metadata")
            if st.nixl_stale:
                await self._rebuild_nixl_peer(st, plane)
            st.nixl_agent = plane.add_peer(reach.metadata)
            remote = st.nixl_remote[cid] = plane.prepare_remote(st.nixl_agent, descriptor.geometry, descriptor.addrs,
                                                                reach.mem, reach.dev, reach.metadata)
        job = self._nixl.transfer(plan, local, remote, pull)
        st.nixl_jobs[tid] = job
        try:
            await plane.wait(job)
        except LLMLinkError as exc:  # NIXL's connection to the peer broke, as a TCP data connection would
            if not link.closed:
                await wait_through_cancellation(self._links.drop(link, exc))
            raise
        finally:
            st.nixl_jobs.pop(tid, None)
            if job.stuck and not link.closed:  # NIXL may still move bytes of it: that peer cannot be trusted now
                await wait_through_cancellation(self._links.drop(link, LLMLinkError(
                    f"a cancelled NIXL transfer with cluster {link.remote_cluster_id} did not stop; link dropped")))

    @staticmethod
    async def _rebuild_nixl_peer(st: LinkTransfers, plane: NixlPlane) -> None:
        """The peer freed caches this agent loaded: their stale regions could shadow a new cache at the same
        addresses (NIXL cannot forget one region), so load the peer agent again from its live caches only, once
        the link's running NIXL jobs are done (new ones wait)."""
        st.nixl_stale = False
        rebuilt = st.nixl_rebuilt = asyncio.get_running_loop().create_future()
        try:
            while st.nixl_jobs:
                await wait_through_cancellation(asyncio.wait([job.future for job in st.nixl_jobs.values()]))
            if st.nixl_agent is not None:
                for remote in st.nixl_remote.values():
                    plane.release_remote(remote)
                plane.remove_peer(st.nixl_agent)
                st.nixl_agent = None
            for cid, remote in list(st.nixl_remote.items()):
                st.nixl_agent = plane.add_peer(remote.metadata)
                st.nixl_remote[cid] = plane.prepare_remote(st.nixl_agent, remote.geometry, remote.addrs, remote.mem,
                                                           remote.dev, remote.metadata)
        finally:
            st.nixl_rebuilt = None
            rebuilt.set_result(None)

    def _link_device(self, link: Link) -> LinkDeviceState:
        st = self._states.of(link)
        if st.device is None:
            st.device = LinkDeviceState(self._engine.device(), link.caps.pid == os.getpid())
        return st.device

    def _device_view(self, link: Link, geometry: CacheGeometry, remote_addrs: np.ndarray,
                     segment: tuple[SegmentIdentity, int] | None, ipc: list[IpcAllocation] | None) -> np.ndarray:
        """The peer's tensors as this process's GPU reaches them: its device memory through IPC, its host
        cache through the mapped segment, page-locked."""
        device = self._link_device(link)
        if ipc is not None:
            return device.remote_delta(ipc, remote_addrs, geometry.tensor_size)
        if segment is None or not link.caps.can_map:
            raise LLMException(f"a GPU copy needs the host cache of cluster {link.remote_cluster_id} mapped in "
                               "this process: allocate it with allocate_cache/allocate_blocks_cache (caller-"
                               "registered host memory is reachable only by process_vm_readv/writev)",
                               status_code=S.LLM_FEATURE_NOT_ENABLED)
        identity, remote_base = segment
        local_base = link.memory.local_base(identity)
        delta = device.pinned_delta(local_base, identity.size)
        return remote_addrs + np.uint64((local_base - remote_base + delta) % U64_LIMIT)

    def _published(self, link: Link, wkey: WireKey) -> Resolved | None:
        """The owner's cache for ``wkey`` if an earlier transfer resolved it and the directory says it is live."""
        st = self._states.of(link)
        if link.directory is None:
            return None
        resolved = st.resolved.get((wkey.kind, wkey.a, wkey.b))
        if resolved is None:
            return None
        if link.directory.live(resolved.row, resolved.stamp, resolved.cache_id, resolved.model_id):
            return resolved
        del st.resolved[(wkey.kind, wkey.a, wkey.b)]  # released or re-keyed: ask the owner again
        return None

    async def _read_published(self, link: Link, wkey: WireKey, resolved: Resolved, local: CacheEntry,
                              params: TransferParams) -> int | None:
        """A TCP pull of a cache the owner resolved before: one-sided, served by the owner's native threads.

        Returns None (after forgetting the resolution) when the owner says the cache is no longer the one
        resolved (released or re-keyed): the caller then asks the owner again."""
        st = self._states.of(link)
        plane = link.data
        assert plane is not None and isinstance(plane, NativeDataPlane)
        descriptor = st.descriptors[resolved.cache_id]
        owner_addrs = descriptor.addrs
        plan = transfer_plan(params, local.geometry, descriptor.geometry, resolved.slot)
        tid = transfer_id(st.running)
        with self._registry.lease(local):
            job = plane.read(tid, resolved.row, resolved.stamp, resolved.cache_id, resolved.model_id,
                             plan_side_spans(plan, owner_addrs, "src"), plan_side_spans(plan, local.addrs, "dst"))
            st.tcp_jobs[tid] = job
            try:
                await plane.wait(job)
            except LLMException as exc:
                if exc.status_code != S.LLM_KV_CACHE_NOT_EXIST:
                    raise
                st.resolved.pop((wkey.kind, wkey.a, wkey.b), None)
                return None
            finally:
                st.tcp_jobs.pop(tid, None)
        return plan.total_bytes

    def _writable(self, link: Link, resolved: Resolved) -> bool:
        """A TCP push into a cache the owner resolved before may go one-sided: both ends run the native I/O
        threads, and the memory is aiodatadist's (a caller-owned cache goes through the owner, so that
        unregistering it stops the push)."""
        descriptor = self._states.of(link).descriptors.get(resolved.cache_id)
        return descriptor is not None and not descriptor.borrowed and self._fenceable(link)

    async def _write_published(self, link: Link, wkey: WireKey, resolved: Resolved, local: CacheEntry,
                               params: TransferParams) -> int | None:
        """A TCP push into a cache the owner resolved before: one-sided, validated and written by the owner's
        native threads, which acknowledge once the bytes landed.

        Returns None (after forgetting the resolution) when the owner says the cache is no longer the one
        resolved (released or re-keyed; nothing of it was written): the caller then asks the owner again.  A
        push cut short returns only once the owner's I/O threads confirmed that nothing of it lands any more."""
        st = self._states.of(link)
        plane = link.data
        assert plane is not None and isinstance(plane, NativeDataPlane)
        descriptor = st.descriptors[resolved.cache_id]
        plan = transfer_plan(params, local.geometry, descriptor.geometry, resolved.slot)
        tid = transfer_id(st.running)
        with self._registry.lease(local):
            job = plane.write(tid, resolved.row, resolved.stamp, resolved.cache_id, resolved.model_id,
                              plan_side_spans(plan, descriptor.addrs, "dst"), plan_side_spans(plan, local.addrs, "src"))
            st.tcp_jobs[tid] = job
            try:
                await self._await_send(link, tid, job)
            except BaseException as exc:
                # Frames of it may still be in socket buffers: fence them before returning or asking again.
                if not job.fenced and self._fenceable(link):
                    await wait_through_cancellation(self._fence_push(self._links, link, tid))
                if isinstance(exc, LLMException) and exc.status_code == S.LLM_KV_CACHE_NOT_EXIST and not link.closed:
                    st.resolved.pop((wkey.kind, wkey.a, wkey.b), None)
                    return None
                raise
            finally:
                st.tcp_jobs.pop(tid, None)
        return plan.total_bytes

    async def _run_published(self, link: Link, wkey: WireKey, resolved: Resolved, local: CacheEntry,
                             params: TransferParams) -> int:
        """A transfer on a published cache: validated here against the owner's descriptor, no round trip."""
        st = self._states.of(link)
        descriptor = st.descriptors[resolved.cache_id]
        plan = transfer_plan(params, local.geometry, descriptor.geometry, resolved.slot)
        local.leases += 1  # (registry.lease, inline on this hot path)
        failure: LLMLinkError | None = None
        try:
            await self._copy(link, transfer_id(st.running), plan, descriptor, local, params)
        except LLMLinkError as exc:  # process_vm_readv of caller memory the owner released meanwhile: EFAULT
            failure = exc
        finally:
            self._registry.release_lease(local)
        assert link.directory is not None
        if link.closed:  # dropped meanwhile: its directory view reads as empty, which says nothing of the cache
            raise failure or LLMLinkError(f"the link to cluster {link.remote_cluster_id} was dropped during the "
                                          "transfer")
        if failure is not None and link.directory.live(resolved.row, resolved.stamp, resolved.cache_id, None):
            raise failure
        if failure is not None or not link.directory.live(resolved.row, resolved.stamp, resolved.cache_id, None):
            st.resolved.pop((wkey.kind, wkey.a, wkey.b), None)
            raise LLMException(f"cluster {link.remote_cluster_id} released cache {resolved.cache_id} during the "
                               "transfer", status_code=S.LLM_KV_CACHE_NOT_EXIST)
        return plan.total_bytes

    def _plan_from_reply(self, link: Link, wkey: WireKey, reply: dict[str, Any], local: CacheEntry,
                         params: TransferParams) -> tuple[CopyPlan, Descriptor, int]:
        st = self._states.of(link)
        try:
            begun = BeginReply.from_wire(reply)
            if begun.desc is not None:
                st.descriptors[begun.cid] = begun.desc
            descriptor = st.descriptors.get(begun.cid)
            if descriptor is None:
                raise ProtocolError(f"no descriptor for cache {begun.cid}")
        except ProtocolError as exc:
            raise LLMLinkError(f"malformed reply from the owner: {exc}") from None
        one_sided = link.directory is not None or (
            link.plane == "tcp" and link.peer_serves_reads and isinstance(link.data, NativeDataPlane)
            and wkey.a <= I64_MAX)
        if begun.pub is not None and one_sided and wkey.kind in ("id", "blocks"):
            row, stamp = begun.pub
            model = wkey.a if wkey.kind == "blocks" else None
            st.resolved[(wkey.kind, wkey.a, wkey.b)] = Resolved(begun.cid, begun.slot, row, stamp, model)
        return transfer_plan(params, local.geometry, descriptor.geometry, begun.slot), descriptor, begun.cid

    def abort(self, link: Link, message: Abort) -> None:
        """The owner released the cache of a running transfer: stop our copy at the next chunk."""
        st = self._states.of(link)
        tid = message.tid
        error = LLMException(f"cluster {link.remote_cluster_id} released the cache during the transfer",
                             status_code=S.LLM_KV_CACHE_NOT_EXIST)
        streamed = st.tcp_jobs.get(tid)
        if streamed is not None and link.data is not None:
            link.data.cancel(streamed, error)
            return
        moving = st.nixl_jobs.get(tid)
        plane = self._nixl.plane
        if moving is not None and plane is not None:
            plane.cancel(moving, error)
            return
        job = st.jobs.get(tid)
        if job is not None:
            self._engine.cancel_job(job, error)
        elif tid in st.running:
            st.aborted.add(tid)  # the copy has not started yet: it must not start at all

    def freed(self, link: Link, message: Freed) -> None:
        """The peer freed a cache: forget its description and let go of what maps it here (once idle)."""
        st = self._states.of(link)
        cid = message.cid
        st.descriptors.pop(cid, None)
        remote = st.nixl_remote.pop(cid, None)
        plane = self._nixl.plane
        if remote is not None and plane is not None:
            plane.release_remote(remote)
            st.nixl_stale = True
        for key, resolved in list(st.resolved.items()):
            if resolved.cache_id == cid:
                del st.resolved[key]
        if message.seg is not None:
            device = st.device
            link.memory.forget(message.seg, device.forget_pinned if device is not None else lambda _: None)
        if st.device is not None:
            for handle in message.ipc:
                st.device.forget_handle(handle)

    async def link_closed(self, state: LinkTransfers, error: LLMException) -> None:
        """Stop the copies of a closed link (returns once no worker touches their memory)."""
        for job in list(state.jobs.values()):
            self._engine.cancel_job(job, error)
        for job in list(state.jobs.values()):
            await self._engine.wait_stopped(job)
        plane = self._nixl.plane
        if plane is not None:
            for moving in list(state.nixl_jobs.values()):
                plane.cancel(moving, error)
            for moving in list(state.nixl_jobs.values()):
                await plane.wait_stopped(moving)
            for remote in state.nixl_remote.values():
                plane.release_remote(remote)
            state.nixl_remote.clear()
            if state.nixl_agent is not None:
                plane.remove_peer(state.nixl_agent)
        if state.device is not None:  # no GPU copy uses the peer's memory any more
            state.device.close()
            state.device = None
