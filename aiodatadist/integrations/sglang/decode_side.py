"""The decode rank's half of the backend: it listens, and learns how each request's transfer ended.

The prefill ranks push into this rank's registered caches; nothing runs here for a push (aiodatadist's owner side
answers it on the loop thread).  Two readers run on aiodatadist's loop thread:

* the notifications of aiodatadist: a prefill rank's "done" for a room (delivered only after every push of the
  room landed; with the request's aux row inside when it fits, copied into this rank's row first) counts as that
  rank's ``Success`` (SGLang's ``apply_prefill_status``: the room succeeds once every
  prefill rank it waits for has succeeded);
* the manager's ZeroMQ socket: SGLang's status messages (a prefill rank's ``Failed``, with its reason) and abort
  acknowledgements.

The scheduler's ``poll()`` only reads the status these readers set: it never waits.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import zmq
import zmq.asyncio

from ._sglang import base
from .endpoint import Endpoint
from .wire import decode_done

__all__ = ["DecodeSide"]

log = logging.getLogger("aiodatadist.integrations.sglang")


class DecodeSide:
    """The decode manager's readers (``manager``: the SGLang ``CommonKVManager`` subclass that owns it)."""

    def __init__(self, manager: Any, endpoint: Endpoint) -> None:
        self.manager = manager
        self.endpoint = endpoint
        self.aux_rows: dict[int, int] = {}  # room -> this rank's aux row for it
        endpoint.run(self.read_notifications)
        endpoint.run(self.read_control)

    async def read_notifications(self) -> None:
        """A prefill rank's "done" for a room: its aux row (when inline) written into this rank's row, then its
        ``Success``; ends when the instance is finalized."""
        async for note in self.endpoint.dd.aio.notifications():
            done = decode_done(note.message)
            if done is None:
                log.warning("aiodatadist: unexpected notification from cluster %d dropped", note.cluster_id)
                continue
            room, prefill_rank, aux = done
            row = self.aux_rows.pop(room, None)
            if room not in self.manager.request_status:
                continue  # a late "done" for a room already cleared (aborted, timed out)
            if aux and not self._write_aux(room, row, aux):
                continue
            self.manager.apply_prefill_status(bootstrap_room=room, status=base.KVPoll.Success,
                                              prefill_rank=prefill_rank)

    def expect(self, room: int, aux_index: int | None) -> None:
        """The scheduler sent room ``room``'s metadata: its aux row is ``aux_index`` (scheduler thread)."""
        if aux_index is not None:
            self.aux_rows[room] = aux_index

    def forget(self, room: int) -> None:
        """The room is cleared (scheduler thread)."""
        self.aux_rows.pop(room, None)

    def _write_aux(self, room: int, row: int | None, aux: bytes) -> bool:
        """Copy an inline aux row into this rank's buffers (the first buffers, back to back); a row that does not
        match them fails the room."""
        args = self.manager.kv_args
        offsets, total = [], 0
        for item in args.aux_item_lens:
            if total >= len(aux):
                break
            offsets.append(total)
            total += item
        if row is None or total != len(aux):
            reason = f"inline aux row of {len(aux)} bytes does not match this rank's buffers (row {row})"
            log.warning("aiodatadist: room %d: %s", room, reason)
            self.manager.record_failure(room, reason)
            self.manager.update_status(room, base.KVPoll.Failed)
            return False
        for i, offset in enumerate(offsets):
            item = args.aux_item_lens[i]
            ctypes.memmove(args.aux_data_ptrs[i] + item * row, aux[offset:offset + item], item)
        return True

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
