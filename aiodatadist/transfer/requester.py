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
import time
from typing import Any, NamedTuple

from .._aio import wait_through_cancellation
from .._checks import U64_MAX, check_int, require
from .._deadlines import deadline
from ..copy.device import device_identity
from ..errors import LLMException, LLMLinkError, LLMStatusCode, LLMTimeoutError
from ..layout.plans import TransferParams, transfer_plan
from ..link.link import Link
from ..link.manager import LinkManager
from ..protocol.codec import ProtocolError
from ..protocol.messages import Abort, Begin, BeginReply, End, EndReply, Freed, Notify, WireKey, Withdraw
from ..registry.caches import CacheEntry, CacheRegistry, IndexKey
from ..settings.options import Settings
from ..stats import StatsRecorder
from ..transport.directory import Resolved
from ..transport.plane import Route, Transfer
from ..types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from .state import LinkTransfers, TransferStates, transfer_id

__all__ = ["Requester"]

log = logging.getLogger("aiodatadist.transfer")
STOP_ACK_TIMEOUT = 1.0  # a cut-short push the owner confirms over the control channel: then the link is dropped
SLOW_STOP_ACK = 0.05  # a confirmation slower than this is logged, with the owner's own share of it
S = LLMStatusCode


def wire_key(key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey) -> WireKey:
    """A cache key as the owner indexes it."""
    if isinstance(key, CacheKeyByIdAndIndex):
        return WireKey("id", key.cache_id, key.batch_index)
    if isinstance(key, BlocksCacheKey):
        model_id = key.model_id  # an int (BlocksCacheKey checks that): only its range is left to check
        if not 0 <= model_id <= U64_MAX:
            check_int("model_id", model_id, "uint64")  # (raises, saying why)
        return WireKey("blocks", model_id, 0)
    kind, ident, model = key.index_key()
    return WireKey(kind, ident, model)


class _OneSided(NamedTuple):
    """A transfer on a cache the owner published, ready for the link's plane to move alone."""

    link: Link
    st: LinkTransfers
    resolved_as: IndexKey  # its key in ``st.resolved``
    resolved: Resolved
    transfer: Transfer


