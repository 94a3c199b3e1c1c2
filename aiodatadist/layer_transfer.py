"""Layer-wise transfer (``CacheManager.transfer_cache_async``, as in LLM-DataDist): send each layer of a cache to
its destinations as soon as the producer says it is computed, overlapping with the computation of the next layers.
Raw-address destinations (``TransferConfig``) are first resolved by their owners to registered caches.

One asyncio task per call walks the layers in order.  For each layer it asks the caller's
:class:`~aiodatadist.transfer_configs.LayerSynchronizer` in a worker thread (it may block), then pushes that layer
to every destination whose ``src_layer_range`` holds it, concurrently.  A synchronizer answering False gives the
destinations of that layer ``LLM_PARAM_INVALID`` and ends the job; a failed push records its code for its
destination and ends the job; a destination gets ``LLM_SUCCESS`` after its last layer.  Cancelling the job stops it
with the guarantees of every push (nothing is written after it ended); a synchronizer call already running in
its thread finishes there, and its answer is ignored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .errors import LLMException, LLMStatusCode
from .protocol.messages import Located
from .transfer_configs import LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig
from .types import BlocksCacheKey, CacheKeyByIdAndIndex

__all__ = ["CacheTask", "LayerPush", "Resolver", "keyed_config", "run_layers"]

LayerPush = Callable[[TransferWithCacheKeyConfig, int], Awaitable[None]]
"""Push source layer ``layer`` to one destination (the cache manager binds the cache and the blocks)."""
Resolver = Callable[[int, tuple[int, ...]], Awaitable[tuple[Located, ...]]]
"""Where cluster ``c`` holds addresses ``addrs`` (a RESOLVE round trip to the owner)."""


async def keyed_config(config: TransferConfig, num_layers: int, resolve: Resolver,
                       has_dst_blocks: bool) -> TransferWithCacheKeyConfig:
    """The cache-key form of a raw-address ``TransferConfig``: its owner says which registered cache, tensors and
    slot its ``dst_addrs`` (K and V of each destination layer, slot-offset for a contiguous cache) are, and they
    must be the K,V pairs of consecutive layers of one cache at one slot (``LLM_PARAM_INVALID`` otherwise)."""
    src = config.src_layer_range if config.src_layer_range is not None else range(num_layers)
    addrs = tuple(config.dst_addrs)
    if len(addrs) != 2 * len(src):
        raise LLMException(f"dst_addrs has {len(addrs)} addresses; 2 per layer of src_layer_range {src} are "
                           f"needed", status_code=LLMStatusCode.LLM_PARAM_INVALID)
    located = await resolve(config.dst_cluster_id, addrs)
    first = located[0]
    for i, at in enumerate(located):
        if (at.cid, at.slot, at.tensor) != (first.cid, first.slot, first.tensor + i) or first.tensor % 2:
            raise LLMException("dst_addrs must be the K and V tensors of consecutive layers of one destination "
                               f"cache at one slot (address {i} is tensor {at.tensor} of cache {at.cid}, slot "
                               f"{at.slot})", status_code=LLMStatusCode.LLM_PARAM_INVALID)
    dst = range(first.tensor // 2, first.tensor // 2 + len(src))
    if not first.is_blocks:
        key = CacheKeyByIdAndIndex(config.dst_cluster_id, first.cid, first.slot)
        return TransferWithCacheKeyConfig(key, src, dst, config.src_batch_index)
    if first.slot != 0 or first.model < 0 or not has_dst_blocks:
        raise LLMException("a blocks destination named by dst_addrs needs its tensors' base addresses, a "
                           "BlocksCacheKey on the owner and dst_block_indices",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)
    return TransferWithCacheKeyConfig(BlocksCacheKey(config.dst_cluster_id, first.model), src, dst)


class CacheTask:
    """The running job of one ``transfer_cache_async``: await it (or :meth:`synchronize`) for its status.

    ``get_results`` has one entry per transfer config, in their order: ``LLMStatusCode.LLM_SUCCESS``, the code
    that failed it, or None if none of its layers was attempted.  Awaiting a ``CacheTask`` is
    ``await task.synchronize()``."""

    def __init__(self, task: asyncio.Task[None], results: list[LLMStatusCode | None]) -> None:
        self._task = task
        self._results = results

    def done(self) -> bool:
        """True once the job ended (finished, failed or cancelled)."""
        return self._task.done()

    async def _wait(self, timeout_in_millis: int | None) -> bool:
        """Wait for the end of the job (not cancelling it on timeout); False on timeout."""
        if timeout_in_millis is not None and (type(timeout_in_millis) is not int or timeout_in_millis < 0):
            raise LLMException(f"timeout_in_millis must be None or an int >= 0, got {timeout_in_millis!r}.",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000
        finished, _ = await asyncio.wait([self._task], timeout=timeout)
        return bool(finished)

    async def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """The job's status once it ended: its first failure code, else ``LLM_SUCCESS``; ``LLM_TIMEOUT`` if it
        still runs after ``timeout_in_millis`` ms (None: wait for ever; the job goes on)."""
        if not await self._wait(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        for code in self._results:
            if code is not None and code != LLMStatusCode.LLM_SUCCESS:
                return code
        if self._task.cancelled():
            return LLMStatusCode.LLM_FAILED
        return LLMStatusCode.LLM_SUCCESS

    async def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """Per transfer config: its status (None: never attempted); every entry ``LLM_TIMEOUT`` on timeout."""
        if not await self._wait(timeout_in_millis):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._results)
        return list(self._results)

    async def cancel(self) -> bool:
        """Stop the job and return once it stopped (no push of it writes afterwards); False if it had ended."""
        if self._task.done():
            return False
        self._task.cancel()
        await asyncio.wait([self._task])
        return True

    def __await__(self) -> Any:
        return self.synchronize().__await__()

    def __repr__(self) -> str:
        state = "done" if self._task.done() else "running"
        return f"CacheTask({state}, results={[c.name if c is not None else None for c in self._results]})"


async def run_layers(num_layers: int, synchronizer: LayerSynchronizer,
                     given: Sequence[TransferWithCacheKeyConfig | TransferConfig], push: LayerPush,
                     results: list[LLMStatusCode | None], resolve: Resolver, has_dst_blocks: bool) -> None:
    """Walk layers ``0 .. num_layers-1`` as the module says, writing each config's status into ``results``.
    Raw-address configs are first resolved with their owners (a failure ends the job before any layer)."""
    configs = await _keyed_configs(given, num_layers, resolve, has_dst_blocks, results)
    if configs is None:
        return
    last = [config.src_layer_range[-1] for config in configs]
    for layer in range(num_layers):
        if all(result is not None for result in results):
            return
        active = [i for i, config in enumerate(configs) if layer in config.src_layer_range and results[i] is None]
        ready = await asyncio.to_thread(synchronizer.synchronize_layer, layer, None)
        if ready is not True:
            for i in active:
                results[i] = LLMStatusCode.LLM_PARAM_INVALID
            return
        outcomes = await asyncio.gather(*(push(configs[i], layer) for i in active), return_exceptions=True)
        if not _recorded(active, outcomes, [layer == last[i] for i in active], results):
            return


async def _keyed_configs(given: Sequence[TransferWithCacheKeyConfig | TransferConfig], num_layers: int,
                         resolve: Resolver, has_dst_blocks: bool,
                         results: list[LLMStatusCode | None]) -> list[TransferWithCacheKeyConfig] | None:
    """Every config with a cache key (raw-address ones resolved); None after the first that failed, whose status
    is in ``results``."""
    configs: list[TransferWithCacheKeyConfig] = []
    for i, config in enumerate(given):
        if isinstance(config, TransferWithCacheKeyConfig):
            configs.append(config)
            continue
        try:
            configs.append(await keyed_config(config, num_layers, resolve, has_dst_blocks))
        except LLMException as exc:
            results[i] = exc.status_code
            return None
    return configs


def _recorded(active: list[int], outcomes: Sequence[object], finishing: list[bool],
              results: list[LLMStatusCode | None]) -> bool:
    """Write one layer's outcomes into ``results`` (success only for configs whose last layer it was); False if
    any failed.  A cancellation propagates."""
    ok = True
    for i, outcome, done in zip(active, outcomes, finishing, strict=True):
        if isinstance(outcome, LLMException):
            results[i] = outcome.status_code
            ok = False
        elif isinstance(outcome, BaseException):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            results[i] = LLMStatusCode.LLM_FAILED
            ok = False
        elif done:
            results[i] = LLMStatusCode.LLM_SUCCESS
    return ok
