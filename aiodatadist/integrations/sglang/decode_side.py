"""The decode rank's half of the backend: it pulls each request's pages from the prefill rank into its own pages.

Two readers run on aiodatadist's loop thread:

* aiodatadist's notifications from the prefill ranks (:mod:`.wire`): a ``kv-ready`` starts a pull of those pages
  (one pull per KV group, every layer at once; one-sided after the link's first pull: the prefill's busy Python
  thread is not involved) into the room's pages, and the pull carries ``kv-pulled`` back; ``kv-aux`` pieces make
  the request's aux row.  After the room's last piece (and every earlier one) landed, the aux row is copied into
  this rank's aux buffers and the room counts as that prefill rank's ``Success`` (SGLang's
  ``apply_prefill_status``).  A failed pull fails the room here and tells the prefill rank (``kv-failed``);
* the manager's ZeroMQ socket: SGLang's status messages (a prefill rank's ``Failed``, with its reason) and abort
  acknowledgements.

Only this rank writes into its pages, so a failed or aborted room is reported to SGLang (which then frees its pages)
only once its pulls have stopped (:meth:`DecodeSide.busy`, :meth:`DecodeSide.stop`); the scheduler's ``poll()``
never waits.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq
import zmq.asyncio

from ._sglang import base
from .endpoint import Endpoint
from .layout import BufferGroup
from .wire import AuxPiece, Ready, encode_failed, encode_pulled, parse_note

__all__ = ["DecodeSide"]

log = logging.getLogger("aiodatadist.integrations.sglang")


class DecodeSide:
    """The decode manager's pulls and readers (``manager``: the SGLang ``CommonKVManager`` subclass that owns it)."""

    def __init__(self, manager: Any, endpoint: Endpoint, kv_groups: Sequence[BufferGroup]) -> None:
        self.manager = manager
        self.endpoint = endpoint
        self.kv_groups = list(kv_groups)
        self.targets: dict[int, tuple[npt.NDArray[np.int32], int | None]] = {}  # room -> its pages, its aux row
        self.pulls: dict[int, list[asyncio.Task[None]]] = {}  # room -> its pulls in flight (loop thread)
        self.aux: dict[int, bytearray] = {}  # room -> its aux row so far (loop thread)
        endpoint.run(self.read_notes)
        endpoint.run(self.read_control)

    # -- the scheduler thread --------------------------------------------------------------------------------
    def expect(self, room: int, kv_indices: Any, aux_index: int | None) -> None:
        """The scheduler sends room ``room``'s metadata: its pages and aux row here."""
        self.targets[room] = (np.array(kv_indices, dtype=np.int32, copy=True), aux_index)

    def forget(self, room: int) -> None:
        """The room is cleared."""
        self.targets.pop(room, None)

    def busy(self, room: int) -> bool:
        """Whether a pull of ``room`` may still write into this rank's pages."""
        return bool(self.pulls.get(room))

    def stop(self, room: int) -> None:
        """Cancel the room's pulls (returns at once; :meth:`busy` turns False once they stopped)."""
        self.endpoint.start(lambda: self._stop(room))

    async def _stop(self, room: int) -> None:
        for task in self.pulls.get(room, ()):
            task.cancel()

    # -- readers (loop thread) -------------------------------------------------------------------------------
    async def read_notes(self) -> None:
        """The prefill ranks' notifications; ends when the instance is finalized."""
        async for note in self.endpoint.dd.aio.notifications():
            message = parse_note(note.message)
            if isinstance(message, Ready):
                self.on_ready(note.cluster_id, message)
            elif isinstance(message, AuxPiece):
                row = self.aux.setdefault(message.room, bytearray())
                end = message.offset + len(message.data)
                if len(row) < end:
                    row.extend(bytes(end - len(row)))
                row[message.offset:end] = message.data
            else:
                log.warning("aiodatadist: unexpected notification from cluster %d dropped", note.cluster_id)

    async def read_control(self) -> None:
        """SGLang's status messages and abort acknowledgements, until cancelled."""
        mgr = self.manager
        sock = zmq.asyncio.Socket.from_socket(mgr.server_socket)
        while True:
            frames = await sock.recv_multipart()
            try:
                if mgr.handle_abort_ack_message(frames):
                    continue
                parsed = mgr.parse_kv_status_message(frames)
                if parsed is None:
                    log.warning("aiodatadist: unexpected decode control message dropped (%d frames)", len(frames))
                    continue
                room, status, prefill_rank, reason = parsed
                mgr.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=prefill_rank,
                                         failure_reason=reason)
            except Exception:  # a bad message never stops the reader
                log.exception("aiodatadist: decode control message dropped")

    # -- pulls (loop thread) ---------------------------------------------------------------------------------
    def on_ready(self, cluster_id: int, ready: Ready) -> None:
        """Start the pull of a piece (the room's last piece waits for the earlier ones before it concludes)."""
        room = ready.room
        target = self.targets.get(room)
        if target is None or room not in self.manager.request_status:
            log.debug("aiodatadist: room %d: piece for a room not (or no longer) here dropped", room)
            self.aux.pop(room, None)
            return
        tasks = self.pulls.setdefault(room, [])
        task = asyncio.ensure_future(self._pull(cluster_id, ready, target, list(tasks)))
        tasks.append(task)
        task.add_done_callback(lambda done: self._pulled(room, done))

    def _pulled(self, room: int, task: asyncio.Task[None]) -> None:
        tasks = self.pulls.get(room)
        if tasks is not None:
            tasks.remove(task)
            if not tasks:
                del self.pulls[room]

    async def _pull(self, cluster_id: int, ready: Ready, target: tuple[npt.NDArray[np.int32], int | None],
                    earlier: list[asyncio.Task[None]]) -> None:
        mgr = self.manager
        room = ready.room
        pages, aux_index = target
        count = min(len(ready.src), max(0, len(pages) - ready.start))
        src, dst = ready.src[:count], pages[ready.start:ready.start + count]
        ack = encode_pulled(room)
        started = time.perf_counter()
        try:
            if count:
                groups = self.kv_groups
                await asyncio.gather(*(self.endpoint.pull_pages(cluster_id, g.model_id, src, dst) for g in groups[:-1]))
                await self.endpoint.pull_pages(cluster_id, groups[-1].model_id, src, dst, notify=ack)
            else:
                await self.endpoint.notify(cluster_id, ack)
            log.debug("aiodatadist: room %d: %d pages pulled from cluster %d in %.2f ms", room, count, cluster_id,
                      (time.perf_counter() - started) * 1000)
            if not ready.last:
                return
            if earlier:
                await asyncio.wait(earlier)
            with mgr.failure_lock:
                failed = room in mgr.failure_records
            if failed or room not in mgr.request_status:
                return
            self._write_aux(room, aux_index, bytes(self.aux.pop(room, b"")), ready.aux_len)
            mgr.apply_prefill_status(bootstrap_room=room, status=base.KVPoll.Success,
                                     prefill_rank=ready.prefill_rank)
        except asyncio.CancelledError:
            log.debug("aiodatadist: room %d: pull cancelled", room)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is the room's, reported to SGLang and to P
            reason = f"aiodatadist: {type(exc).__name__}: {exc}"
            log.warning("aiodatadist: room %d: pull from cluster %d failed: %s", room, cluster_id, reason)
            mgr.record_failure(room, reason)
            mgr.update_status(room, base.KVPoll.Failed)
            try:
                await self.endpoint.notify(cluster_id, encode_failed(room, reason))
            except Exception:  # best effort: P also stops waiting at its timeout
                log.debug("aiodatadist: room %d: could not tell the prefill rank", room, exc_info=True)

    def _write_aux(self, room: int, row: int | None, aux: bytes, expected: int) -> None:
        """Copy the request's aux row into this rank's aux buffers (the first buffers, back to back)."""
        args = self.manager.kv_args
        if len(aux) != expected or (aux and row is None):
            raise ValueError(f"aux row of {len(aux)} bytes received, {expected} announced (row {row})")
        offset = 0
        for ptr, item in zip(args.aux_data_ptrs, args.aux_item_lens, strict=True):
            if offset >= len(aux):
                break
            if offset + item > len(aux):
                raise ValueError(f"aux row of {len(aux)} bytes does not end on this rank's buffer boundaries")
            ctypes.memmove(ptr + item * (row or 0), aux[offset:offset + item], item)
            offset += item
