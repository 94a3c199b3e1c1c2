"""Argument checks of pull_cache / pull_blocks / push_cache / push_blocks / transfer_cache_async, before any
message is sent.

Each function checks the arguments in the reference's order (``TypeError``, ``ValueError``,
``LLMException(LLM_PARAM_INVALID)``), including the bounds that need only the local cache, and returns the
local cache's entry and the :class:`~aiodatadist.layout.TransferParams` that the transfer service runs
(:func:`layer_transfer`: the :class:`LayerTransfer` that ``transfer_cache_async`` walks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._checks import (
    U64_MAX,
    check_index_list,
    check_int,
    check_isinstance,
    check_layer_range,
    param_invalid,
    require,
)
from ..layout.plans import TransferParams
from ..native import int_bounds
from ..registry.caches import CacheEntry
from ..transfer_configs import LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig
from ..types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex

__all__ = ["EntryOf", "LayerTransfer", "layer_transfer", "layer_transfer_configs", "pull_blocks", "pull_cache",
           "push_blocks", "push_cache"]

EntryOf = Callable[[str, Any], CacheEntry]
"""The caller's lookup of a user's ``Cache`` argument (by parameter name) to its live entry."""

_TRANSFER_KWARGS = ("src_layer_range", "dst_layer_range", "tensor_num_per_layer")


def _layer_kwargs(kwargs: dict[str, Any], *, allow_empty: bool) -> tuple[range | None, range | None, int]:
    if not kwargs:  # every layer, two tensors per layer: most calls
        return None, None, 2
    unknown = set(kwargs) - set(_TRANSFER_KWARGS)
    if unknown:
        raise TypeError(f"unexpected keyword arguments: {sorted(unknown)}")
    src_range = check_layer_range("src_layer_range", kwargs.get("src_layer_range"), allow_empty=allow_empty)
    dst_range = check_layer_range("dst_layer_range", kwargs.get("dst_layer_range"), allow_empty=allow_empty)
    n = check_int("tensor_num_per_layer", kwargs.get("tensor_num_per_layer", 2), "uint32")
    require(n > 0, f"tensor_num_per_layer must be > 0, but got {n}.")
    return src_range, dst_range, n


def _blocks_arg(name: str, value: Any, *, allow_none: bool) -> tuple[int, ...]:
    if value is None and allow_none:
        return ()
    bounds = int_bounds(value)  # a list or tuple of non-negative ints (every call's case): checked in one C pass
    if bounds is not None and bounds[0] >= 0:
        return tuple(value)
    return tuple(check_index_list(name, value, "uint64"))


def _check_cache_key_for_pull(key: CacheKey) -> None:
    valid_req = key.req_id != U64_MAX
    valid_prefix = key.prefix_id != U64_MAX
    require(valid_req != valid_prefix, "exactly one of req_id and prefix_id must be set to pull by CacheKey.")


def _checked(params: TransferParams, local: CacheEntry) -> tuple[CacheEntry, TransferParams]:
    """Checks that need only the local cache, so bad input fails before any message is sent."""
    slots = int(local.desc.shape[0])
    name, local_blocks = ("dst_blocks", params.dst_blocks) if params.op == "pull" else ("src_blocks", params.src_blocks)
    if local_blocks:
        bounds = int_bounds(local_blocks)
        highest = bounds[1] if bounds is not None else max(local_blocks)
        if highest >= slots:
            param_invalid(f"{name} has block index {highest} >= num_blocks {slots} of the local cache.")
    if params.local_slot >= slots:
        param_invalid(f"batch_index {params.local_slot} out of range [0, {slots}).")
    return local, params


def _check_push_enabled(name: str, remote_accessible: bool | None) -> None:
    require(remote_accessible is not False,
            f"{name} is only supported while enable_remote_cache_accessible is True.")


def pull_cache(entry_of: EntryOf, remote_accessible: bool | None, cache_key: Any, cache: Any, batch_index: Any,
               size: Any, kwargs: dict[str, Any]) -> tuple[CacheEntry, TransferParams]:
    """``pull_cache``: a CacheKey or CacheKeyByIdAndIndex (only the latter with remote access enabled) into a
    slot of a local contiguous cache."""
    allowed: tuple[type, ...] = (CacheKey, CacheKeyByIdAndIndex)
    if remote_accessible:
        allowed = (CacheKeyByIdAndIndex,)
    check_isinstance("cache_key", cache_key, allowed)
    entry = entry_of("cache", cache)
    slot = check_int("batch_index", batch_index, "uint32")
    nbytes = check_int("size", size, "int64")
    src_range, dst_range, n = _layer_kwargs(kwargs, allow_empty=True)
    require(nbytes == -1 or nbytes > 0, f"size should be -1 or > 0, but got {nbytes}.")
    require(not entry.is_blocks, "pull_cache needs a contiguous destination cache; use pull_blocks.")
    if isinstance(cache_key, CacheKey):
        _check_cache_key_for_pull(cache_key)
    return _checked(TransferParams("pull", "cache", (), (), src_range, dst_range, n, nbytes, slot), entry)


def pull_blocks(entry_of: EntryOf, src_cache_key: Any, dst_cache: Any, src_blocks: Any, dst_blocks: Any,
                kwargs: dict[str, Any]) -> tuple[CacheEntry, TransferParams]:
    """``pull_blocks``: B2B (``BlocksCacheKey`` and equal block lists) or C2B (no source blocks)."""
    check_isinstance("src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey))
    entry = entry_of("dst_cache", dst_cache)
    src = _blocks_arg("src_blocks", src_blocks, allow_none=True)
    dst = _blocks_arg("dst_blocks", dst_blocks, allow_none=False)
    src_range, dst_range, n = _layer_kwargs(kwargs, allow_empty=True)
    require(entry.is_blocks, "pull_blocks needs a blocks destination cache (B2C is not supported).")
    require(len(dst) > 0, "dst_blocks must not be empty.")
    if isinstance(src_cache_key, BlocksCacheKey):
        require(len(src) > 0, "src_blocks must not be empty when pulling by BlocksCacheKey.")
        if len(src) != len(dst):
            param_invalid(f"number of src_blocks ({len(src)}) mismatches number of dst_blocks ({len(dst)}).")
    else:
        require(len(src) == 0, "src_blocks must be empty when pulling from a contiguous cache (C2B).")
        if isinstance(src_cache_key, CacheKey):
            _check_cache_key_for_pull(src_cache_key)
    return _checked(TransferParams("pull", "blocks", src, dst, src_range, dst_range, n, -1, 0), entry)


def push_cache(entry_of: EntryOf, remote_accessible: bool | None, dst_cache_key: Any, src_cache: Any,
               src_batch_index: Any, layer_kwargs: dict[str, Any], size: Any) -> tuple[CacheEntry, TransferParams]:
    """``push_cache``: a slot of a local contiguous cache into a remote one (by ``CacheKeyByIdAndIndex``)."""
    _check_push_enabled("push_cache", remote_accessible)
    if type(dst_cache_key) is not CacheKeyByIdAndIndex:
        raise TypeError(f"dst_cache_key only support ['CacheKeyByIdAndIndex'], but got {type(dst_cache_key)}.")
    entry = entry_of("src_cache", src_cache)
    slot = check_int("src_batch_index", src_batch_index, "uint32")
    nbytes = check_int("size", size, "int64")
    src_range, dst_range, n = _layer_kwargs(layer_kwargs, allow_empty=False)
    require(nbytes == -1, f"size should be = -1, but got {nbytes}.")
    require(not entry.is_blocks, "push_cache needs a contiguous source cache; use push_blocks.")
    return _checked(TransferParams("push", "cache", (), (), src_range, dst_range, n, -1, slot), entry)


def push_blocks(entry_of: EntryOf, remote_accessible: bool | None, dst_cache_key: Any, src_cache: Any,
                src_blocks: Any, dst_blocks: Any, layer_kwargs: dict[str, Any]) -> tuple[CacheEntry, TransferParams]:
    """``push_blocks``: local blocks into remote blocks (B2B, by ``BlocksCacheKey``)."""
    _check_push_enabled("push_blocks", remote_accessible)
    if type(dst_cache_key) is not BlocksCacheKey:
        raise TypeError(f"dst_cache_key only support ['BlocksCacheKey'], but got {type(dst_cache_key)}.")
    entry = entry_of("src_cache", src_cache)
    src = _blocks_arg("src_blocks", src_blocks, allow_none=True)
    dst = _blocks_arg("dst_blocks", dst_blocks, allow_none=False)
    src_range, dst_range, n = _layer_kwargs(layer_kwargs, allow_empty=False)
    require(entry.is_blocks, "push_blocks needs a blocks source cache.")
    require(len(dst) > 0, "dst_blocks must not be empty.")
    require(len(src) > 0, "src_blocks must not be empty.")
    if len(src) != len(dst):  # (the message is built only when raised: this runs every call)
        param_invalid(f"number of src_blocks ({len(src)}) mismatches number of dst_blocks ({len(dst)}).")
    return _checked(TransferParams("push", "blocks", src, dst, src_range, dst_range, n, -1, 0), entry)


def layer_transfer_configs(configs: Any) -> list[TransferWithCacheKeyConfig | TransferConfig]:
    """``transfer_cache_async``'s ``transfer_configs``: a non-empty list/tuple of one kind of config (TypeError
    otherwise)."""
    check_isinstance("transfer_configs", configs, (list, tuple))
    require(len(configs) > 0, "transfer_configs must not be empty.")
    kinds = {type(config) for config in configs}
    for config in configs:
        if not isinstance(config, (TransferConfig, TransferWithCacheKeyConfig)):
            raise TypeError("transfer_configs inner type only support ['TransferConfig', "
                            f"'TransferWithCacheKeyConfig'], but got {type(config)}.")
    if len(kinds) > 1:
        raise TypeError("transfer_configs must all be TransferConfig or all be TransferWithCacheKeyConfig.")
    return list(configs)


@dataclass(frozen=True, slots=True)
class LayerTransfer:
    """``transfer_cache_async``'s arguments, checked: what the layer walk needs."""

    entry: CacheEntry  # the source cache
    configs: list[TransferWithCacheKeyConfig | TransferConfig]  # all of one kind
    src_blocks: list[int] | None  # src_block_indices
    dst_blocks: list[int] | None  # dst_block_indices
    num_layers: int  # of the source cache (2 tensors per layer: K and V)


