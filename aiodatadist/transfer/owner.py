"""Owner side of pulls and pushes: resolve the key at ``BEGIN``, validate, lease, and end at ``END``.

The owner never copies anything on the same-host plane: it resolves the requester's key against its registry
at that moment, validates the whole transfer against both caches' geometry, takes a lease on its cache and
answers with the cache's description; ``END`` drops the lease and, for a successful pull by ``CacheKey``,
releases that key.  On the TCP plane its data plane sends (pull) or receives (push) the bytes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .._checks import I64_MAX, require
from ..control.links import Link, LinkManager
from ..errors import LLMException, LLMStatusCode
from ..layout import plan_side_spans, transfer_plan
from ..protocol.codec import Kind, field, int_field, opt_int_list
from ..protocol.messages import WireKey, geometry_from_wire, geometry_to_wire, segment_to_wire
from ..registry import CacheEntry, CacheRegistry, IndexKey
from ..transport.base import PULL, PUSH
from .engine import CopyEngine
from .state import Lease, LinkTransfers, TransferStates
from .wire import params_from_wire

__all__ = ["Owner"]

log = logging.getLogger("aiodatadist.transfer")
S = LLMStatusCode


class Owner:
    """The owner side of every link of one instance."""

    def __init__(self, links: LinkManager, registry: CacheRegistry, engine: CopyEngine,
                 states: TransferStates) -> None:
        self._links = links
        self._registry = registry
        self._engine = engine
        self._states = states
        self._pulling_keys: set[IndexKey] = set()  # CacheKeys being pulled, over any link

    def begin(self, link: Link, message: dict[str, Any]) -> dict[str, Any]:
        """``BEGIN``: resolve, validate, lease; the reply describes the cache to a requester that lacks it."""
        tid = int_field(message, "tid", 0)
        key = WireKey.from_wire(message.get("key"))
        params = params_from_wire(message)
        peer_geometry = geometry_from_wire(message.get("peer"))
        known = set(opt_int_list(message, "known", 1, I64_MAX))
        state = self._states.of(link)
        require(tid not in state.leases, f"transfer {tid} is already running.")
        registry = self._registry
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
        lease = state.leases[tid] = Lease(entry, release_key)
        if link.plane == "tcp" and link.data is not None:
            try:
                if params.op == "pull":  # start sending now: the requester's receiving end already exists
                    lease.job = link.data.send(PULL, tid, *plan_side_spans(plan, entry.addrs, "src"))
                else:
                    lease.job = link.data.receive(PUSH, tid)
                    link.data.set_destination(lease.job, *plan_side_spans(plan, entry.addrs, "dst"))
            except LLMException:
                del state.leases[tid]
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
                exported = self._engine.device().ipc_export(entry.addrs, entry.desc.size)
                entry.exported.update(handle for handle, _, _ in exported)
                reply["desc"]["ipc"] = exported
        return reply

    def end(self, link: Link, message: dict[str, Any]) -> dict[str, Any] | None:
        """``END``: answered at once, or (a TCP transfer whose owner-side job still runs) once it is settled."""
        state = self._states.of(link)
        lease = state.leases.get(int_field(message, "tid", 0))
        if lease is not None and lease.job is not None and not lease.job.done:
            self._links.spawn(self._end_streamed(link, state, message), name="end-streamed")
            return None
        self._end(state, int_field(message, "tid", 0), field(message, "ok", bool))
        return {}

    def _end(self, state: LinkTransfers, tid: int, ok: bool) -> None:
        lease = state.leases.pop(tid, None)
        if lease is None:
            return
        if lease.release_key is not None:
            self._pulling_keys.discard(lease.release_key)
        if ok and lease.release_key is not None:
            self._registry.release_key_after_pull(lease.release_key, lease.entry)
        self._registry.release_lease(lease.entry)

    async def _end_streamed(self, link: Link, state: LinkTransfers, message: dict[str, Any]) -> None:
        """END of a TCP transfer whose owner-side job is still running: a confirmed push waits until every byte
        landed; anything else stops the job.  The lease is released only once no thread touches the cache."""
        tid = int_field(message, "tid", 0)
        ok, confirm = field(message, "ok", bool), message.get("confirm") is True
        lease, plane = state.leases.get(tid), link.data
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
            self._end(state, tid, ok)
        await link.channel.reply(message["i"], {"waited": (time.perf_counter() - started) * 1e3}, code=code, msg=text)

    def announce_freed(self, entry: CacheEntry) -> None:
        """``entry``'s memory is gone; same-host peers that mapped it let go of their mappings (a peer's mapping
        would otherwise keep freed pages alive until the link closes)."""
        body: dict[str, Any] = {"cid": entry.cache_id}
        if entry.segment is not None:
            body["seg"] = [entry.segment.identity.inode, entry.segment.identity.device]
        if entry.exported:
            body["ipc"] = sorted(entry.exported)
        if len(body) == 1:
            return
        for link in list(self._links.links.values()):
            if link.caps.same_host and not link.closed:
                self._links.notify(link, Kind.FREED, body)

    def abort_remote(self, entry: CacheEntry) -> None:
        """Ask requesters whose running transfers use ``entry`` (being released) to stop."""
        for link in self._links.links.values():
            for tid, lease in self._states.of(link).leases.items():
                if lease.entry is entry:
                    if lease.job is not None and link.data is not None:
                        link.data.cancel(lease.job)  # our own I/O threads stop touching it too
                    self._links.notify(link, Kind.ABORT, {"tid": tid})

    def link_closed(self, state: LinkTransfers) -> None:
        """Drop the leases of a closed link (its data plane has stopped touching the caches)."""
        for lease in state.leases.values():
            self._registry.release_lease(lease.entry)
            if lease.release_key is not None:
                self._pulling_keys.discard(lease.release_key)
        state.leases.clear()
