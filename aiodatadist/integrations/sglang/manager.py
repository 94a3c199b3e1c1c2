"""SGLang's KV manager, sender, receiver and bootstrap server for ``--disaggregation-transfer-backend aiodatadist``.

As SGLang's own NIXL backend, the sender, receiver and bootstrap server are SGLang's common ones (HTTP bootstrap,
rank pairing, registration and per-request metadata over ZeroMQ, timeouts, aborts, status); the manager is where the
bytes move:

* at start-up it registers SGLang's KV buffers (one cache per page size: all layers' K and V) and aux buffers as
  aiodatadist blocks caches, once (:mod:`.layout`, :class:`.endpoint.Endpoint`); a decode rank's KV buffers in
  host memory are first shared in place (``share_host_memory``), so that prefill ranks on the same host push
  into them with ``memcpy``;
* a decode rank's instance listens, and its registration tells each prefill rank where (:mod:`.wire`);
* a prefill rank pushes each chunk's pages straight into the decode rank's pages (``push_blocks`` of page
  indices, every layer in one call), then the aux row, then notifies the decode rank (:mod:`.prefill_side`,
  :mod:`.decode_side`).

SGLang's scheduler thread only hands chunks over and reads statuses: every transfer, link and message runs on
aiodatadist's loop thread.  Supported: full-attention KV pools (MHA, and MLA with any TP pairing SGLang makes),
equal attention TP sizes for MHA, no pipeline or context parallelism, page sizes equal on both engines.  Pools
with extra state (Mamba, sliding window, DSA, ...) are refused at start-up with a message that says so.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ...errors import LLMException, LLMStatusCode
from ...settings.environment import ENV_COPY_NICE, default_unless_set
from ...types import Placement
from ._sglang import base, common, utils
from .decode_side import DecodeSide
from .endpoint import Endpoint
from .layout import AUX_MODEL_BASE, group_buffers
from .options import BackendOptions
from .prefill_side import Chunk, PrefillSide
from .wire import PeerRegistration, RoomTarget

__all__ = ["AiodatadistKVBootstrapServer", "AiodatadistKVManager", "AiodatadistKVReceiver",
           "AiodatadistKVSender"]

log = logging.getLogger("aiodatadist.integrations.sglang")


def _unsupported(manager: Any, args: Any) -> str | None:
    """Why this engine's layout cannot be served, or None."""
    if getattr(args, "state_types", None):
        return (f"KV pools with extra state ({', '.join(str(t) for t in args.state_types)}) are not supported; "
                "only full-attention KV pools are")
    if manager.pp_size > 1:
        return "pipeline parallelism is not supported"
    if manager.attn_cp_size > 1 or manager.dcp_size > 1 or manager.kv_shard_size > 1:
        return "context parallelism and KV sharding are not supported"
    return None


