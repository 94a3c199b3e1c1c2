"""The prefill rank's half of the backend: decode ranks register, requests' pages are announced, acks are counted.

Everything here runs on aiodatadist's loop thread except :meth:`PrefillSide.submit_chunk` and
:meth:`PrefillSide.abort_room`, which SGLang's scheduler calls and which only hand work to the loop thread.

* The control reader takes the manager's ZeroMQ socket: registrations of decode ranks (the rank is linked to at
  once, in the background), room messages (where a request's pages go: SGLang's ``transfer_infos``), SGLang's
  ``ABORT`` (the room fails, its tasks are cancelled) and ``BOOTSTRAP`` messages.
* A chunk is one task: it tells every (non-dummy) decode rank of the room which of this rank's pages hold it
  (``kv-ready`` notifications, in pieces of at most ~1000 pages).  The decode rank pulls them straight from this
  rank's registered memory, every layer in one pull, and its pull carries a ``kv-pulled`` back.  The last chunk
  waits for the room's earlier chunks, sends the request's aux row (``kv-aux``) and its last piece, then waits until
  every piece was pulled: the room is then ``Success`` here (this rank may free its pages).  No ack within
  ``AIODATADIST_SGLANG_TRANSFER_TIMEOUT_MS``, a ``kv-failed`` from the decode, or an error fails the room, and the
  decode ranks are told with SGLang's status message (its reason included).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq
import zmq.asyncio

from ...errors import LLMException, LLMLinkError, LLMStatusCode, LLMTimeoutError
from ._sglang import base, common
from .endpoint import Endpoint
from .layout import BufferGroup, matching_prefix
from .wire import (
    AUX_PER_NOTE,
    PAGES_PER_NOTE,
    Failed,
    PeerRegistration,
    Pulled,
    RoomTarget,
    encode_aux,
    encode_ready,
    parse,
    parse_note,
)

__all__ = ["Chunk", "Peer", "PrefillSide"]

log = logging.getLogger("aiodatadist.integrations.sglang")

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
    """A registered decode rank: how many aux buffers it shares with this rank, or why it cannot be served."""

    registration: PeerRegistration
    shared_aux: int
    refusal: str | None


@dataclass(slots=True)
class _Progress:
    """A room's pieces: announced, pulled; set ``settled`` when the last was pulled or the room failed."""

    announced: int = 0
    pulled: int = 0
    last_announced: bool = False
    failure: str | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    def check(self) -> None:
        if self.failure is not None or (self.last_announced and self.pulled >= self.announced):
            self.settled.set()


