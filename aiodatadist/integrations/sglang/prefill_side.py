"""The prefill rank's half of the backend: decode ranks register, requests' pages are pushed, completion is told.

Everything here runs on aiodatadist's loop thread except :meth:`PrefillSide.submit_chunk`, which SGLang's scheduler
calls (through the manager's ``add_transfer_request``) and which only hands the chunk to the loop thread.

* The control reader takes the manager's ZeroMQ socket: registrations of decode ranks (the rank is linked to at
  once, in the background), room messages (where a request's pages go: SGLang's ``transfer_infos``), SGLang's
  ``ABORT`` (the room fails, its pushes are cancelled) and ``BOOTSTRAP`` messages.
* A chunk is one task: it pushes the chunk's pages into every (non-dummy) decode rank of the room, all KV layers in
  one push per KV group.  The last chunk waits for the room's earlier chunks, then its push carries the "done"
  notification (:func:`.wire.encode_done`), with the request's aux row inside when it fits (else the aux rows are
  pushed first): one push, one round trip; then the room is ``Success`` here.  A failure marks the room
  ``Failed`` and tells the decode ranks with SGLang's status message (its reason included).
* An aborted room's pushes are cancelled: aiodatadist returns from a cancelled push only once nothing more can
  land in the decode's pages; then SGLang's deferred abort acknowledgement (``ABORT_ACK``) is sent, if the decode
  asked for one.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq
import zmq.asyncio

from ...errors import LLMException, LLMLinkError, LLMStatusCode
from ...notifications import MAX_NOTIFICATION_BYTES
from ._sglang import base, common
from .endpoint import Endpoint
from .layout import AuxPush, BufferGroup, aux_pushes, matching_prefix
from .wire import PeerRegistration, RoomTarget, encode_done, parse

__all__ = ["Chunk", "Peer", "PrefillSide"]

log = logging.getLogger("aiodatadist.integrations.sglang")

DONE_HEADER_BYTES = 64
"""Room in a "done" notification for its header (:func:`.wire.encode_done`) beside an inline aux row."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One ``send`` of SGLang's sender: pages of a request, their place in the request, and whether it is the
    last (with the request's aux row)."""

    room: int
    kv_indices: npt.NDArray[np.int64]
    index_slice: slice
    is_last: bool
    aux_index: int | None


@dataclass(slots=True)
class Peer:
    """A registered decode rank: where to push, how its aux rows travel, or why it cannot be served.

    ``inline_aux``: how many aux buffers (the ones both engines share) travel inside the "done" notification
    (0: they are pushed, ``aux``)."""

    registration: PeerRegistration
    aux: list[AuxPush]
    inline_aux: int
    refusal: str | None


class PrefillSide:
    """The prefill manager's transfers (``manager``: the SGLang ``CommonKVManager`` subclass that owns it)."""

    def __init__(self, manager: Any, endpoint: Endpoint, kv_groups: Sequence[BufferGroup],
                 aux_groups: Sequence[BufferGroup]) -> None:
        self.manager = manager
        self.endpoint = endpoint
        self.kv_groups = list(kv_groups)
        self.aux_groups = list(aux_groups)
        self.peers: dict[str, Peer] = {}  # agent name -> decode rank (loop thread)
        self.rooms: dict[int, list[asyncio.Task[Any]]] = {}  # room -> its chunk tasks in flight (loop thread)
        endpoint.run(self.read_control)

    # -- the scheduler thread --------------------------------------------------------------------------------
    def submit_chunk(self, chunk: Chunk) -> None:
        """Hand a chunk to the loop thread (returns at once)."""
        self.endpoint.start(lambda: self.send_chunk(chunk))

    def abort_room(self, room: int, targets: list[tuple[str, int]]) -> None:
        """The prefill aborted ``room``: cancel its pushes, then tell ``targets`` (decode ranks' ZeroMQ addresses)
        that it failed (returns at once)."""
        self.endpoint.start(lambda: self._abort_room(room, targets))

    async def _abort_room(self, room: int, targets: list[tuple[str, int]]) -> None:
        tasks = list(self.rooms.get(room, ()))
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)  # a cancelled push returns once nothing more can land
        await asyncio.to_thread(self.manager.send_kv_status_message, targets=targets, bootstrap_room=room,
                                status=base.KVPoll.Failed, failure_reason="Aborted on the prefill side.")

    # -- control messages (loop thread) ----------------------------------------------------------------------
    async def read_control(self) -> None:
        """Read the manager's ZeroMQ socket until cancelled."""
        sock = zmq.asyncio.Socket.from_socket(self.manager.server_socket)
        while True:
            frames = await sock.recv_multipart()
            try:
                self.on_message(frames)
            except Exception:  # a bad message never stops the reader
                log.exception("aiodatadist: prefill control message dropped")

    def on_message(self, frames: list[bytes]) -> None:
        """Dispatch one control message."""
        mgr = self.manager
        if mgr._handle_bootstrap_message(frames):
            return
        if frames and frames[0] == common.ABORT_TAG:
            self.on_abort(frames)
            return
        try:
            message = parse(frames)
        except ValueError as exc:
            log.warning("aiodatadist: malformed control message dropped: %s", exc)
            return
        if isinstance(message, PeerRegistration):
            self.on_registration(message)
        else:
            self.on_room(message)

    def on_registration(self, reg: PeerRegistration) -> None:
        """A decode rank registered: check that it can be served, and link to it in the background."""
        mgr = self.manager
        refusal = None
        if reg.page_size != mgr.kv_args.page_size:
            refusal = f"page size {reg.page_size} on the decode rank, {mgr.kv_args.page_size} here"
        elif reg.tp_size != mgr.attn_tp_size and not mgr.is_mla_backend:
            refusal = (f"attention TP {reg.tp_size} on the decode rank, {mgr.attn_tp_size} here: the aiodatadist "
                       "backend moves whole pages and does not slice KV heads (use equal TP sizes)")
        elif reg.kv_item_lens != tuple(mgr.kv_args.kv_item_lens):
            refusal = "the decode rank's KV buffers differ from this rank's (layers or page bytes)"
        previous = self.peers.get(reg.agent_name)
        if previous is not None and previous.registration == reg:
            return
        mgr.check_peer_aux_buffer_count(reg.agent_name, len(reg.aux_item_lens))
        aux = aux_pushes(self.aux_groups, mgr.kv_args.aux_item_lens, reg.aux_item_lens)
        shared = matching_prefix(mgr.kv_args.aux_item_lens, reg.aux_item_lens)
        row = sum(mgr.kv_args.aux_item_lens[:shared])
        inline = shared if shared and row + DONE_HEADER_BYTES <= MAX_NOTIFICATION_BYTES else 0
        self.peers[reg.agent_name] = Peer(reg, aux, inline, refusal)
        if refusal is not None:
            log.error("aiodatadist: decode rank %s:%d cannot be served: %s", reg.endpoint, reg.dst_port, refusal)
            return
        attempt = asyncio.ensure_future(self.endpoint.link(reg.cluster_id, reg.host, reg.port))
        attempt.add_done_callback(_log_link_failure)

    def on_room(self, target: RoomTarget) -> None:
        """Where a request's pages go on one decode rank; the room waits for its input once every rank told."""
        mgr = self.manager
        infos = mgr.transfer_infos.setdefault(target.room, {})
        infos[target.agent_name] = target
        if len(infos) == target.required_dst_info_num:
            mgr.resolve_kv_replica_factor(infos)
            mgr.req_to_decode_prefix_len[target.room] = next(
                (info.decode_prefix_len for info in infos.values() if info.decode_prefix_len), 0)
            mgr.update_status(target.room, base.KVPoll.WaitingForInput)

    def on_abort(self, frames: list[bytes]) -> None:
        """SGLang's ``ABORT`` from a decode rank: fail the room, cancel its pushes, acknowledge once drained."""
        mgr = self.manager
        notification = common.AbortNotification.from_zmq(frames)
        if notification is None:
            return
        room = notification.room
        if room in mgr.request_status and mgr.check_status(room) != base.KVPoll.Success:
            mgr.record_failure(room, "Aborted by decode-side abort notification.")
            mgr.update_status(room, base.KVPoll.Failed)
        for task in self.rooms.get(room, ()):
            task.cancel()
        if mgr.enable_deferred_decode_kv_release:
            target = notification.deferred_ack_target()
            if target is not None:
                mgr.register_deferred_ack_target(room, target)
                mgr._maybe_ack_drained_abort(room)

    # -- chunks (loop thread) --------------------------------------------------------------------------------
    async def send_chunk(self, chunk: Chunk) -> None:
        """Push one chunk into every decode rank of its room; the last one concludes the room."""
        mgr = self.manager
        room = chunk.room
        task = asyncio.current_task()
        assert task is not None
        tasks = self.rooms.setdefault(room, [])
        earlier = list(tasks)
        tasks.append(task)
        mgr._staging_outstanding[room] += 1  # "a chunk of this room may still write": SGLang's abort-ack count
        try:
            if chunk.is_last and earlier:
                await asyncio.wait(earlier)  # D hears "done" only once every chunk landed
            if room not in mgr.request_status or self._failed(room):
                return  # aborted, failed or cleared: nothing (more) is written
            infos = mgr.transfer_infos.get(room)
            if not infos:
                return
            mgr.update_status(room, base.KVPoll.Transferring)
            targets = [info for info in infos.values() if not info.is_dummy]
            started = time.perf_counter()
            async with asyncio.TaskGroup() as group:
                for target in targets:
                    group.create_task(self._push(target, chunk))
            log.debug("aiodatadist: room %d: %d pages%s into %d decode rank(s) in %.2f ms", room,
                      len(chunk.kv_indices), " (last)" if chunk.is_last else "", len(targets),
                      (time.perf_counter() - started) * 1000)
            if chunk.is_last and not self._failed(room):
                mgr.update_status(room, base.KVPoll.Success)  # every byte is in D's memory: P may free its pages
                mgr.transfer_infos.pop(room, None)
                mgr.req_to_decode_prefix_len.pop(room, None)
        except asyncio.CancelledError:
            log.debug("aiodatadist: room %d: pushes cancelled (aborted)", room)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is the room's, reported to SGLang
            reason = _reason(exc)
            log.warning("aiodatadist: room %d: transfer failed: %s", room, reason)
            await asyncio.to_thread(mgr.conclude_failure, bootstrap_room=room, failure_reason=reason)
        finally:
            tasks.remove(task)
            if not tasks:
                self.rooms.pop(room, None)
            mgr._staging_outstanding[room] -= 1
            if mgr._staging_outstanding[room] <= 0:
                mgr._staging_outstanding.pop(room, None)
            if mgr.enable_deferred_decode_kv_release:
                mgr._maybe_ack_drained_abort(room)

    def _failed(self, room: int) -> bool:
        mgr = self.manager
        with mgr.failure_lock:
            recorded = room in mgr.failure_records
        return recorded or mgr.request_status.get(room) == base.KVPoll.Failed

    async def _push(self, target: RoomTarget, chunk: Chunk) -> None:
        """The chunk's pages (and, for the last chunk, the aux row and the "done") into one decode rank.  A link
        that went away (the decode rank's instance restarted its connection, or was gone for a while) is made
        again once, and the chunk pushed again (writing the same bytes twice is harmless)."""
        peer = self.peers.get(target.agent_name)
        if peer is None:
            raise LLMException(f"decode rank {target.agent_name} never registered",
                               status_code=LLMStatusCode.LLM_NOT_YET_LINK)
        if peer.refusal is not None:
            raise LLMException(peer.refusal, status_code=LLMStatusCode.LLM_PARAM_INVALID)
        reg = peer.registration
        await self.endpoint.link(reg.cluster_id, reg.host, reg.port)
        try:
            await self._push_once(reg.cluster_id, peer, target, chunk)
        except* LLMLinkError as group:
            log.info("aiodatadist: decode instance %d: %s; linking again", reg.cluster_id, group.exceptions[0])
            self.endpoint.forget(reg.cluster_id)
            await self.endpoint.link(reg.cluster_id, reg.host, reg.port)
            await self._push_once(reg.cluster_id, peer, target, chunk)

    async def _push_once(self, cluster_id: int, peer: Peer, target: RoomTarget, chunk: Chunk) -> None:
        """Every push of the chunk into one decode rank.  The last chunk's "done" travels with its last push (or
        alone when it moves no page), and carries the aux row when it fits: then one push, one round trip."""
        src = chunk.kv_indices
        dst = target.dst_kv_indices[chunk.index_slice]
        count = min(len(src), len(dst))
        pages = [(kv.model_id, src[:count], dst[:count]) for kv in self.kv_groups] if count else []
        done: bytes | None = None
        if chunk.is_last:
            rank = self.manager._prefill_unique_rank()
            inline = peer.inline_aux and chunk.aux_index is not None
            done = encode_done(chunk.room, rank, self._aux_row(chunk.aux_index, peer.inline_aux) if inline else b"")
            async with asyncio.TaskGroup() as group:  # what must land before "done": all but the last push
                for model_id, s, d in pages[:-1]:
                    group.create_task(self.endpoint.push_pages(cluster_id, model_id, s, d))
                if not inline and chunk.aux_index is not None:
                    for aux in peer.aux:
                        group.create_task(self.endpoint.push_aux(cluster_id, aux, chunk.aux_index,
                                                                 target.dst_aux_index))
            pages = pages[-1:]
        if pages:
            await asyncio.gather(*(self.endpoint.push_pages(cluster_id, m, s, d, notify=done) for m, s, d in pages))
        elif done is not None:
            await self.endpoint.notify(cluster_id, done)

    def _aux_row(self, index: int | None, buffers: int) -> bytes:
        """The request's row of the first ``buffers`` aux buffers, back to back (read from SGLang's memory)."""
        args = self.manager.kv_args
        if index is None:
            return b""
        return b"".join(ctypes.string_at(args.aux_data_ptrs[i] + args.aux_item_lens[i] * index, args.aux_item_lens[i])
                        for i in range(buffers))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_reason(inner) for inner in exc.exceptions)
    return f"aiodatadist: {type(exc).__name__}: {exc}"


def _log_link_failure(attempt: asyncio.Future[None]) -> None:
    if not attempt.cancelled() and attempt.exception() is not None:
        log.warning("aiodatadist: %s (retried with the first request for that rank)", attempt.exception())

