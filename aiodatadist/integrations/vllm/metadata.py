"""What the connector's parts tell each other through vLLM: a P worker's address (to its scheduler), and the
scheduler's orders to its workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

__all__ = ["AiodatadistConnectorMetadata", "AiodatadistHandshake", "Load", "peer_address"]

Peer = tuple[str, int, int]
"""A P worker: ``(host, port, cluster id)``."""


@dataclass
class AiodatadistHandshake(KVConnectorHandshakeMetadata):
    """Where one P worker listens: sent by each worker to its scheduler, which puts it in kv_transfer_params."""

    host: str
    port: int
    cluster_id: int


@dataclass
class Load:
    """D: one request's pull (scheduler to worker)."""

    request_id: str
    remote_request_id: str
    peers: list[Peer]  # P's workers by TP rank
    remote_block_ids: list[int]
    local_block_ids: list[int]
    reported: bool  # the request waits for it between steps (False: only tell P, or a layer-wise load)
    layerwise: bool = False  # loaded layer by layer inside this step's forward


@dataclass
class AiodatadistConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers each step."""

    loads: list[Load] = field(default_factory=list)
    sends: list[str] = field(default_factory=list)  # P: finished requests whose blocks wait for D
    idle: bool = False  # the step computes nothing: the worker may wait a little for its pulls


def peer_address(meta: KVConnectorHandshakeMetadata) -> Peer:
    """A P worker's address from the handshake metadata it sent (``TypeError`` for another connector's)."""
    if not isinstance(meta, AiodatadistHandshake):
        raise TypeError(f"AiodatadistConnector got handshake metadata {type(meta).__name__}")
    return (meta.host, meta.port, meta.cluster_id)
