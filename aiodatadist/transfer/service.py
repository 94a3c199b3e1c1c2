"""Pulls and pushes between linked clusters (same host: direct copies between the two processes' memories).

The requester sends ``BEGIN`` with what it wants; the owner resolves the key at that moment, validates the
whole transfer against both caches' geometry, takes a lease on its cache and answers with the cache's
addresses.  The requester computes the same plan, copies the bytes itself (mapping the owner's shared-memory
segment, or with ``process_vm_readv``/``writev``) and ends with ``END``, which drops the lease and, for a
successful pull by ``CacheKey``, releases that key on the owner.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._checks import check_int, require
from ..cache_manager import STREAMING_THRESHOLD
from ..errors import LLMException, LLMLinkError, LLMStatusCode, LLMTimeoutError
from ..layout import CacheGeometry, CopyPlan, TransferParams, plan_side_spans, transfer_plan
from ..protocol.codec import (
    Kind,
    ProtocolError,
    WireKey,
    field,
    geometry_from_wire,
    geometry_to_wire,
    int_field,
    opt_int_list,
    range_from_wire,
    range_to_wire,
    segment_from_wire,
    segment_to_wire,
    uint64_array,
)
from ..registry import CacheEntry
from ..stats import StatsRecorder
from ..transport.device import LinkDeviceState
from ..transport.directory import Resolved
from ..transport.tcp.native_plane import NativeDataPlane
from ..transport.tcp.python_plane import PULL, PUSH, TransferJob
from ..types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex

if TYPE_CHECKING:
    from ..control.links import Link
    from ..datadist import LLMDataDist

__all__ = ["TransferService", "wire_key"]

log = logging.getLogger("aiodatadist.transfer.service")
# geometry, tensor addresses, shared-memory segment (or None), device allocations to open by IPC (or None)
Descriptor = tuple[CacheGeometry, "np.ndarray[Any, np.dtype[np.uint64]]", Any, Any]
MAX_IPC_ALLOCATIONS = 4096
"""An owner's cache as the requester knows it: geometry, tensor addresses, shared-memory segment (or None)."""
END_ACK_TIMEOUT = 1.0
STOP_ACK_TIMEOUT = 1.0  # a cut-short TCP push waits this long for the owner to stop writing, then drops the link
SLOW_STOP_ACK = 0.05  # a confirmation slower than this is logged, with the owner's own share of it
S = LLMStatusCode


def transfer_id(running: set[int]) -> int:
    """A fresh transfer id: random, so that it is also the transfer's token on the data connections.

    A TCP frame is written only into a transfer its receiving end registered under that id, which the
    authenticated control plane agreed; 62 random bits cannot be guessed by whoever else reaches the port.
    """
    while True:
        tid = secrets.randbits(62)
        if tid and tid not in running:
            return tid


def wire_key(key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey) -> WireKey:
    if isinstance(key, CacheKeyByIdAndIndex):
        return WireKey("id", key.cache_id, key.batch_index)
    if isinstance(key, BlocksCacheKey):
        return WireKey("blocks", check_int("model_id", key.model_id, "uint64"), 0)
    kind, ident, model = key.index_key()
    return WireKey(kind, ident, model)


def params_to_wire(p: TransferParams) -> dict[str, Any]:
    return {
        "op": p.op, "api": p.api, "sb": list(p.src_blocks), "db": list(p.dst_blocks),
        "sr": range_to_wire(p.src_layer_range), "dr": range_to_wire(p.dst_layer_range),
        "n": p.tensor_num_per_layer, "size": p.size, "slot": p.local_slot,
    }


def params_from_wire(m: dict[str, Any]) -> TransferParams:
    op, api = field(m, "op", str), field(m, "api", str)
    if op not in ("pull", "push") or api not in ("cache", "blocks"):
        raise ProtocolError("unknown transfer kind")
    return TransferParams(
        op=op, api=api,
        src_blocks=tuple(opt_int_list(m, "sb", 0, 2**63 - 1)), dst_blocks=tuple(opt_int_list(m, "db", 0, 2**63 - 1)),
        src_layer_range=range_from_wire(m.get("sr")), dst_layer_range=range_from_wire(m.get("dr")),
        tensor_num_per_layer=int_field(m, "n", 1, 2**32 - 1), size=int_field(m, "size", -1, 2**63 - 1),
        local_slot=int_field(m, "slot", 0, 2**32 - 1),
    )


