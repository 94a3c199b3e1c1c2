"""What the engine adapters share: how an engine's options configure its aiodatadist instance.

Each adapter (:mod:`.vllm`, :mod:`.sglang`) runs one instance per engine worker, on the blocking API, under a
random cluster id (:func:`random_cluster_id`), configured (:func:`llm_config`) from the same few options under
its engine's own names: the transport, a shared key, the bound of one transfer, the GPU that holds the KV cache,
and where to listen.  This module imports no engine and not the library's I/O (an adapter's option parsing
imports it in every engine process).
"""

from __future__ import annotations

import secrets
from typing import Final

from ..config import LLMConfig
from ..types import Transport

__all__ = ["CLUSTER_ID_BITS", "TRANSPORTS", "check_transport", "llm_config", "random_cluster_id"]

TRANSPORTS: Final = tuple(transport.value for transport in Transport)
"""The transports an engine's options may name (``llm.Transport``: auto, shm, tcp, nixl)."""
CLUSTER_ID_BITS: Final = 62
"""An adapter's instance takes a random cluster id in ``[1, 2**CLUSTER_ID_BITS]``."""


def check_transport(transport: str, option: str) -> None:
    """``ValueError`` naming ``option`` (the engine's name for it) unless ``transport`` is one of
    :data:`TRANSPORTS`."""
    if transport not in TRANSPORTS:
        raise ValueError(f"{option} must be one of {', '.join(TRANSPORTS)}, got {transport!r}")


def llm_config(*, transport: str, auth_key: str, transfer_timeout_ms: int, device_index: int | None = None,
               listen: tuple[str, int] | None = None) -> LLMConfig:
    """The ``LLMConfig`` of an engine worker's instance: ``transport`` (one of :data:`TRANSPORTS`), ``auth_key``
    (``llm.AuthKey``; empty: none), ``transfer_timeout_ms`` (``sync_kv_timeout``: the bound of one transfer),
    ``device_index`` (the CUDA ordinal of a GPU KV cache; None: host memory) and ``listen`` (``(host, port)`` the
    instance listens on, port 0 for any free port; None: it does not listen)."""
    config = LLMConfig()
    config.sync_kv_timeout = transfer_timeout_ms
    config.transport = transport
    if auth_key:
        config.auth_key = auth_key
    if device_index is not None:
        config.device_id = device_index
    if listen is not None:
        host, port = listen
        config.listen_ip_info = f"{host}:{port}"
    return config


def random_cluster_id() -> int:
    """A cluster id for an engine worker's instance: random, so that no two workers need to agree on one."""
    return secrets.randbits(CLUSTER_ID_BITS) + 1
