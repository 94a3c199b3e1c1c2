"""One aiodatadist instance per SGLang KV manager: its caches, its links, its pushes (no SGLang import).

The manager (:mod:`.manager`) calls :meth:`Endpoint.register` once from the scheduler thread (blocking, at
start-up) and runs everything else as coroutines on aiodatadist's loop thread (:func:`aiodatadist.sync.submit`):
links, pushes and notifications never block SGLang's scheduler.  A decode rank's instance listens; a prefill rank's
instance links to every decode rank that registers with it (once), and pushes pages into that rank's caches.

Every KV group and aux group is registered as a blocks cache of ``uint8`` blocks under
``BlocksCacheKey(cluster, group.model_id)``: in host memory where SGLang's pool lives on the CPU, in CUDA memory
(``Placement.DEVICE``) where it lives on a GPU.  The memory stays SGLang's; unregistering at :meth:`close` stops
every copy that touches it first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ...cache import Cache
from ...errors import LLMException, LLMStatusCode
from ...sync import LLMDataDist as SyncLLMDataDist
from ...sync import TransferFuture, submit
from ...types import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMRole, Placement
from .._config import llm_config, random_cluster_id
from .layout import AuxPush, BufferGroup
from .options import BackendOptions

__all__ = ["Endpoint"]

log = logging.getLogger("aiodatadist.integrations.sglang")

IndexArray = npt.NDArray[np.integer] | Sequence[int]


class Endpoint:
    """An initialized aiodatadist instance (sync API) with SGLang's buffers registered as blocks caches.

    ``listen_host``: the decode side listens there (any free port: :attr:`address`); ``None`` for the prefill side.
    ``device_index``: the CUDA ordinal of a GPU KV pool (``None``: host memory)."""

    def __init__(self, options: BackendOptions, listen_host: str | None, device_index: int | None = None) -> None:
        config = llm_config(transport=options.transport, auth_key=options.auth_key,
                            transfer_timeout_ms=options.push_timeout_ms, device_index=device_index,
                            listen=(listen_host, 0) if listen_host else None)
        self.options = options
        self.placement = Placement.HOST if device_index is None else Placement.DEVICE
        self.dd = SyncLLMDataDist(LLMRole.DECODER if listen_host else LLMRole.PROMPT, random_cluster_id())
        self.dd.init(config.generate_options())
        self.listen_host = listen_host
        self.caches: dict[int, Cache] = {}  # model id -> registered cache
        self._links: dict[int, asyncio.Future[None]] = {}  # cluster id -> the link attempt (loop thread only)
        self._background: list[TransferFuture[None]] = []

    @property
    def cluster_id(self) -> int:
        """This instance's cluster id (random, 62 bits)."""
        return self.dd.cluster_id

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` a listening instance announces."""
        bound = self.dd.listen_address
        if bound is None or not self.listen_host:
            raise LLMException("this aiodatadist instance does not listen", status_code=LLMStatusCode.LLM_FAILED)
        return self.listen_host, bound[1]

    def register(self, groups: Sequence[BufferGroup], placement: Placement | None = None) -> None:
        """Register each group as a blocks cache (blocking; once, at start-up)."""
        where = self.placement if placement is None else placement
        for group in groups:
            desc = CacheDesc(len(group.addrs), (group.blocks, group.item_len), DataType.DT_UINT8, where)
            key = BlocksCacheKey(self.cluster_id, group.model_id)
            self.caches[group.model_id] = self.dd.cache_manager.register_blocks_cache(desc, list(group.addrs), key)

    def share_in_place(self, groups: Sequence[BufferGroup]) -> bool:
        """Share the groups' host buffers with same-host peers where they lie (``share_host_memory``, before they
        are registered): a peer then copies into them with ``memcpy`` instead of ``process_vm_writev``.  False,
        having changed nothing, where the memory cannot be shared so (the transfers still work, slower)."""
        ranges = [(addr, group.blocks * group.item_len) for group in groups for addr in group.addrs]
        try:
            self.dd.cache_manager.share_host_memory(ranges)
        except LLMException as exc:
            log.warning("aiodatadist: KV buffers not shared in place (%s); same-host peers use process_vm_writev", exc)
            return False
        return True

    def run(self, coroutine_factory: Callable[[], Coroutine[Any, Any, None]]) -> TransferFuture[None]:
        """Start a long-running coroutine (a reader) on the loop thread; :meth:`close` cancels it."""
        future = submit(coroutine_factory)
        self._background.append(future)
        return future

    @staticmethod
    def start(coroutine_factory: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Start a coroutine on the loop thread and return at once; it handles its own errors."""
        submit(coroutine_factory)

    # -- on the loop thread ----------------------------------------------------------------------------------
    async def link(self, cluster_id: int, host: str, port: int) -> None:
        """Link to the instance ``cluster_id`` at ``host:port`` (once): concurrent callers share the attempt, and a
        failed attempt is made again by the next caller."""
        attempt = self._links.get(cluster_id)
        if attempt is None or (attempt.done() and (attempt.cancelled() or attempt.exception() is not None)):
            attempt = self._links[cluster_id] = asyncio.ensure_future(self._link_once(cluster_id, host, port))
        await asyncio.shield(attempt)

    async def _link_once(self, cluster_id: int, host: str, port: int) -> None:
        info = LLMClusterInfo()
        info.remote_cluster_id = cluster_id
        info.append_local_ip_info(self.listen_host or host, 0)
        info.append_remote_ip_info(host, port)
        _, codes = await self.dd.aio.link_clusters([info], self.options.link_timeout_ms)
        if codes[0] not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
            raise LLMException(f"linking to the decode instance {cluster_id} at {host}:{port} failed: "
                               f"{codes[0].name}", status_code=codes[0])
        log.info("aiodatadist: linked to decode instance %d at %s:%d", cluster_id, host, port)

    def forget(self, cluster_id: int) -> None:
        """Drop the link attempt to ``cluster_id`` (a decode rank that went away): the next :meth:`link` links
        again."""
        self._links.pop(cluster_id, None)

    async def push_pages(self, cluster_id: int, model_id: int, src: IndexArray, dst: IndexArray,
                         notify: bytes | None = None) -> None:
        """Push pages ``src`` of the local KV group ``model_id`` into pages ``dst`` of the same group on
        ``cluster_id`` (every tensor of the group: all layers' K and V); ``notify`` reaches the peer once the
        bytes are in place."""
        await self.dd.aio.cache_manager.push_blocks(BlocksCacheKey(cluster_id, model_id), self.caches[model_id],
                                                    src_blocks=src, dst_blocks=dst, tensor_num_per_layer=1,
                                                    notify=notify)

    async def push_aux(self, cluster_id: int, push: AuxPush, src_row: int, dst_row: int) -> None:
        """Push one request's aux row into the peer's row ``dst_row`` (the shared buffers of one group)."""
        tensors = range(push.tensors)
        await self.dd.aio.cache_manager.push_blocks(
            BlocksCacheKey(cluster_id, push.dst_model_id), self.caches[push.group.model_id], src_blocks=[src_row],
            dst_blocks=[dst_row], src_layer_range=tensors, dst_layer_range=tensors, tensor_num_per_layer=1)

    async def notify(self, cluster_id: int, message: bytes) -> None:
        """Send ``message`` to the linked instance ``cluster_id``."""
        await self.dd.aio.notify(cluster_id, message)

    # -- teardown --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the readers, then finalize the instance (it stops its copies and unregisters the caches)."""
        for future in self._background:
            future.cancel_and_wait()
        self._background.clear()
        if self.dd.is_initialized:
            self.dd.finalize()
