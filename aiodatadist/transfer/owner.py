"""Owner side of pulls and pushes: resolve the key at ``BEGIN``, validate, lease, and end at ``END``.

The owner resolves the requester's key against its registry at that moment, validates the whole transfer against
both caches' geometry, takes a lease on its cache and answers with the cache's description.  On the same-host
plane the requester copies, but for a large push into memory the owner does not share in place, which the owner
copies itself (reading the requester's memory) and answers once it is done.  ``END`` drops the lease and, for a
successful pull by ``CacheKey``, releases that key; a successful transfer's notification (END's ``note``) is delivered then.  On the TCP plane its data plane sends (pull) or receives (push) the bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._checks import param_invalid, require
from ..copy.engine import CopyEngine
from ..errors import LLMException, LLMStatusCode
from ..layout.plans import transfer_plan
from ..link.link import Link
from ..link.manager import LinkManager
from ..memory import SharedSegment
from ..memory.in_place import InPlaceSegment
from ..protocol.messages import (
    Abort,
    Begin,
    BeginReply,
    Descriptor,
    End,
    EndReply,
    Freed,
    Located,
    Resolve,
    ResolveReply,
    Withdraw,
)
from ..registry.caches import CacheEntry, CacheRegistry
from ..stats import StatsRecorder
from ..transport.plane import OfferedSource
from .state import Lease, LinkTransfers, TransferStates, transfer_id

__all__ = ["Owner"]

log = logging.getLogger("aiodatadist.transfer")
S = LLMStatusCode


class Owner:
    """The owner side of every link of one instance."""

    def __init__(self, links: LinkManager, registry: CacheRegistry, engine: CopyEngine,
                 states: TransferStates, deliver: Callable[[int, bytes], object], stats: StatsRecorder) -> None:
        self._links = links
        self._stats = stats
        self._deliver = deliver  # a notification from a linked cluster
        self._registry = registry
        self._engine = engine
        self._states = states

    def resolve(self, message: Resolve) -> dict[str, Any]:
        """``RESOLVE``: where the requester's raw destination addresses lie among this owner's caches."""
        located = []
        for addr in message.addrs:
            entry, tensor, slot, model = self._registry.locate(addr)
            located.append(Located(entry.cache_id, tensor, slot, entry.is_blocks, model))
        return ResolveReply(tuple(located)).to_wire()

    def begin(self, link: Link, message: Begin, req_id: int) -> dict[str, Any] | None:
        """``BEGIN`` (request ``req_id``): resolve, validate, lease; the reply describes the cache to a requester
        that lacks it.  A push this side copies itself (the plane serves it whole) is answered once copied (None
        here)."""
        started = time.perf_counter()
        try:
            reply = self._begin(link, message, started)
        except LLMException as exc:
            self._stats.served(link.remote_cluster_id, message.params.op, link.plane.kind, time.perf_counter() - started,
                               0, exc.status_code.name)
            raise
        if not reply.get("copies"):
            return reply
        state = self._states.of(link)
        self._links.spawn(self._reply_when_served(link, state, message.tid, reply, req_id), name="begin-served")
        return None

    async def _reply_when_served(self, link: Link, state: LinkTransfers, tid: int, reply: dict[str, Any],
                                 req_id: int) -> None:
        """Answer ``BEGIN`` of a push this side copies once every byte landed (the requester then ends it with
        ``END``), or with the copy's failure (the transfer is over here then)."""
        lease = state.leases.get(tid)
        if lease is None or lease.job is None:  # ended meanwhile (the link closed)
            return
        try:
            await link.plane.finish_served(lease.job, True)
        except LLMException as exc:
            self._end(link, state, tid, False, None, exc.status_code.name)
            await link.channel.reply(req_id, code=int(exc.status_code), msg=str(exc))
            return
        await link.channel.reply(req_id, reply)

    def _refusal(self, link: Link, entry: CacheEntry, peer_device: tuple[str, int] | None) -> LLMException | None:
        """Why ``entry`` cannot be served on ``link``: its plane's reason, or a device cache whose runtime the
        requester does not share on a same-host link (IPC cannot join two runtimes)."""
        refusal = link.plane.refusal(entry.cache_id, entry.on_device)
        if refusal is not None or not entry.on_device or peer_device is None or link.plane.kind != "shm":
            return refusal
        runtime = self._engine.device().runtime.name
        if peer_device[0] == runtime:
            return None
        return LLMException(f"cache {entry.cache_id} is {runtime.upper()} device memory and cluster "
                            f"{link.remote_cluster_id} uses {peer_device[0].upper()}: IPC cannot join two device "
                            "runtimes; link over TCP (transport tcp) to stage it", status_code=S.LLM_FEATURE_NOT_ENABLED)

    def _begin(self, link: Link, message: Begin, started: float) -> dict[str, Any]:
        tid, key, params, peer_geometry = message.tid, message.key, message.params, message.peer
        state = self._states.of(link)
        if tid in state.leases:
            param_invalid(f"transfer {tid} is already running.")
        registry = self._registry
        release_key = (key.kind, key.a, key.b) if params.op == "pull" and key.kind in ("req", "prefix") else None
        if release_key is not None and registry.is_taken(release_key):
            # A pull by CacheKey consumes the key: a second pull of it while the first runs is a duplicate.
            raise LLMException(f"cache key {release_key} is already being pulled", status_code=S.LLM_REPEAT_REQUEST)
        entry, slot = registry.resolve_wire(key.kind, key.a, key.b)
        if not entry.remote_accessible:
            param_invalid(f"cache {entry.cache_id} is not remote accessible.")
        refusal = self._refusal(link, entry, message.dev)
        if refusal is not None:
            raise refusal
        if params.op == "push":
            require(key.kind in ("id", "blocks"), "push addresses the destination by cache id or BlocksCacheKey.")
        plan = transfer_plan(params, peer_geometry, entry.geometry, slot)  # validates the owner's side too
        registry.acquire(entry)
        lease = state.leases[tid] = Lease(entry, release_key, op=params.op, nbytes=plan.total_bytes, started=started)
        try:
            source = (OfferedSource(np.array(message.src, dtype=np.uint64), message.sseg)
                      if message.src is not None else None)
            lease.job = link.plane.serve(tid, params.op == "pull", plan, entry, source)
        except LLMException:
            del state.leases[tid]
            registry.release_lease(entry)
            raise
        if release_key is not None:  # gone from now on: one round trip ends such a pull, the END needs no answer
            registry.take_key(release_key)
        descriptor = None
        if entry.cache_id not in message.known:  # a cache's layout never changes: described once per requester
            ipc = None
            if entry.on_device:
                exported = self._engine.device().ipc_export(entry.addrs, entry.desc.size,
                                             message.dev[1] if message.dev is not None else None)
                entry.exported.update(handle for handle, _, _ in exported)
                ipc = tuple((handle, base, size) for handle, base, size in exported)
            shared = entry.shared_segment
            segment = (shared.identity, shared.address) if shared is not None else None
            descriptor = Descriptor(entry.geometry, entry.addrs, segment, ipc, borrowed=not entry.owned,
                                    nixl=link.plane.reach(entry), window=entry.shared_window)
        published = entry.published if link.plane.publishes(entry.tcp_readable) else None
        if published is not None and not entry.owned:  # the peer may write it one-sided: WITHDRAW at release
            state.writable.add(entry.cache_id)
        copies = lease.job is not None and link.plane.serves_whole
        return BeginReply(entry.cache_id, slot, published, descriptor, copies).to_wire()

    def end(self, link: Link, message: End, req_id: int) -> dict[str, Any] | None:
        """``END`` (request ``req_id``): answered at once, or (a TCP transfer whose owner-side job still runs)
        once it is settled."""
        state = self._states.of(link)
        lease = state.leases.get(message.tid)
        if lease is not None and lease.job is not None and not link.plane.served_done(lease.job):
            if message.ok and lease.op == "pull" and lease.release_key is not None:
                # Every byte reached the requester, whose call returns now: its key is consumed at once (a pull by
                # it that follows this END finds it gone, or bound anew), not once this side's job is reaped.
                self._registry.settle_key(lease.release_key, lease.entry, True)
                lease.release_key = None
            self._links.spawn(self._end_streamed(link, state, message, req_id), name="end-streamed")
            return None
        failed = lease is not None and lease.job is not None and lease.job.error is not None
        self._end(link, state, message.tid, message.ok, None if failed else message.note)
        return EndReply().to_wire()

    def _end(self, link: Link, state: LinkTransfers, tid: int, ok: bool, note: bytes | None,
             failure: str = "REQUESTER_FAILED") -> None:
        lease = state.leases.pop(tid, None)
        if lease is None:
            return  # a second END, or one for a transfer this side never began: no notification either
        if lease.withdrawing:  # the requester no longer writes the cache one-sided
            self._registry.release_lease(lease.entry)
            return
        self._stats.served(link.remote_cluster_id, lease.op, link.plane.path_of(lease.entry.on_device),
                           time.perf_counter() - lease.started, lease.nbytes, None if ok else failure)
        if lease.release_key is not None:
            self._registry.settle_key(lease.release_key, lease.entry, ok)
        self._registry.release_lease(lease.entry)
        if ok and note is not None:
            self._deliver(link.remote_cluster_id, note)

    async def _end_streamed(self, link: Link, state: LinkTransfers, message: End, req_id: int) -> None:
        """END of a TCP transfer whose owner-side job is still running: a confirmed push waits until every byte
        landed; anything else stops the job.  The lease is released only once no thread touches the cache."""
        tid, ok, confirm, note = message.tid, message.ok, message.confirm, message.note
        lease, plane = state.leases.get(tid), link.plane
        if lease is None or lease.job is None:  # a second END for this transfer: already settled
            await link.channel.reply(req_id, EndReply().to_wire())
            return
        code, text, failure = 0, "", "REQUESTER_FAILED"
        started = time.perf_counter()
        settled = False  # every byte moved: the notification may be delivered
        try:
            complete = ok and (confirm or lease.op == "pull")  # a pull: the owner's end sends
            await plane.finish_served(lease.job, complete)
            settled = complete
        except LLMException as exc:
            code, text, ok, failure = int(exc.status_code), str(exc), False, exc.status_code.name
        finally:
            self._end(link, state, tid, ok, note if settled else None, failure)
        waited = EndReply((time.perf_counter() - started) * 1e3)
        await link.channel.reply(req_id, waited.to_wire(), code=code, msg=text)

    def announce_freed(self, entry: CacheEntry) -> None:
        """``entry``'s memory is gone; same-host peers that mapped it let go of their mappings (a peer's mapping
        would otherwise keep freed pages alive until the link closes)."""
        segment: SharedSegment | InPlaceSegment | None = entry.segment
        memory = entry.host_memory
        if memory is not None and memory.registrations == 0 and not memory.closed:
            segment = memory.segment  # its last registration went: peers let go of their mappings (until the next)
        mapped = segment is not None or bool(entry.exported)
        freed = Freed(entry.cache_id, (segment.identity.inode, segment.identity.device) if segment is not None
                      else None, tuple(sorted(entry.exported)))
        for link in list(self._links.links.values()):
            if not link.closed and link.plane.tells_freed(entry.cache_id, mapped):
                link.channel.notify(freed)
        if entry.on_device and not entry.owned:  # caller-owned device memory: its exports end with the cache
            self._engine.device().withdraw_exports(entry.addrs)
            entry.exported.clear()

    def abort_remote(self, entry: CacheEntry) -> None:
        """Ask requesters whose running transfers use ``entry`` (being released) to stop; requesters that may
        write it one-sided (a caller-owned cache) hold a lease on it until they confirm that they stopped."""
        for link in self._links.links.values():
            state = self._states.of(link)
            for tid, lease in state.leases.items():
                if lease.entry is entry:
                    if lease.job is not None:
                        link.plane.cancel_served(lease.job)  # our own I/O threads stop touching it too
                    link.channel.notify(Abort(tid))
            if entry.cache_id in state.writable:
                state.writable.discard(entry.cache_id)
                tid = transfer_id(set(state.leases))
                self._registry.acquire(entry)
                state.leases[tid] = Lease(entry, None, withdrawing=True)
                link.channel.notify(Withdraw(tid, entry.cache_id))

    def link_closed(self, link: Link, state: LinkTransfers) -> None:
        """Drop the leases of a closed link (its data plane has stopped touching the caches)."""
        for lease in state.leases.values():
            if lease.withdrawing:
                self._registry.release_lease(lease.entry)
                continue
            self._stats.served(link.remote_cluster_id, lease.op, link.plane.path_of(lease.entry.on_device),
                               time.perf_counter() - lease.started, 0, "LINK_CLOSED")
            self._registry.release_lease(lease.entry)
            if lease.release_key is not None:
                self._registry.settle_key(lease.release_key, lease.entry, False)
        state.leases.clear()
