"""The connector's worker side: one aiodatadist instance per vLLM worker, which serves the worker's KV cache to D
engines (P) and pulls from P engines into it (D)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...cache import Cache
from ...errors import LLMException, LLMStatusCode
from ...sync import LLMDataDist as SyncLLMDataDist
from ...sync import TransferFuture, submit
from ...torch import from_torch_dtype, placement_of
from ...types import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMRole, Placement
from .._config import llm_config, random_cluster_id
from .layout import block_regions
from .metadata import AiodatadistConnectorMetadata, AiodatadistHandshake, Load
from .options import ConnectorOptions

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["MODEL_ID", "WorkerSide"]

log = logging.getLogger("aiodatadist.integrations.vllm")

MODEL_ID = 0
"""The ``BlocksCacheKey.model_id`` every worker registers its KV cache under."""
MAX_EARLY_NOTES = 65536
"""P: notifications kept for requests the scheduler has not handed to the worker yet."""


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


class WorkerSide:
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
        """This worker's instance (a P worker's listens at ``port_base`` + its rank, or a free port)."""
        options = self.options
        listen = None
        if self.listens:
            listen = (options.listen_host, options.port_base + self.tp_rank if options.port_base else 0)
        config = llm_config(transport=options.transport, auth_key=options.auth_key,
                            transfer_timeout_ms=options.pull_timeout_ms, device_index=device_index, listen=listen)
        role = LLMRole.PROMPT if self.listens else LLMRole.DECODER
        dd = SyncLLMDataDist(role, random_cluster_id())
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


    async def _load(self, load: Load, progress: _LayerProgress | None = None) -> None:
        """Link to the P worker of this rank (once), pull the request's blocks (the last remote ones when D holds
        a prefix), and tell P.  With ``progress``, a layer-wise load: every layer's pull starts at once (the copy
        threads take them in order), and each marks its layer done as it lands."""
        try:
            await self._pull(load, progress)
        finally:
            if progress is not None:
                progress.finish()  # failed or cancelled: no forward waits for it any more

    async def _pull(self, load: Load, progress: _LayerProgress | None) -> None:
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