def layer_transfer(entry_of: EntryOf, src_cache: Any, layer_synchronizer: Any, transfer_configs: Any,
                   src_block_indices: Any, dst_block_indices: Any, dst_block_memory_size: Any) -> LayerTransfer:
    """``transfer_cache_async``: every argument, before any layer is waited for (each layer's push is checked
    again like ``push_blocks`` / ``push_cache`` when it runs)."""
    entry = entry_of("src_cache", src_cache)
    check_isinstance("layer_synchronizer", layer_synchronizer, LayerSynchronizer)
    configs = layer_transfer_configs(transfer_configs)
    src_blocks = None if src_block_indices is None else check_index_list("src_block_indices",
                                                                         src_block_indices, "uint64")
    dst_blocks = None if dst_block_indices is None else check_index_list("dst_block_indices",
                                                                         dst_block_indices, "uint64")
    if dst_block_memory_size is not None:
        check_int("dst_block_memory_size", dst_block_memory_size, "uint64")
    num_tensors = entry.desc.num_tensors
    require(num_tensors % 2 == 0, f"transfer_cache_async sends 2 tensors per layer: src_cache has {num_tensors}.")
    num_layers = num_tensors // 2
    for config in configs:
        layers = config.src_layer_range
        require(layers is None or layers.stop <= num_layers,
                f"src_layer_range {layers} exceeds the {num_layers} layers of src_cache.")
        if isinstance(config, TransferConfig):
            wanted = len(layers) if layers is not None else num_layers
            require(len(config.dst_addrs) == 2 * wanted,
                    f"dst_addrs must hold 2 addresses per layer sent ({2 * wanted}), got {len(config.dst_addrs)}.")
        elif isinstance(config.cache_key, BlocksCacheKey):
            require(dst_blocks is not None, "dst_block_indices is required for a BlocksCacheKey destination.")
        else:
            require(dst_blocks is None, "dst_block_indices must be None for a CacheKeyByIdAndIndex destination.")
    if src_blocks is not None:
        require(entry.is_blocks, "src_block_indices given, but src_cache is not a blocks cache.")
        require(dst_blocks is not None and len(dst_blocks) == len(src_blocks),
                "src_block_indices and dst_block_indices must have the same length.")
    return LayerTransfer(entry, configs, src_blocks, dst_blocks, num_layers)