class AiodatadistKVManager(common.CommonKVManager):
    """One per scheduler (TP rank) of a prefill or decode engine."""

    kv_status_msg_tag = b"KV_STATUS"  # status messages carry a tag and the failure's reason
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True  # the sender times first chunk -> Success (SGLang's kv_transfer_latency)
    supports_deferred_decode_kv_release = True  # ABORT_ACK once an aborted room's pushes have stopped

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False,
                 **kwargs: Any) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        refusal = _unsupported(self, args)
        if refusal is not None:
            raise ValueError(f"--disaggregation-transfer-backend aiodatadist: {refusal}")
        self.options = BackendOptions.from_environ()
        device = str(getattr(server_args, "device", "cpu") or "cpu")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"--disaggregation-transfer-backend aiodatadist: device {device!r} is not supported "
                             "(cpu or cuda)")
        decode = disaggregation_mode == utils.DisaggregationMode.DECODE
        # SGLang's scheduler thread polls without sleeping while a transfer is in flight: copy threads below its
        # priority (the library's default, for an asyncio server's loop) get a tenth of a pinned core against it,
        # where NIXL's copies run at its priority.  Set before the endpoint starts the process's copy threads; a
        # value the user set is kept.
        default_unless_set(ENV_COPY_NICE, "0")
        listen = (self.options.listen_host or self.local_ip) if decode else None
        self.endpoint = Endpoint(self.options, listen, args.gpu_id if device == "cuda" else None)
        kv_groups = group_buffers(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)
        aux_groups = group_buffers(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, AUX_MODEL_BASE)
        if decode and device == "cpu" and self.options.share_kv == "on":  # prefill ranks push into these pages
            self.endpoint.share_in_place(kv_groups)
        self.endpoint.register(kv_groups)
        self.endpoint.register(aux_groups, Placement.HOST)  # SGLang keeps its metadata buffers in host memory
        log.info("aiodatadist: %s rank %d registered %d KV buffers (%s) and %d aux buffers as cluster %d%s",
                 "decode" if decode else "prefill", args.engine_rank, len(args.kv_data_ptrs),
                 ", ".join(f"{len(g.addrs)} x {g.blocks} pages of {g.item_len} B" for g in kv_groups),
                 len(args.aux_data_ptrs), self.endpoint.cluster_id,
                 f", listening on {self.endpoint.address[0]}:{self.endpoint.address[1]}" if decode else "")
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        if decode:
            self.decode = DecodeSide(self, self.endpoint)
            self._start_heartbeat_checker_thread()
        else:
            self.prefill = PrefillSide(self, self.endpoint, kv_groups, aux_groups)

    def check_status(self, bootstrap_room: int) -> Any:
        """The room's ``KVPoll`` (``WaitingForInput`` for a room not seen yet, as SGLang's NIXL backend)."""
        return self.request_status.get(bootstrap_room, base.KVPoll.WaitingForInput)

    def add_transfer_request(self, bootstrap_room: int, kv_indices: Any, index_slice: slice, is_last_chunk: bool,
                             aux_index: int | None = None, state_indices: Any = None, num_kv_tokens: int | None = None,
                             **kwargs: Any) -> None:
        """Called by the sender's ``send`` on the scheduler thread: hand the chunk to the loop thread."""
        if self.prefill is None:
            raise LLMException("add_transfer_request on a decode rank", status_code=LLMStatusCode.LLM_FAILED)
        if bootstrap_room not in self.transfer_infos:
            return  # a dummy rank, or a room already cleared
        indices = np.array(kv_indices, dtype=np.int64, copy=True)  # the caller may reuse its array
        self.prefill.submit_chunk(Chunk(bootstrap_room, indices, index_slice, is_last_chunk, aux_index))

    def build_receiver_registration_message(self) -> list[bytes]:
        """Decode: where this rank's instance listens, and its buffer layout (sent once to each prefill rank)."""
        host, port = self.endpoint.address
        args = self.kv_args
        return PeerRegistration(
            agent_name=str(self.endpoint.cluster_id), endpoint=self.local_ip, dst_port=self.rank_port,
            cluster_id=self.endpoint.cluster_id, host=host, port=port, tp_size=self.attn_tp_size,
            tp_rank=args.engine_rank, page_size=args.page_size, kv_item_lens=tuple(args.kv_item_lens),
            aux_item_lens=tuple(args.aux_item_lens)).encode()

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int, kv_indices: Any,
                                        aux_index: int | None, state_indices: Any, decode_prefix_len: int | None,
                                        is_dummy: bool, device_kv_indices: Any = None) -> list[bytes]:
        """Decode: the pages and aux row of one request (sent to each prefill rank it waits for)."""
        if self.decode is not None:
            self.decode.expect(bootstrap_room, aux_index)
        indices = np.asarray(kv_indices if not is_dummy else (), dtype=np.int32)
        return RoomTarget(
            room=bootstrap_room, agent_name=str(self.endpoint.cluster_id), endpoint=self.local_ip,
            dst_port=self.rank_port, dst_kv_indices=indices, dst_aux_index=int(aux_index or 0),
            required_dst_info_num=required_dst_info_num, decode_prefix_len=int(decode_prefix_len or 0),
            is_dummy=is_dummy).encode()


class AiodatadistKVSender(common.CommonKVSender):
    """SGLang's common sender (chunk bookkeeping, timeouts, abort), on :class:`AiodatadistKVManager`.

    An abort on the prefill side also stops the room's pushes and, once nothing more can land, tells the decode
    ranks (SGLang's common sender only marks the room failed locally: the decode would wait for its timeout)."""

    def abort(self) -> None:
        """Fail the room here, stop its pushes, then tell its decode ranks (in the background)."""
        mgr = self.kv_mgr
        targets = mgr._room_notify_targets(self.bootstrap_room)
        super().abort()
        if mgr.prefill is not None and targets:
            mgr.prefill.abort_room(self.bootstrap_room, targets)


class AiodatadistKVReceiver(common.CommonKVReceiver):
    """SGLang's common receiver (bootstrap, registration, metadata, abort), on :class:`AiodatadistKVManager`."""

    def clear(self) -> None:
        """SGLang's clear, and the room's aux row forgotten."""
        super().clear()
        if self.kv_mgr.decode is not None:
            self.kv_mgr.decode.forget(self.bootstrap_room)


class AiodatadistKVBootstrapServer(common.CommonKVBootstrapServer):
    """SGLang's common HTTP bootstrap server (rank discovery)."""
