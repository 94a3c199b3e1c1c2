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
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import logging
import math
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..cache import Cache
from ..config import LLMConfig
from ..errors import LLMException, LLMStatusCode
from ..sync import LLMDataDist as SyncLLMDataDist
from ..sync import TransferFuture, submit
from ..torch import from_torch_dtype, placement_of
from ..types import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMRole, Placement

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["AiodatadistConnector", "AiodatadistConnectorMetadata", "AiodatadistHandshake", "ConnectorOptions"]

log = logging.getLogger("aiodatadist.integrations.vllm")

MODEL_ID = 0
"""The ``BlocksCacheKey.model_id`` every worker registers its KV cache under."""
GIL_YIELD_S = 0.0002
"""D: how long ``get_finished`` lets the library's loop thread run while pulls are in flight (at most), in a
step that computed something."""
IDLE_WAIT_S = 0.005
"""D: the same in a step that computed nothing (every request waits for its KV): the engine has nothing else to
do, and a pull that ends meanwhile is reported in this step."""
MAX_EARLY_NOTES = 65536
"""P: notifications kept for requests the scheduler has not handed to the worker yet."""


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` keys (all optional).

    ``listen_host``: the address P's workers listen on and announce to D ("127.0.0.1"; set it to the host's
    address for D engines on other hosts).  ``port_base``: rank i listens on ``port_base + i`` (0: free ports,
    chosen for you).  ``auth_key``: a shared key every engine must present (``llm.AuthKey``).  ``transport``:
    ``auto`` (shared memory on one host, TCP across), ``shm``, ``tcp`` or ``nixl``.  ``lease_seconds``: how long P keeps
    a request's blocks for a D that never pulls them (480, as vLLM's NIXL abort timeout).  ``pull_timeout_ms``:
    the bound of one pull (``sync_kv_timeout``, 30000).  ``link_timeout_ms``: the bound of linking to a P
    worker (5000).  ``layerwise``: D loads each layer on its own, inside the forward that computes the request's
    last prompt token, and each attention layer waits only for its own layer (``wait_for_layer_load``), so the
    transfer of the later layers overlaps the computation of the earlier ones (False: the whole request is
    loaded between steps, as NixlConnector does).  ``share_kv``: a host KV cache is shared in place at start-up
    (``share_host_memory``), so that a same-host peer copies it with ``memcpy`` on its copy threads rather than
    reading it with ``process_vm_readv`` (True; where it cannot be shared, a warning, and transfers take the
    slower way)."""

    listen_host: str = "127.0.0.1"
    port_base: int = 0
    auth_key: str = ""
    transport: str = "auto"
    lease_seconds: float = 480.0
    pull_timeout_ms: int = 30000
    link_timeout_ms: int = 5000
    layerwise: bool = False
    share_kv: bool = True

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        """Parse ``kv_connector_extra_config``: unknown keys and wrong types raise ``ValueError``."""
        extra = dict(extra or {})
        fields = cls.__dataclass_fields__
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(f"AiodatadistConnector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(fields)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind = type(getattr(cls, name))
            try:
                if kind is bool:
                    if str(value).lower() not in ("true", "false", "1", "0"):
                        raise ValueError(value)
                    values[name] = str(value).lower() in ("true", "1")
                else:
                    values[name] = kind(value)
            except (TypeError, ValueError):
                raise ValueError(f"AiodatadistConnector: {name} must be {kind.__name__}, got {value!r}") from None
        options = cls(**values)
        if not 0 <= options.port_base <= 65535:
            raise ValueError(f"AiodatadistConnector: port_base {options.port_base} out of range")
        if options.transport not in ("auto", "shm", "tcp", "nixl"):
            raise ValueError(f"AiodatadistConnector: transport must be auto, shm, tcp or nixl, got "
                             f"{options.transport!r}")
        return options


@dataclass
class AiodatadistHandshake(KVConnectorHandshakeMetadata):
    """Where one P worker listens: sent by each worker to its scheduler, which puts it in kv_transfer_params."""

    host: str
    port: int
    cluster_id: int


@dataclass
class _Load:
    """D: one request's pull (scheduler to worker)."""

    request_id: str
    remote_request_id: str
    peers: list[tuple[str, int, int]]  # P's workers by TP rank: (host, port, cluster id)
    remote_block_ids: list[int]
    local_block_ids: list[int]
    reported: bool  # the request waits for it between steps (False: only tell P, or a layer-wise load)
    layerwise: bool = False  # loaded layer by layer inside this step's forward


@dataclass
class AiodatadistConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers each step."""

    loads: list[_Load] = field(default_factory=list)
    sends: list[str] = field(default_factory=list)  # P: finished requests whose blocks wait for D
    idle: bool = False  # the step computes nothing: the worker may wait a little for its pulls


class AiodatadistConnector(KVConnectorBase_V1):
    """vLLM ``KVConnectorBase_V1`` on aiodatadist (see the module's documentation)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        options = ConnectorOptions.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("AiodatadistConnector does not support pipeline parallelism")
        self._scheduler: _Scheduler | None = None
        self._worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _Scheduler(vllm_config, kv_cache_config, options.layerwise)
        else:
            self._worker = _Worker(vllm_config, kv_cache_config, options, self._kv_transfer_config.is_kv_producer)

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
        self._scheduler.peers = [_peer(metadata[rank]) for rank in sorted(metadata)]

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


def _peer(meta: KVConnectorHandshakeMetadata) -> tuple[str, int, int]:
    if not isinstance(meta, AiodatadistHandshake):
        raise TypeError(f"AiodatadistConnector got handshake metadata {type(meta).__name__}")
    return (meta.host, meta.port, meta.cluster_id)


# -- scheduler ---------------------------------------------------------------------------------------------------
class _Scheduler:
    """Decides what each request loads (D) or keeps for a decoder (P); runs in vLLM's scheduler."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, layerwise: bool) -> None:
        self.layerwise = layerwise
        groups = len(kv_cache_config.kv_cache_groups)
        if groups != 1:
            raise ValueError(f"AiodatadistConnector supports models with one KV cache group, this one has {groups}")
        self.engine_id = secrets.token_hex(8)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.peers: list[tuple[str, int, int]] = []  # this engine's workers, when they listen (P)
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
          reported: bool, layerwise: bool = False) -> _Load:
    peers = [(str(h), int(p), int(c)) for h, p, c in params.get("aiodatadist") or ()]
    return _Load(request_id, str(params.get("remote_request_id", "")), peers, remote, list(local), reported,
                 layerwise)


# -- worker ------------------------------------------------------------------------------------------------------
@dataclass
class _Running:
    future: TransferFuture[None]
    local_block_ids: list[int]
    reported: bool
    layers: _LayerProgress | None = None  # a layer-wise load


class _LayerProgress:
    """Which layers of a layer-wise load have landed (set on the loop thread, waited for by the forward)."""

    def __init__(self, layers: int) -> None:
        self.done = [threading.Event() for _ in range(layers)]

    def finish(self) -> None:
        """The load ended (or failed): nobody waits any more."""
        for event in self.done:
            event.set()


class _Worker:
    """One aiodatadist instance per vLLM worker: it serves this worker's KV cache to D engines (P) and pulls from
    P engines into it (D)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, options: ConnectorOptions,
                 producer: bool) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.options = options
        self.listens = producer
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.num_blocks = kv_cache_config.num_blocks
        self.layer_index: dict[str, int] = {}  # layer name -> its index in the registered cache
        self.tensors_per_layer = 1
        self.dd: SyncLLMDataDist | None = None
        self.cache: Cache | None = None
        self.loads: dict[str, _Running] = {}
        self.sends: dict[str, float] = {}  # P: request id -> lease expiry (time.monotonic())
        self.early: collections.OrderedDict[str, None] = collections.OrderedDict()  # notified before sends
        self.notes: collections.deque[str] = collections.deque()  # filled on the loop thread
        self.load_errors: set[int] = set()
        self.linking: dict[int, Any] = {}  # cluster id -> asyncio task (loop thread only)
        self.collector: TransferFuture[None] | None = None

    # -- setup -----------------------------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Register every layer's KV tensor(s) as one blocks cache, and start the instance."""
        tensors = list(kv_caches.values())
        if not tensors:
            raise ValueError("AiodatadistConnector: no KV cache tensors to register")
        addrs: list[int] = []
        block_elems = None
        for tensor in tensors:
            tensor_addrs, elems = block_regions(tensor, self.num_blocks)
            if block_elems not in (None, elems) or tensor.dtype != tensors[0].dtype:
                raise ValueError("AiodatadistConnector: the layers' KV caches differ in block size or dtype")
            block_elems = elems
            addrs.extend(tensor_addrs)
        assert block_elems is not None
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.tensors_per_layer = len(addrs) // len(tensors)
        dtype = tensors[0].dtype
        try:
            data_type = from_torch_dtype(dtype)
        except (LLMException, TypeError, ValueError):  # e.g. fp8 KV caches: moved as bytes
            data_type, block_elems = DataType.DT_UINT8, block_elems * dtype.itemsize
        placement = placement_of(tensors[0].device)
        self.dd = self._start(tensors[0].device.index if placement == Placement.DEVICE else None)
        if placement != Placement.DEVICE and self.options.share_kv and self.options.transport in ("auto", "shm"):
            self._share_in_place(tensors)
        desc = CacheDesc(len(addrs), (self.num_blocks, block_elems), data_type, placement)
        key = BlocksCacheKey(self.dd.cluster_id, MODEL_ID)
        self.cache = self.dd.cache_manager.register_blocks_cache(desc, addrs, key)
        log.info("aiodatadist: %d KV tensors of %d blocks x %d elements registered (cluster %d%s)", len(addrs),
                 self.num_blocks, block_elems, self.dd.cluster_id,
                 f", listening on {self.dd.listen_address}" if self.listens else "")

    def _share_in_place(self, tensors: list[torch.Tensor]) -> None:
        """Share the memory under the host KV tensors with same-host peers where it lies, before it is in use."""
        assert self.dd is not None
        storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}
        try:
            self.dd.cache_manager.share_host_memory(sorted(storages))
        except LLMException as exc:
            log.warning("aiodatadist: KV cache not shared in place (%s); same-host peers read it with "
                        "process_vm_readv", exc)

    def _start(self, device_index: int | None) -> SyncLLMDataDist:
        options = self.options
        config = LLMConfig()
        config.sync_kv_timeout = options.pull_timeout_ms
        config.transport = options.transport
        if options.auth_key:
            config.auth_key = options.auth_key
        if device_index is not None:
            config.device_id = device_index
        if self.listens:
            port = options.port_base + self.tp_rank if options.port_base else 0
            config.listen_ip_info = f"{options.listen_host}:{port}"
        role = LLMRole.PROMPT if self.listens else LLMRole.DECODER
        dd = SyncLLMDataDist(role, secrets.randbits(62) + 1)
        dd.init(config.generate_options())
        self.collector = submit(lambda: self._collect(dd))
        return dd

    async def _collect(self, dd: SyncLLMDataDist) -> None:
        async for note in dd.aio.notifications():  # ends at finalize
            self.notes.append(note.message.decode("utf-8", "replace"))

    def handshake(self) -> AiodatadistHandshake | None:
        if self.dd is None or not self.listens:
            return None
        address = self.dd.listen_address
        assert address is not None
        return AiodatadistHandshake(self.options.listen_host, address[1], self.dd.cluster_id)

    # -- each step -------------------------------------------------------------------------------------------
    def start(self, metadata: AiodatadistConnectorMetadata) -> None:
        """Start the step's pulls (never blocks) and track the requests whose blocks wait for a decoder."""
        expiry = time.monotonic() + self.options.lease_seconds
        for request_id in metadata.sends:
            if request_id in self.early:  # D pulled it before this worker heard of it
                del self.early[request_id]
                self.sends[request_id] = 0.0
            else:
                self.sends[request_id] = expiry
        for load in metadata.loads:
            if load.layerwise:
                progress = _LayerProgress(len(self.layer_index))
                future = submit(functools.partial(self._load, load, progress))
                self.loads[load.request_id] = _Running(future, load.local_block_ids, False, progress)
            else:
                self.loads[load.request_id] = _Running(submit(functools.partial(self._load, load)),
                                                       load.local_block_ids, load.reported)

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until layer ``layer_name`` of every layer-wise load of this step has landed (or failed)."""
        index = self.layer_index.get(layer_name)
        if index is None:
            return
        for running in self.loads.values():
            if running.layers is not None:
                running.layers.done[index].wait()


    async def _load(self, load: _Load, progress: _LayerProgress | None = None) -> None:
        """Link to the P worker of this rank (once), pull the request's blocks (the last remote ones when D holds
        a prefix), and tell P.  With ``progress``, a layer-wise load: every layer's pull starts at once (the copy
        threads take them in order), and each marks its layer done as it lands."""
        try:
            await self._pull(load, progress)
        finally:
            if progress is not None:
                progress.finish()  # failed or cancelled: no forward waits for it any more

    async def _pull(self, load: _Load, progress: _LayerProgress | None) -> None:
        import asyncio

        dd = self.dd
        assert dd is not None and self.cache is not None
        if len(load.peers) != self.tp_size:
            raise LLMException(f"P has {len(load.peers)} tensor-parallel workers, this D {self.tp_size}: both must "
                               "be equal", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        host, port, cluster = load.peers[self.tp_rank]
        await self._link(host, port, cluster)
        note = load.remote_request_id.encode()
        local = load.local_block_ids
        if not local:
            await dd.aio.notify(cluster, note)
            return
        if len(local) > len(load.remote_block_ids):
            raise LLMException(f"request {load.request_id}: {len(local)} blocks to load, P has "
                               f"{len(load.remote_block_ids)}", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        remote = load.remote_block_ids[-len(local):]
        key = BlocksCacheKey(cluster, MODEL_ID)
        cache = self.cache
        if progress is None:
            await dd.aio.cache_manager.pull_blocks(key, cache, remote, local, notify=note)
            return
        per_layer = self.tensors_per_layer

        async def layer(index: int) -> None:
            one = range(index, index + 1)
            await dd.aio.cache_manager.pull_blocks(key, cache, remote, local, src_layer_range=one,
                                                   dst_layer_range=one, tensor_num_per_layer=per_layer)
            progress.done[index].set()

        await asyncio.gather(*(layer(index) for index in range(len(progress.done))))
        await dd.aio.notify(cluster, note)

    async def _link(self, host: str, port: int, cluster: int) -> None:
        """Link to a P worker once; concurrent loads share the attempt, a failed one is retried by the next."""
        import asyncio

        task = self.linking.get(cluster)
        if task is None:
            task = self.linking[cluster] = asyncio.ensure_future(self._link_once(host, port, cluster))
        try:
            await asyncio.shield(task)
        except BaseException:
            if task.done() and self.linking.get(cluster) is task:
                del self.linking[cluster]
            raise

    async def _link_once(self, host: str, port: int, cluster: int) -> None:
        dd = self.dd
        assert dd is not None
        info = LLMClusterInfo()
        info.remote_cluster_id = cluster
        info.append_local_ip_info(self.options.listen_host, 0)
        info.append_remote_ip_info(host, port)
        _, codes = await dd.aio.link_clusters([info], self.options.link_timeout_ms)
        if codes[0] not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
            raise LLMException(f"linking to P worker {host}:{port} (cluster {cluster}) failed: {codes[0].name}",
                               status_code=codes[0])

    def finished(self, wait_s: float) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose blocks D pulled or whose lease expired, requests whose pull ended); waits up to
        ``wait_s`` for one of the pulls in flight to end."""
        received = self._ended_loads(wait_s)
        self._take_notes()
        return self._released_sends() or None, received or None

    def _ended_loads(self, wait_s: float) -> set[str]:
        """Forget the pulls that ended (waiting up to ``wait_s`` for one); the reported ones' request ids."""
        received: set[str] = set()
        for running in self.loads.values():
            if running.layers is not None:  # a load of this step's forward: it ends within the step
                concurrent.futures.wait([running.future])
        if self.loads:
            # The engine's thread holds the GIL between steps; our loop thread needs it to start and to finish a
            # pull, and without a release would wait for the interpreter's switch interval (5 ms) each time.
            concurrent.futures.wait([running.future for running in self.loads.values()], timeout=wait_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for request_id, running in list(self.loads.items()):
            if not running.future.done():
                continue
            del self.loads[request_id]
            error = running.future.exception()
            if error is not None:
                log.warning("aiodatadist: loading request %s failed: %s", request_id, error)
                self.load_errors.update(running.local_block_ids)
            if running.reported:
                received.add(request_id)
        return received

    def _take_notes(self) -> None:
        """D's notes (it pulled a request's blocks): the send ends now, or when P learns of it (a note first)."""
        while self.notes:
            request_id = self.notes.popleft()
            if request_id in self.sends:
                self.sends[request_id] = 0.0
            else:
                self.early[request_id] = None
                if len(self.early) > MAX_EARLY_NOTES:
                    self.early.popitem(last=False)

    def _released_sends(self) -> set[str]:
        """The sends whose blocks can be freed: pulled, or their lease expired (logged)."""
        now = time.monotonic()
        sent = {request_id for request_id, expiry in self.sends.items() if expiry <= now}
        for request_id in sent:
            if self.sends.pop(request_id) > 0.0:
                log.warning("aiodatadist: request %s: no decoder pulled its blocks within %.0f s; freed", request_id,
                            self.options.lease_seconds)
        return sent

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def close(self) -> None:
        for running in self.loads.values():
            running.future.cancel_and_wait()
        self.loads.clear()
        if self.dd is not None and self.dd.is_initialized:
            self.dd.finalize()
        if self.collector is not None:
            self.collector.result(timeout=5)


def block_regions(tensor: torch.Tensor, num_blocks: int) -> tuple[list[int], int]:
    """Where a layer's KV blocks lie: the base address of each region holding ``num_blocks`` blocks back to back,
    and the elements per block.

    A layer's tensor holds one region (``[num_blocks, ...]``, vLLM CPU) or several along leading dimensions
    (``[2, num_blocks, ...]``: K and V, vLLM CUDA); within a region, block i starts ``i * block_elems`` elements
    after its base and its elements are dense (in any order of dimensions: both sides share the layout)."""
    dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
    if not dims:
        raise ValueError(f"AiodatadistConnector: no dimension of the KV cache tensor {tuple(tensor.shape)} has "
                         f"{num_blocks} blocks")
    block_dim = dims[0]
    inner = [d for d in range(tensor.dim()) if d != block_dim]
    if _dense(tensor, inner, tensor.stride(block_dim)):  # the whole tensor is one region
        return [tensor.data_ptr()], tensor.stride(block_dim)
    regions = [tensor[index] for index in itertools.product(*(range(n) for n in tensor.shape[:block_dim]))]
    inner = list(range(1, tensor.dim() - block_dim))
    if all(_dense(region, inner, region.stride(0)) for region in regions):
        return [region.data_ptr() for region in regions], regions[0].stride(0)
    raise ValueError(f"AiodatadistConnector: the blocks of a KV cache tensor of shape {tuple(tensor.shape)} and "
                     f"strides {tensor.stride()} are not contiguous ranges of memory")


def _dense(tensor: torch.Tensor, dims: list[int], block_stride: int) -> bool:
    """True when the dimensions ``dims`` of ``tensor`` fill exactly ``block_stride`` elements, densely."""
    expected = 1
    for d in sorted(dims, key=lambda d: (tensor.stride(d), tensor.shape[d])):
        if tensor.shape[d] == 1:
            continue
        if tensor.stride(d) != expected:
            return False
        expected *= tensor.shape[d]
    return expected == block_stride and math.prod(tensor.shape[d] for d in dims) == block_stride