class PrefillSide:
    """The prefill manager's transfers (``manager``: the SGLang ``CommonKVManager`` subclass that owns it)."""

    def __init__(self, manager: Any, endpoint: Endpoint, kv_groups: Sequence[BufferGroup]) -> None:
        self.manager = manager
        self.endpoint = endpoint
        self.kv_groups = list(kv_groups)
        self.peers: dict[str, Peer] = {}  # agent name -> decode rank (loop thread)
        self.rooms: dict[int, list[asyncio.Task[Any]]] = {}  # room -> its chunk tasks in flight (loop thread)
        self.progress: dict[int, _Progress] = {}  # room -> its pieces (loop thread)
        endpoint.run(self.read_control)
        endpoint.run(self.read_notes)

    # -- the scheduler thread --------------------------------------------------------------------------------
    def submit_chunk(self, chunk: Chunk) -> None:
        """Hand a chunk to the loop thread (returns at once)."""
        self.endpoint.start(lambda: self.send_chunk(chunk))

    def abort_room(self, room: int, targets: list[tuple[str, int]]) -> None:
        """The prefill aborted ``room``: stop its tasks, then tell ``targets`` (decode ranks' ZeroMQ addresses)
        that it failed, so that they stop pulling (returns at once)."""
        self.endpoint.start(lambda: self._abort_room(room, targets))

    async def _abort_room(self, room: int, targets: list[tuple[str, int]]) -> None:
        tasks = list(self.rooms.get(room, ()))
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
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
        shared = matching_prefix(mgr.kv_args.aux_item_lens, reg.aux_item_lens)
        self.peers[reg.agent_name] = Peer(reg, shared, refusal)
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
        """SGLang's ``ABORT`` from a decode rank: fail the room, stop its tasks, acknowledge once drained."""
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

    # -- the decode ranks' notifications (loop thread) -------------------------------------------------------
    async def read_notes(self) -> None:
        """``kv-pulled`` and ``kv-failed`` from decode ranks; ends when the instance is finalized."""
        async for note in self.endpoint.dd.aio.notifications():
            message = parse_note(note.message)
            if isinstance(message, Pulled):
                progress = self.progress.get(message.room)
                if progress is not None:
                    progress.pulled += 1
                    progress.check()
            elif isinstance(message, Failed):
                progress = self.progress.get(message.room)
                if progress is not None:
                    progress.failure = f"the decode rank failed the transfer: {message.reason}"
                    progress.check()
            else:
                log.warning("aiodatadist: unexpected notification from cluster %d dropped", note.cluster_id)

    # -- chunks (loop thread) --------------------------------------------------------------------------------
    async def send_chunk(self, chunk: Chunk) -> None:
        """Announce one chunk to every decode rank of its room; the last one waits until the room was pulled."""
        mgr = self.manager
        room = chunk.room
        task = asyncio.current_task()
        assert task is not None
        tasks = self.rooms.setdefault(room, [])
        earlier = list(tasks)
        tasks.append(task)
        progress = self.progress.setdefault(room, _Progress())
        mgr._staging_outstanding[room] += 1  # "a chunk of this room may still be read": SGLang's abort-ack count
        try:
            if chunk.is_last and earlier:
                await asyncio.wait(earlier)  # the last piece goes out after every other piece
            if room not in mgr.request_status or self._failed(room):
                return  # aborted, failed or cleared: nothing (more) is announced
            infos = mgr.transfer_infos.get(room)
            if not infos:
                return
            mgr.update_status(room, base.KVPoll.Transferring)
            targets = [info for info in infos.values() if not info.is_dummy]
            started = time.perf_counter()
            async with asyncio.TaskGroup() as group:
                for target in targets:
                    group.create_task(self._announce(target, chunk, progress))
            if chunk.is_last:
                progress.last_announced = True
                progress.check()
                await self._settled(room, progress)
                log.debug("aiodatadist: room %d: %d pieces pulled by %d decode rank(s), %.2f ms after the last "
                          "chunk", room, progress.pulled, len(targets), (time.perf_counter() - started) * 1000)
                if not self._failed(room):
                    mgr.update_status(room, base.KVPoll.Success)  # D has every byte: this rank may free its pages
                    mgr.transfer_infos.pop(room, None)
                    mgr.req_to_decode_prefix_len.pop(room, None)
        except asyncio.CancelledError:
            log.debug("aiodatadist: room %d: stopped (aborted)", room)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is the room's, reported to SGLang
            reason = _reason(exc)
            log.warning("aiodatadist: room %d: transfer failed: %s", room, reason)
            await asyncio.to_thread(mgr.conclude_failure, bootstrap_room=room, failure_reason=reason)
        finally:
            tasks.remove(task)
            if not tasks:
                self.rooms.pop(room, None)
            if chunk.is_last or room not in mgr.request_status:
                self.progress.pop(room, None)
            mgr._staging_outstanding[room] -= 1
            if mgr._staging_outstanding[room] <= 0:
                mgr._staging_outstanding.pop(room, None)
            if mgr.enable_deferred_decode_kv_release:
                mgr._maybe_ack_drained_abort(room)

    async def _settled(self, room: int, progress: _Progress) -> None:
        """Wait until every piece of the room was pulled; ``LLMTimeoutError`` after the transfer timeout."""
        timeout_s = self.endpoint.options.transfer_timeout_ms / 1000
        try:
            async with asyncio.timeout(timeout_s):
                await progress.settled.wait()
        except TimeoutError:
            raise LLMTimeoutError(f"the decode rank pulled {progress.pulled} of {progress.announced} pieces of room "
                                  f"{room} within {timeout_s:g} s") from None
        if progress.failure is not None:
            raise LLMException(progress.failure, status_code=LLMStatusCode.LLM_FAILED)

    def _failed(self, room: int) -> bool:
        mgr = self.manager
        with mgr.failure_lock:
            recorded = room in mgr.failure_records
        return recorded or mgr.request_status.get(room) == base.KVPoll.Failed

    async def _announce(self, target: RoomTarget, chunk: Chunk, progress: _Progress) -> None:
        """Tell one decode rank which pages hold the chunk (and, for the last chunk, the aux row first).  A link
        that went away is made again once, and the chunk announced again (a piece pulled twice is harmless)."""
        peer = self.peers.get(target.agent_name)
        if peer is None:
            raise LLMException(f"decode rank {target.agent_name} never registered",
                               status_code=LLMStatusCode.LLM_NOT_YET_LINK)
        if peer.refusal is not None:
            raise LLMException(peer.refusal, status_code=LLMStatusCode.LLM_PARAM_INVALID)
        reg = peer.registration
        await self.endpoint.link(reg.cluster_id, reg.host, reg.port)
        notes = self._notes(chunk, peer, target)
        progress.announced += sum(1 for kind, _ in notes if kind)
        try:
            for _, note in notes:
                await self.endpoint.notify(reg.cluster_id, note)
        except LLMLinkError as exc:
            log.info("aiodatadist: decode instance %d: %s; linking again", reg.cluster_id, exc)
            self.endpoint.forget(reg.cluster_id)
            await self.endpoint.link(reg.cluster_id, reg.host, reg.port)
            for _, note in notes:
                await self.endpoint.notify(reg.cluster_id, note)

    def _notes(self, chunk: Chunk, peer: Peer, target: RoomTarget) -> list[tuple[bool, bytes]]:
        """The chunk's notifications for one decode rank: ``(is a piece to pull, message)``."""
        rank = self.manager._prefill_unique_rank()
        src = chunk.kv_indices
        start = chunk.index_slice.start or 0
        count = min(len(src), max(0, len(target.dst_kv_indices) - start))
        notes: list[tuple[bool, bytes]] = []
        aux = self._aux_row(chunk.aux_index, peer.shared_aux) if chunk.is_last else b""
        for offset in range(0, len(aux), AUX_PER_NOTE):
            notes.append((False, encode_aux(chunk.room, offset, aux[offset:offset + AUX_PER_NOTE])))
        for offset in range(0, max(count, 1), PAGES_PER_NOTE):  # an empty last chunk still sends its last piece
            end = min(count, offset + PAGES_PER_NOTE)
            last = chunk.is_last and end >= count
            notes.append((True, encode_ready(chunk.room, rank, start + offset, src[offset:end], last,
                                             len(aux) if last else 0)))
        return notes

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
