"""``AiodatadistConnector``, the class vLLM loads: its scheduler-side calls go to :class:`.scheduler.SchedulerSide`,
its worker-side calls to :class:`.worker.WorkerSide` (see the package's documentation)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .metadata import AiodatadistConnectorMetadata, peer_address
from .options import ConnectorOptions
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["AiodatadistConnector"]

GIL_YIELD_S = 0.0002
"""D: how long ``get_finished`` lets the library's loop thread run while pulls are in flight (at most), in a
step that computed something."""
IDLE_WAIT_S = 0.005
"""D: the same in a step that computed nothing (every request waits for its KV): the engine has nothing else to
do, and a pull that ends meanwhile is reported in this step."""


class AiodatadistConnector(KVConnectorBase_V1):
    """vLLM ``KVConnectorBase_V1`` on aiodatadist (see the package's documentation)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        options = ConnectorOptions.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("AiodatadistConnector does not support pipeline parallelism")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, options.layerwise)
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, options, self._kv_transfer_config.is_kv_producer)

    # -- worker side -----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        assert self._worker is not None
        return self._worker.handshake()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, AiodatadistConnectorMetadata)
        self._worker.start(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(metadata, AiodatadistConnectorMetadata) and metadata.idle
        return self._worker.finished(IDLE_WAIT_S if idle else GIL_YIELD_S)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler side --------------------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._scheduler is not None
        self._scheduler.peers = [peer_address(metadata[rank]) for rank in sorted(metadata)]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.metadata(scheduler_output.total_num_scheduled_tokens)

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, block_ids)
