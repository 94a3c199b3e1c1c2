"""A vLLM KV connector on aiodatadist: prefill/decode disaggregation between vLLM engines.

Load it with vLLM's ``KVTransferConfig`` (no extra config is needed between engines on one host)::

    KVTransferConfig(kv_connector="AiodatadistConnector",
                     kv_connector_module_path="aiodatadist.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={})   # optional keys: see ConnectorOptions

It follows vLLM's NixlConnector protocol, so the same proxies and clients drive it:

1. the prefill engine (P) gets a request with ``kv_transfer_params={"do_remote_decode": True}``; when it finishes,
   P keeps the request's blocks and returns ``kv_transfer_params`` naming them and where P's workers listen;
2. the decode engine (D) gets the same prompt with those ``kv_transfer_params``; D's scheduler allocates blocks
   (a local prefix-cache hit shortens what is loaded to the last remote blocks), and D's worker (tensor-parallel
   rank i, from rank i of P) links to P once and pulls the blocks asynchronously: ``start_load_kv`` never blocks,
   ``get_finished`` reports the request once its pull ended;
3. the pull carries a notification to P (aiodatadist's ``notify=``), on which P frees the blocks; a lease
   (``lease_seconds``) frees them if D never pulls.

A failed pull reports the request's blocks through ``get_block_ids_with_load_errors`` (vLLM recomputes them).
Every KV cache tensor of a layer is registered once with aiodatadist (``register_blocks_cache``, the engine's own
memory, host or CUDA device); a same-host pull reads P's memory directly after the first (no round trip through P's
busy Python thread).  The connector uses aiodatadist's blocking API (:mod:`aiodatadist.sync`) and its loop thread.

With ``layerwise`` (``kv_connector_extra_config``), D instead loads the request inside the forward that computes
its last prompt token, one pull per layer, and each attention layer waits only for its own layer
(``wait_for_layer_load``): the transfer of the later layers overlaps the computation of the earlier ones.

Limits: models with one KV cache group (no hybrid attention), equal tensor parallelism on P and D, no pipeline
parallelism; P does not push layer by layer while it prefills (``save_kv_layer`` does nothing: D's blocks are
not known before P's request ends).

The parts: :mod:`.connector` (the class vLLM loads), :mod:`.scheduler` (its scheduler side), :mod:`.worker` (its
worker side: the instance, the pulls), :mod:`.metadata` (what the sides tell each other through vLLM),
:mod:`.options` and :mod:`.layout` (where a layer's KV blocks lie).  The package's names load on first use, so
that importing it, or its options, imports neither vLLM nor torch; vLLM's loader, asking the package for
``AiodatadistConnector``, imports both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_names

if TYPE_CHECKING:
    from .connector import AiodatadistConnector
    from .metadata import AiodatadistConnectorMetadata, AiodatadistHandshake
    from .options import ConnectorOptions

__all__ = ["AiodatadistConnector", "AiodatadistConnectorMetadata", "AiodatadistHandshake", "ConnectorOptions"]

_WHERE = {
    "AiodatadistConnector": "connector",
    "AiodatadistConnectorMetadata": "metadata",
    "AiodatadistHandshake": "metadata",
    "ConnectorOptions": "options",
    "block_regions": "layout",
}

__getattr__, __dir__ = lazy_names(__name__, globals(), _WHERE)
