"""The connector's scheduler side: what each request loads (D) or keeps for a decoder (P), in vLLM's scheduler."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .metadata import AiodatadistConnectorMetadata, Load, Peer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

log = logging.getLogger("aiodatadist.integrations.vllm")


class SchedulerSide:
    """Decides what each request loads (D) or keeps for a decoder (P); runs in vLLM's scheduler."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, layerwise: bool) -> None:
        self.layerwise = layerwise
        groups = len(kv_cache_config.kv_cache_groups)
        if groups != 1:
            raise ValueError(f"AiodatadistConnector supports models with one KV cache group, this one has {groups}")
        self.engine_id = secrets.token_hex(8)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.peers: list[Peer] = []  # this engine's workers, when they listen (P)
        self._pending = AiodatadistConnectorMetadata()

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and _remote_blocks(params):
            prompt = len(request.prompt_token_ids or ())
            # Layer-wise loads happen inside the forward that computes the last prompt token, so that one is left
            # to compute (its KV slot is loaded, then overwritten by the forward after its layer's load ended).
            count = prompt - num_computed_tokens - (1 if self.layerwise else 0)
            if count > 0:
                return count, not self.layerwise
        return 0, False

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one load per request
        remote = _remote_blocks(params)
        local = blocks.get_unhashed_block_ids_all_groups()[0] if num_external_tokens > 0 else []
        layerwise = self.layerwise and bool(local)
        self._pending.loads.append(_load(request.request_id, params, remote, local,
                                         reported=bool(local) and not layerwise, layerwise=layerwise))

    def finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # D: aborted before it was scheduled; P must still free its blocks
            params["do_remote_prefill"] = False
            self._pending.loads.append(_load(request.request_id, params, [], [], reported=False))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        ids = _first_group(block_ids)
        if not ids:
            return False, None
        if not self.peers:
            log.warning("aiodatadist: request %s asks for a remote decode, but this engine's workers do not serve "
                        "KV (kv_role kv_consumer?): its blocks are freed now", request.request_id)
            return False, None
        self._pending.sends.append(request.request_id)
        host, port, _ = self.peers[0]
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [ids],
            "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
            "remote_host": host, "remote_port": port, "remote_num_tokens": request.num_computed_tokens,
            "tp_size": self.tp_size, "aiodatadist": [list(peer) for peer in self.peers],
        }

    def metadata(self, scheduled_tokens: int) -> AiodatadistConnectorMetadata:
        metadata, self._pending = self._pending, AiodatadistConnectorMetadata()
        metadata.idle = scheduled_tokens == 0
        return metadata


def _first_group(block_ids: Any) -> list[int]:
    """Block ids as a flat list: vLLM passes one list, or one list per KV cache group (of which there is one)."""
    blocks = list(block_ids or ())
    if blocks and isinstance(blocks[0], (list, tuple)):
        blocks = list(blocks[0])
    return [int(b) for b in blocks]


def _remote_blocks(params: Mapping[str, Any]) -> list[int]:
    return _first_group(params.get("remote_block_ids"))


def _load(request_id: str, params: Mapping[str, Any], remote: list[int], local: list[int], *,
          reported: bool, layerwise: bool = False) -> Load:
    peers = [(str(h), int(p), int(c)) for h, p, c in params.get("aiodatadist") or ()]
    return Load(request_id, str(params.get("remote_request_id", "")), peers, remote, list(local), reported,
                 layerwise)