def _parse_descriptor(value: Any) -> Descriptor:
    """An owner's cache descriptor: geometry, tensor addresses (inside its segment, if any), segment."""
    if not isinstance(value, dict):
        raise ProtocolError("invalid cache descriptor")
    geometry = geometry_from_wire(value.get("geometry"))
    addrs = uint64_array(value, "addrs")
    segment = segment_from_wire(value.get("segment"))
    if len(addrs) != geometry.num_tensors or not _addrs_inside(addrs, geometry.tensor_size, segment):
        raise ProtocolError("the owner announced addresses outside its cache")
    return geometry, addrs, segment, _ipc_from_wire(value.get("ipc"))


def _ipc_from_wire(value: Any) -> list[tuple[bytes, int, int]] | None:
    """A device cache's allocations ``[handle, base, size]``, sorted by base (None: a host cache)."""
    if value is None:
        return None
    if not (isinstance(value, list) and 0 < len(value) <= MAX_IPC_ALLOCATIONS):
        raise ProtocolError("invalid device allocations")
    out = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], bytes) and len(item[0]) == 64
                and all(type(v) is int and 0 < v < 2**64 for v in item[1:]) and item[1] + item[2] < 2**64):
            raise ProtocolError("invalid device allocation")
        out.append((item[0], item[1], item[2]))
    return sorted(out, key=lambda item: item[1])