class Requester:
    """The requester side of every link of one instance: begin -> the link's data plane moves -> end."""

    def __init__(self, cluster_id: int, settings: Settings, links: LinkManager, registry: CacheRegistry,
                 states: TransferStates, stats: StatsRecorder) -> None:
        self._cluster_id = cluster_id
        self._settings = settings
        self._links = links
        self._registry = registry
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
                one = self._one_sided_transfer(key, local, params)
                if one is not None and self._moved_now(one):  # done on this thread: nothing to await
                    nbytes = one.transfer.plan.total_bytes
                    self._send_note(one.link, note)
                else:
                    with deadline(timeout_ms / 1000):
                        nbytes = await self._run(key, local, params, note, one)
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
            plane = link.plane.path_of(local.on_device) if link is not None else ""
            self.stats.record(key.cluster_id, params.op, plane, time.perf_counter() - started, nbytes, failure)

    def _noted(self, link: Link, note: bytes | None) -> bytes | None:
        """``note``, counted as sent to the link's peer (called when it goes out with a successful transfer)."""
        if note is not None:
            self.stats.notification_sent(link.remote_cluster_id)
        return note

    def _send_note(self, link: Link, note: bytes | None) -> None:
        """A successful transfer without END: its notification goes out on its own (NOTIFY, answer not awaited)."""
        if note is not None:
            link.channel.notify(Notify(note))
            self._noted(link, note)

    async def _run(self, key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, local: CacheEntry,
                   params: TransferParams, note: bytes | None,
                   one: _OneSided | None) -> int:
        """Do the transfer (``one``: as prepared to go one-sided); returns the bytes moved."""
        if one is not None:
            moved = await self._one_sided(one, local)
            if moved is not None:
                self._send_note(one.link, note)
                return moved
        require(key.cluster_id != self._cluster_id, "data can not be pulled from own cluster.")
        link = self._links.links.get(key.cluster_id) or await self._links.not_linked(key.cluster_id)
        link.plane.check_local(local, key.cluster_id)
        return await self._through_owner(link, self._states.of(link), wire_key(key), local, params, note)

    def _one_sided_transfer(self, key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, local: CacheEntry,
                            params: TransferParams) -> _OneSided | None:
        """The transfer on a cache the owner resolved and published before, for the plane to move alone (no
        round trip); None: it goes through the owner (a resolution gone stale is forgotten)."""
        link = self._links.links.get(key.cluster_id)
        if link is None or key.cluster_id == self._cluster_id:
            return None  # (the way through the owner says why)
        link.plane.check_local(local, key.cluster_id)
        st = self._states.of(link)
        wkey = wire_key(key)
        index: IndexKey = (wkey.kind, wkey.a, wkey.b)
        resolved = st.resolved.get(index)
        if resolved is None:
            return None
        descriptor = st.descriptors.get(resolved.cache_id)
        route = link.plane.route(resolved, descriptor, params.op == "pull", local)
        if route is not Route.ONE_SIDED or descriptor is None:
            if route is Route.STALE:
                del st.resolved[index]
            return None
        try:
            plan = transfer_plan(params, local.geometry, descriptor.geometry, resolved.slot)
        except LLMException:  # against what was resolved, which may be gone: the owner has the last word
            del st.resolved[index]
            return None
        transfer = Transfer(transfer_id(st.running), params.op == "pull", plan, local, descriptor, resolved.cache_id)
        if link.plane.prefers_owner(transfer):
            return None
        return _OneSided(link, st, index, resolved, transfer)

    @staticmethod
    def _moved_now(one: _OneSided) -> bool:
        """Move ``one`` on this thread if it is small enough (see ``DataPlane.moved_published_now``)."""
        try:
            return one.link.plane.moved_published_now(one.transfer, one.resolved)
        except LLMException as exc:
            if exc.status_code == S.LLM_KV_CACHE_NOT_EXIST:
                one.st.resolved.pop(one.resolved_as, None)
            raise

    async def _one_sided(self, one: _OneSided, local: CacheEntry) -> int | None:
        """Move ``one``, by the plane alone; None: it goes through the owner after all (the cache was released
        or re-keyed meanwhile)."""
        link, st, index, resolved, transfer = one
        stopped: asyncio.Future[None] | None = None
        if not transfer.pull:  # a WITHDRAW of the owner's cache waits for it (see withdraw)
            stopped = asyncio.get_running_loop().create_future()
            st.writing[transfer.tid] = (resolved.cache_id, stopped)
        with self._registry.lease(local):
            try:
                moved = await link.plane.move_published(transfer, resolved)
            except LLMException as exc:
                if exc.status_code == S.LLM_KV_CACHE_NOT_EXIST:
                    st.resolved.pop(index, None)
                raise
            finally:
                if stopped is not None:
                    del st.writing[transfer.tid]
                    stopped.set_result(None)
        if not moved:
            st.resolved.pop(index, None)  # released or re-keyed: ask the owner again
            return None
        return transfer.plan.total_bytes

    async def _through_owner(self, link: Link, st: LinkTransfers, wkey: WireKey, local: CacheEntry,
                             params: TransferParams, note: bytes | None) -> int:
        """BEGIN (the owner resolves, validates and leases; a pull by CacheKey takes the key off there), the plane
        moves the bytes, END (one-way: the owner releases the key of a successful pull, binds it again otherwise)."""
        plane = link.plane
        tid = transfer_id(st.running)
        pull = params.op == "pull"
        ok = ended = refused = False
        transfer: Transfer | None = None
        pending: Any = None
        source = plane.source_for_owner(local, params)  # offered: the owner may copy the push itself
        st.running.add(tid)
        with self._registry.lease(local):
            try:
                pending = plane.expect(tid, pull)
                try:
                    reply = await link.channel.request(Begin(
                        tid, wkey, local.geometry, params, tuple(st.descriptors),
                        None if source is None else tuple(source.addrs.tolist()),
                        None if source is None else source.segment, device_identity()))
                except LLMException as exc:
                    refused = not isinstance(exc, LLMLinkError)  # the owner answered: nothing of it runs there
                    raise
                transfer = self._begun(link, st, tid, wkey, reply, local, params, pending, source is not None)
                if not transfer.owner_copies:  # (else the owner copied it before answering)
                    await plane.move(transfer)
                    if not pull and plane.confirms_push:  # the bytes are sent; the owner confirms once all landed
                        await link.channel.request(End(tid, True, confirm=True, note=note))
                        ended = True
                        self._noted(link, note)
                ok = True
            finally:
                await plane.discard(pending)
                # Always end the transfer on the owner (it may have taken a lease even if we never saw the reply).
                st.aborted.discard(tid)
                st.running.discard(tid)
                if not ended and (plane.needs_fence(transfer) if transfer is not None
                                  else source is not None and not refused):
                    # (a source offered: the owner may be copying it, its reply still to come)
                    await wait_through_cancellation(self._cut_short(link, tid, transfer))
                elif not ended:
                    link.channel.notify(End(tid, ok, note=self._noted(link, note) if ok else None))
        assert transfer is not None
        return transfer.plan.total_bytes

    def _begun(self, link: Link, st: LinkTransfers, tid: int, wkey: WireKey, reply: dict[str, Any],
               local: CacheEntry, params: TransferParams, pending: Any, offered: bool) -> Transfer:
        """The transfer the owner's BEGIN reply describes (its cache's descriptor and publication remembered;
        ``offered``: BEGIN offered the source of a push for the owner to copy)."""
        try:
            begun = BeginReply.from_wire(reply)
            if begun.copies and not offered:
                raise ProtocolError("the owner copies a transfer whose source was not offered")
            if begun.desc is not None:
                st.descriptors[begun.cid] = begun.desc
            descriptor = st.descriptors.get(begun.cid)
            if descriptor is None:
                raise ProtocolError(f"no descriptor for cache {begun.cid}")
        except ProtocolError as exc:
            raise LLMLinkError(f"malformed reply from the owner: {exc}") from None
        if begun.pub is not None and wkey.kind in ("id", "blocks") and link.plane.remembers(wkey.a):
            row, stamp = begun.pub
            model = wkey.a if wkey.kind == "blocks" else None
            st.resolved[(wkey.kind, wkey.a, wkey.b)] = Resolved(begun.cid, begun.slot, row, stamp, model)
        if tid in st.aborted:
            raise LLMException(f"cluster {link.remote_cluster_id} released the cache before the copy started",
                               status_code=S.LLM_KV_CACHE_NOT_EXIST)
        plan = transfer_plan(params, local.geometry, descriptor.geometry, begun.slot)
        transfer = Transfer(tid, params.op == "pull", plan, local, descriptor, begun.cid, pending,
                            owner_copies=begun.copies)
        link.plane.begun(transfer)
        return transfer

    async def _cut_short(self, link: Link, tid: int, transfer: Transfer | None) -> None:
        """A push stopped mid-way (``transfer`` None: before BEGIN's reply came): it returns only once the owner
        confirmed that its receiving end stopped writing (its I/O threads answer a fence on the data connections;
        otherwise it answers END over the control channel)."""
        if transfer is not None and await link.plane.cut_short(transfer):
            link.channel.notify(End(tid, False))  # the owner's lease
            return
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
                await self._links.drop(link, LLMLinkError(
                    f"cluster {link.remote_cluster_id} did not confirm the end of a cut-short push; link dropped"))

    def abort(self, link: Link, message: Abort) -> None:
        """The owner released the cache of a running transfer: stop our copy at the next chunk."""
        st = self._states.of(link)
        error = LLMException(f"cluster {link.remote_cluster_id} released the cache during the transfer",
                             status_code=S.LLM_KV_CACHE_NOT_EXIST)
        if not link.plane.abort(message.tid, error) and message.tid in st.running:
            st.aborted.add(message.tid)  # the copy has not started yet: it must not start at all

    def withdraw(self, link: Link, message: Withdraw) -> None:
        """The owner unregisters a caller-owned cache this side may write one-sided: no new write starts, running
        ones stop, and once none writes any more the owner's lease ends (``END``)."""
        st = self._states.of(link)
        self._forget(st, message.cid)
        error = LLMException(f"cluster {link.remote_cluster_id} unregistered cache {message.cid} during the "
                             "transfer", status_code=S.LLM_KV_CACHE_NOT_EXIST)
        writing = []
        for tid, (cid, stopped) in st.writing.items():
            if cid == message.cid:
                link.plane.abort(tid, error)  # False if its copy has not started: then it is waited for whole
                writing.append(stopped)
        if not writing:
            link.channel.notify(End(message.tid, False))
            return

        async def confirm() -> None:
            await asyncio.wait(writing)
            if not link.closed:
                link.channel.notify(End(message.tid, False))

        self._links.spawn(confirm(), name="withdraw")

    def freed(self, link: Link, message: Freed) -> None:
        """The peer freed a cache: forget its description and let go of what reaches it here (once idle)."""
        st = self._states.of(link)
        st.descriptors.pop(message.cid, None)
        self._forget(st, message.cid)
        link.plane.freed(message)

    @staticmethod
    def _forget(st: LinkTransfers, cache_id: int) -> None:
        """Forget every key resolved to the peer's cache ``cache_id``: transfers by them ask the owner again."""
        for key, resolved in list(st.resolved.items()):
            if resolved.cache_id == cache_id:
                del st.resolved[key]