async def _shielded(coro: Any) -> None:
    """Run ``coro`` to its end even if the caller is cancelled meanwhile (the cancellation is re-raised after)."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError


def _published_from_wire(value: Any) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)):
        raise ProtocolError("invalid directory entry")
    return value[0], value[1]


def _addrs_inside(addrs: np.ndarray, tensor_size: int, segment: tuple[Any, int] | None) -> bool:
    if segment is None:
        return True
    identity, base = segment
    return bool(((addrs >= base) & (addrs + np.uint64(tensor_size) <= base + identity.size)).all())


class TransferService:
    """Requester and owner sides of pull/push for one :class:`LLMDataDist`."""

    def __init__(self, datadist: LLMDataDist) -> None:
        self._dd = datadist
        self._pulling_keys: set[tuple[str, int, int]] = set()
        self.stats = StatsRecorder()

    # -- requester side --------------------------------------------------------------------------------------
    async def run(self, key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, local: CacheEntry,
                  params: TransferParams) -> None:
        """One pull or push, bounded by ``sync_kv_timeout``; raises ``LLMTimeoutError`` on expiry."""
        timeout_ms = self._dd.settings.sync_kv_timeout_ms
        started = time.perf_counter()
        failure: str | None = "LLM_FAILED"
        nbytes = 0
        try:
            try:
                async with asyncio.timeout(timeout_ms / 1000):
                    release, nbytes = await self._run(key, local, params)
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
            links = self._dd._links
            link = links.links.get(key.cluster_id) if links is not None else None
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

    async def _run(self, key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, local: CacheEntry,
                   params: TransferParams) -> tuple[Awaitable[Any] | None, int]:
        """Do the transfer; returns the owner's pending key-release acknowledgement (if any) and the bytes."""
        links = self._dd._links_or_raise()
        require(key.cluster_id != self._dd.cluster_id, "data can not be pulled from own cluster.")
        link = links.links.get(key.cluster_id)
        if link is None:
            raise LLMException(f"cluster {key.cluster_id} is not linked", status_code=S.LLM_NOT_YET_LINK)
        wkey = wire_key(key)
        tcp = link.plane == "tcp"
        if tcp and local.on_device:
            raise LLMException(f"device caches move only between processes on one host (CUDA IPC); the link to "
                               f"cluster {key.cluster_id} uses TCP", status_code=S.LLM_FEATURE_NOT_ENABLED)
        if tcp:
            remembered = link.resolved.get((wkey.kind, wkey.a, wkey.b)) if params.op == "pull" else None
            if remembered is not None:
                moved = await self._read_published(link, wkey, remembered, local, params)
                if moved is not None:
                    return None, moved
        else:
            resolved = self._published(link, wkey)
            if resolved is not None:
                return None, await self._run_published(link, wkey, resolved, local, params)
        if tcp and link.data is None:
            raise LLMLinkError(f"the link to cluster {key.cluster_id} has no data connections")
        manager = self._dd.cache_manager
        tid = transfer_id(link.running)
        pull = params.op == "pull"
        consumes_key = pull and wkey.kind in ("req", "prefix")
        ok = ended = streaming = False
        link.running.add(tid)
        with manager.registry.lease(local):
            # A TCP pull's receiving end exists before BEGIN: the owner starts sending as soon as it accepts.
            receiving = link.data.receive(PULL, tid) if tcp and pull and link.data is not None else None
            try:
                reply = await link.channel.request(Kind.BEGIN, {
                    "tid": tid, "key": wkey.to_wire(), "peer": geometry_to_wire(local.geometry),
                    "known": list(link.descriptors), **params_to_wire(params),
                })
                plan, descriptor = self._plan_from_reply(link, wkey, reply, local, params)
                if tid in link.aborted:
                    raise LLMException(f"cluster {key.cluster_id} released the cache before the copy started",
                                       status_code=S.LLM_KV_CACHE_NOT_EXIST)
                if tcp:
                    streaming = True
                    await self._stream(link, tid, plan, local, pull, receiving)
                    if not pull:  # the bytes are sent; the owner confirms once they have all landed
                        await link.channel.request(Kind.END, {"tid": tid, "ok": True, "confirm": True})
                        ended = True
                else:
                    await self._copy(link, tid, plan, descriptor, local, params)
                ok = True
            finally:
                if receiving is not None and not receiving.done and link.data is not None:
                    link.data.cancel(receiving)  # BEGIN failed or was cancelled: drop what may still come
                    await link.data.wait_stopped(receiving)
                # Always end the transfer on the owner (it may have taken a lease even if we never saw the
                # reply).  Only a successful pull by CacheKey waits, so that the key is gone on return.
                link.aborted.discard(tid)
                link.running.discard(tid)
                if streaming and not pull and not ended:
                    # Bytes we sent may still sit in socket buffers: the push returns only once the owner
                    # confirmed that its receiving end stopped writing.
                    await _shielded(self._stop_remote_receive(links, link, tid))
                elif not ended and not (ok and consumes_key):
                    links.notify(link, Kind.END, {"tid": tid, "ok": ok})
        if ok and consumes_key:
            return link.channel.request(Kind.END, {"tid": tid, "ok": True}), plan.total_bytes
        return None, plan.total_bytes

    @staticmethod
    async def _stop_remote_receive(links: Any, link: Link, tid: int) -> None:
        started = time.perf_counter()
        try:
            async with asyncio.timeout(STOP_ACK_TIMEOUT):
                reply = await link.channel.request(Kind.END, {"tid": tid, "ok": False})
            took = time.perf_counter() - started
            if took > SLOW_STOP_ACK:
                owner = reply.get("waited")
                log.warning("cluster %d took %.1f ms to confirm the end of a cut-short push (its receiving end "
                            "stopped after %s ms)", link.remote_cluster_id, took * 1e3,
                            f"{owner:.1f}" if isinstance(owner, float) else "?")
        except (LLMException, TimeoutError):
            if not link.closed:  # it may still write what it receives: the link cannot be trusted any more
                await links.drop(link, LLMLinkError(
                    f"cluster {link.remote_cluster_id} did not confirm the end of a cut-short push; link dropped"))

    async def _stream(self, link: Link, tid: int, plan: CopyPlan, local: CacheEntry, pull: bool,
                      receiving: TransferJob | None) -> None:
        """Move the bytes over the link's data connections (the caller holds a lease on ``local``)."""
        plane = link.data
        assert plane is not None
        if pull:
            assert receiving is not None
            plane.set_destination(receiving, *plan_side_spans(plan, local.addrs, "dst"))
            job = receiving
        else:
            job = plane.send(PUSH, tid, *plan_side_spans(plan, local.addrs, "src"))
        link.tcp_jobs[tid] = job
        try:
            await plane.wait(job)
        finally:
            link.tcp_jobs.pop(tid, None)

    async def _copy(self, link: Link, tid: int, plan: CopyPlan, descriptor: Descriptor, local: CacheEntry,
                    params: TransferParams) -> None:
        """Move the bytes (the caller holds a lease on ``local``); link closure cancels the job."""
        manager = self._dd.cache_manager
        geometry, remote_addrs, segment, ipc = descriptor
        pull = params.op == "pull"
        # The peer may free this cache meanwhile (FREED): its mapping here stays until the copy is done.
        held = link.memory.hold(segment[0]) if segment is not None else None
        device = None
        try:
            if ipc is not None:
                device = self._link_device(link)
                device.hold(ipc)
            if local.on_device or ipc is not None:  # the GPU copies (see aiodatadist.transport.device)
                remote = self._device_view(link, geometry, remote_addrs, segment, ipc)
                mine = manager.device_addrs(local)
                src, dst = (remote, mine) if pull else (mine, remote)
                job = manager.start_job(plan, src, dst, None, (local,), on_device=True)
            else:
                copy = link.memory.copier(remote_is_src=pull, segment=segment,
                                          streaming=plan.total_bytes >= STREAMING_THRESHOLD)
                src, dst = (remote_addrs, local.addrs) if pull else (local.addrs, remote_addrs)
                job = manager.start_job(plan, src, dst, copy, (local,))
            link.jobs[tid] = job
            try:
                await manager.wait_job(job, (local,))
            finally:
                link.jobs.pop(tid, None)
        except OSError as exc:
            if isinstance(exc, LLMException):  # LLMTimeoutError / LLMLinkError are OSErrors too
                raise
            raise LLMLinkError(f"copy with cluster {link.remote_cluster_id} failed: {exc}") from exc
        finally:
            if held is not None:
                link.memory.release(held)
            if device is not None and ipc is not None:
                device.release(ipc)

    def _link_device(self, link: Link) -> LinkDeviceState:
        if link.device is None:
            link.device = LinkDeviceState(self._dd.cache_manager.device(), link.caps.pid == os.getpid())
        return link.device

    def _device_view(self, link: Link, geometry: CacheGeometry, remote_addrs: np.ndarray, segment: Any,
                     ipc: list[tuple[bytes, int, int]] | None) -> np.ndarray:
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
        return remote_addrs + np.uint64((local_base - remote_base + delta) % 2**64)

    @staticmethod
    def _published(link: Link, wkey: WireKey) -> Resolved | None:
        """The owner's cache for ``wkey`` if an earlier transfer resolved it and the directory says it is live."""
        if link.directory is None:
            return None
        resolved = link.resolved.get((wkey.kind, wkey.a, wkey.b))
        if resolved is None:
            return None
        if link.directory.live(resolved.row, resolved.stamp, resolved.cache_id, resolved.model_id):
            return resolved
        del link.resolved[(wkey.kind, wkey.a, wkey.b)]  # released or re-keyed: ask the owner again
        return None

    async def _read_published(self, link: Link, wkey: WireKey, resolved: Resolved, local: CacheEntry,
                              params: TransferParams) -> int | None:
        """A TCP pull of a cache the owner resolved before: one-sided, served by the owner's native threads.

        Returns None (after forgetting the resolution) when the owner says the cache is no longer the one
        resolved (released or re-keyed): the caller then asks the owner again."""
        plane = link.data
        assert plane is not None and isinstance(plane, NativeDataPlane)
        owner_geometry, owner_addrs, _, _ = link.descriptors[resolved.cache_id]
        plan = transfer_plan(params, local.geometry, owner_geometry, resolved.slot)
        tid = transfer_id(link.running)
        with self._dd.cache_manager.registry.lease(local):
            job = plane.read(tid, resolved.row, resolved.stamp, resolved.cache_id, resolved.model_id,
                             plan_side_spans(plan, owner_addrs, "src"), plan_side_spans(plan, local.addrs, "dst"))
            link.tcp_jobs[tid] = job
            try:
                await plane.wait(job)
            except LLMException as exc:
                if exc.status_code != S.LLM_KV_CACHE_NOT_EXIST:
                    raise
                link.resolved.pop((wkey.kind, wkey.a, wkey.b), None)
                return None
            finally:
                link.tcp_jobs.pop(tid, None)
        return plan.total_bytes

    async def _run_published(self, link: Link, wkey: WireKey, resolved: Resolved, local: CacheEntry,
                             params: TransferParams) -> int:
        """A transfer on a published cache: validated here against the owner's descriptor, no round trip."""
        descriptor = link.descriptors[resolved.cache_id]
        plan = transfer_plan(params, local.geometry, descriptor[0], resolved.slot)
        local.leases += 1  # (registry.lease, inline on this hot path)
        try:
            await self._copy(link, transfer_id(link.running), plan, descriptor, local, params)
        finally:
            self._dd.cache_manager.registry.release_lease(local)
        assert link.directory is not None
        if not link.directory.live(resolved.row, resolved.stamp, resolved.cache_id, None):
            link.resolved.pop((wkey.kind, wkey.a, wkey.b), None)
            raise LLMException(f"cluster {link.remote_cluster_id} released cache {resolved.cache_id} during the "
                               "transfer", status_code=S.LLM_KV_CACHE_NOT_EXIST)
        return plan.total_bytes

    def _plan_from_reply(self, link: Link, wkey: WireKey, reply: dict[str, Any], local: CacheEntry,
                         params: TransferParams) -> tuple[CopyPlan, Descriptor]:
        try:
            owner_slot = int_field(reply, "slot", 0, 2**32 - 1)
            cid = int_field(reply, "cid", 1, 2**63 - 1)
            described = reply.get("desc")
            if described is not None:
                link.descriptors[cid] = _parse_descriptor(described)
            descriptor = link.descriptors.get(cid)
            if descriptor is None:
                raise ProtocolError(f"no descriptor for cache {cid}")
            published = reply.get("pub")
            one_sided = link.directory is not None or (
                link.plane == "tcp" and link.peer_serves_reads and isinstance(link.data, NativeDataPlane)
                and wkey.a < 2**63)
            if published is not None and one_sided and wkey.kind in ("id", "blocks"):
                row, stamp = _published_from_wire(published)
                model = wkey.a if wkey.kind == "blocks" else None
                link.resolved[(wkey.kind, wkey.a, wkey.b)] = Resolved(cid, owner_slot, row, stamp, model)
        except ProtocolError as exc:
            raise LLMLinkError(f"malformed reply from the owner: {exc}") from None
        return transfer_plan(params, local.geometry, descriptor[0], owner_slot), descriptor

    # -- owner side ------------------------------------------------------------------------------------------
    async def handle(self, link: Link, message: dict[str, Any]) -> dict[str, Any] | None:
        kind = message["k"]
        if kind == Kind.BEGIN:
            return self._begin(link, message)
        if kind == Kind.END:
            lease = link.leases.get(int_field(message, "tid", 0))
            if lease is not None and lease.job is not None and not lease.job.done:
                links = self._dd._links_or_raise()
                links.spawn(self._end_streamed(link, message), name="end-streamed")
                return None  # answered once the owner's end of the stream is settled
            self._end(link, message)
            return {}
        if kind == Kind.ABORT:
            self._abort(link, message)
            return None
        if kind == Kind.FREED:
            self._freed(link, message)
            return None
        raise ProtocolError(f"unexpected request {kind!r}")

    def _begin(self, link: Link, message: dict[str, Any]) -> dict[str, Any]:
        tid = int_field(message, "tid", 0)
        key = WireKey.from_wire(message.get("key"))
        params = params_from_wire(message)
        peer_geometry = geometry_from_wire(message.get("peer"))
        known = set(opt_int_list(message, "known", 1, 2**63 - 1))
        require(tid not in link.leases, f"transfer {tid} is already running.")
        registry = self._dd.cache_manager.registry
        entry, slot = registry.resolve_wire(key.kind, key.a, key.b)
        require(entry.remote_accessible, f"cache {entry.cache_id} is not remote accessible.")
        if entry.on_device and link.plane == "tcp":
            raise LLMException(f"cache {entry.cache_id} is a device cache: it moves only to a process on this host "
                               "(CUDA IPC), and this link uses TCP", status_code=S.LLM_FEATURE_NOT_ENABLED)
        if params.op == "push":
            require(key.kind in ("id", "blocks"), "push addresses the destination by cache id or BlocksCacheKey.")
        plan = transfer_plan(params, peer_geometry, entry.geometry, slot)  # validates the owner's side too
        release_key = (key.kind, key.a, key.b) if params.op == "pull" and key.kind in ("req", "prefix") else None
        if release_key is not None:
            # A pull by CacheKey consumes the key: a second pull of it while the first runs is a duplicate.
            if release_key in self._pulling_keys:
                raise LLMException(f"cache key {release_key} is already being pulled",
                                   status_code=S.LLM_REPEAT_REQUEST)
            self._pulling_keys.add(release_key)
        registry.acquire(entry)
        from ..control.links import Lease

        lease = link.leases[tid] = Lease(entry, release_key)
        if link.plane == "tcp" and link.data is not None:
            try:
                if params.op == "pull":  # start sending now: the requester's receiving end already exists
                    lease.job = link.data.send(PULL, tid, *plan_side_spans(plan, entry.addrs, "src"))
                else:
                    lease.job = link.data.receive(PUSH, tid)
                    link.data.set_destination(lease.job, *plan_side_spans(plan, entry.addrs, "dst"))
            except LLMException:
                del link.leases[tid]
                registry.release_lease(entry)
                if release_key is not None:
                    self._pulling_keys.discard(release_key)
                raise
        reply: dict[str, Any] = {"cid": entry.cache_id, "slot": slot}
        if entry.published is not None:
            reply["pub"] = list(entry.published)
        if entry.cache_id not in known:  # a cache's layout never changes: described once per requester
            reply["desc"] = {
                "geometry": geometry_to_wire(entry.geometry), "addrs": entry.addrs.tolist(),
                "segment": segment_to_wire(entry.segment.identity if entry.segment else None,
                                           entry.segment.address if entry.segment else 0),
            }
            if entry.on_device:
                exported = self._dd.cache_manager.device().ipc_export(entry.addrs, entry.desc.size)
                entry.exported.update(handle for handle, _, _ in exported)
                reply["desc"]["ipc"] = exported
        return reply

    def _end(self, link: Link, message: dict[str, Any]) -> None:
        tid = int_field(message, "tid", 0)
        ok = field(message, "ok", bool)
        lease = link.leases.pop(tid, None)
        if lease is None:
            return
        if lease.release_key is not None:
            self._pulling_keys.discard(lease.release_key)
        registry = self._dd.cache_manager.registry
        if ok and lease.release_key is not None:
            registry.release_key_after_pull(lease.release_key, lease.entry)
        registry.release_lease(lease.entry)

    async def _end_streamed(self, link: Link, message: dict[str, Any]) -> None:
        """END of a TCP transfer whose owner-side job is still running: a confirmed push waits until every byte
        landed; anything else stops the job.  The lease is released only once no thread touches the cache."""
        tid = int_field(message, "tid", 0)
        ok, confirm = field(message, "ok", bool), message.get("confirm") is True
        lease, plane = link.leases.get(tid), link.data
        if lease is None or lease.job is None or plane is None:  # a second END for this transfer: already settled
            await link.channel.reply(message["i"], {})
            return
        code, text = 0, ""
        started = time.perf_counter()
        try:
            if ok and (confirm or lease.job.kind == "send"):
                await plane.wait(lease.job)
            else:
                plane.cancel(lease.job)
                await plane.wait_stopped(lease.job)
        except LLMException as exc:
            code, text, ok = int(exc.status_code), str(exc), False
        finally:
            self._end(link, {"tid": tid, "ok": ok})
        await link.channel.reply(message["i"], {"waited": (time.perf_counter() - started) * 1e3}, code=code, msg=text)

    def _abort(self, link: Link, message: dict[str, Any]) -> None:
        """The owner released the cache of a running transfer: stop our copy at the next chunk."""
        tid = int_field(message, "tid", 0)
        error = LLMException(f"cluster {link.remote_cluster_id} released the cache during the transfer",
                             status_code=S.LLM_KV_CACHE_NOT_EXIST)
        streamed = link.tcp_jobs.get(tid)
        if streamed is not None and link.data is not None:
            link.data.cancel(streamed, error)
            return
        job = link.jobs.get(tid)
        manager = self._dd._cache_manager
        if job is None:
            if tid in link.running:
                link.aborted.add(tid)  # the copy has not started yet: it must not start at all
        elif manager is not None:
            manager.cancel_job(job, error)

    def _freed(self, link: Link, message: dict[str, Any]) -> None:
        """The peer freed a cache: forget its description and let go of what maps it here (once idle)."""
        cid = int_field(message, "cid", 1, 2**63 - 1)
        link.descriptors.pop(cid, None)
        for key, resolved in list(link.resolved.items()):
            if resolved.cache_id == cid:
                del link.resolved[key]
        seg = message.get("seg")
        if isinstance(seg, list) and len(seg) == 2 and all(type(v) is int for v in seg):
            device = link.device
            link.memory.forget((seg[0], seg[1]), device.forget_pinned if device is not None else lambda _: None)
        handles = message.get("ipc")
        if isinstance(handles, list) and link.device is not None:
            for handle in handles[:MAX_IPC_ALLOCATIONS]:
                if isinstance(handle, bytes) and len(handle) == 64:
                    link.device.forget_handle(handle)

    def announce_freed(self, entry: CacheEntry) -> None:
        """Owner side: ``entry``'s memory is gone; same-host peers that mapped it let go of their mappings (a
        peer's mapping would otherwise keep freed pages alive until the link closes)."""
        links = self._dd._links
        if links is None:
            return
        body: dict[str, Any] = {"cid": entry.cache_id}
        if entry.segment is not None:
            body["seg"] = [entry.segment.identity.inode, entry.segment.identity.device]
        if entry.exported:
            body["ipc"] = sorted(entry.exported)
        if len(body) == 1:
            return
        for link in list(links.links.values()):
            if link.caps.same_host and not link.closed:
                links.notify(link, Kind.FREED, body)

    def abort_remote(self, entry: CacheEntry) -> None:
        """Ask requesters whose running transfers use ``entry`` (being released) to stop."""
        links = self._dd._links
        if links is None:
            return
        for link in links.links.values():
            for tid, lease in link.leases.items():
                if lease.entry is entry:
                    if lease.job is not None and link.data is not None:
                        link.data.cancel(lease.job)  # our own I/O threads stop touching it too
                    links.notify(link, Kind.ABORT, {"tid": tid})

    async def on_link_closed(self, link: Link, error: LLMException) -> None:
        """Stop the requester-side copies on this link and drop the owner-side leases."""
        manager = self._dd._cache_manager
        if manager is not None:
            for job in list(link.jobs.values()):
                manager.cancel_job(job, error)
            for job in list(link.jobs.values()):
                await manager.wait_stopped(job)
            for lease in link.leases.values():
                manager.registry.release_lease(lease.entry)
                if lease.release_key is not None:
                    self._pulling_keys.discard(lease.release_key)
        link.leases.clear()
        if link.device is not None:  # no GPU copy uses the peer's memory any more
            link.device.close()
            link.device = None
