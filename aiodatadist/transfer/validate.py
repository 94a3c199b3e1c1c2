"""The pull/push methods of :class:`CacheManager`: argument validation, then :mod:`aiodatadist.transfer.service`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._checks import (
    U64_MAX,
    check_int,
    check_int_list,
    check_isinstance,
    check_layer_range,
    param_invalid,
    require,
)
from ..cache import Cache
from ..layout import TransferParams
from ..registry import CacheEntry
from ..types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex

if TYPE_CHECKING:
    from ..datadist import LLMDataDist

__all__ = ["TransferMixin"]

_TRANSFER_KWARGS = ("src_layer_range", "dst_layer_range", "tensor_num_per_layer")


def _layer_kwargs(kwargs: dict[str, Any], *, allow_empty: bool) -> tuple[range | None, range | None, int]:
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
    return tuple(check_int_list(name, value, "uint64"))


def _check_cache_key_for_pull(key: CacheKey) -> None:
    valid_req = key.req_id != U64_MAX
    valid_prefix = key.prefix_id != U64_MAX
    require(valid_req != valid_prefix, "exactly one of req_id and prefix_id must be set to pull by CacheKey.")


def _precheck_local(params: TransferParams, local: CacheEntry) -> None:
    """Checks that need only the local cache, so bad input fails before any message is sent."""
    slots = int(local.desc.shape[0])
    local_blocks = params.dst_blocks if params.op == "pull" else params.src_blocks
    if local_blocks and max(local_blocks) >= slots:
        param_invalid(f"block index {max(local_blocks)} >= num_blocks {slots}.")
    if params.local_slot >= slots:
        param_invalid(f"batch_index {params.local_slot} out of range [0, {slots}).")


class TransferMixin:
    """pull_cache / pull_blocks / push_cache / push_blocks of :class:`CacheManager`."""

    _datadist: LLMDataDist

    if TYPE_CHECKING:
        def _entry(self, name: str, cache: Any) -> CacheEntry: ...

        def _check_open(self) -> None: ...

    async def _transfer(self, key: Any, local: CacheEntry, params: TransferParams) -> None:
        _precheck_local(params, local)
        await self._datadist._transfers.run(key, local, params)

    def _remote_accessible_flag(self) -> bool | None:
        raw = self._datadist.settings.raw.get("llm.EnableRemoteCacheAccessible")
        return None if raw is None else raw == "1"

    async def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, cache: Cache, batch_index: int = 0,
                         size: int = -1, **kwargs: Any) -> None:
        """Pull one batch slot of a remote contiguous cache into slot ``batch_index`` of ``cache``.

        Bounded by ``sync_kv_timeout`` (``LLMTimeoutError``); cancelling behaves the same.  After a timeout or
        cancellation the destination slot holds an unspecified mix of old and new bytes, and nothing is
        written into it after the call has returned.  A successful pull by ``CacheKey`` releases that key on
        the owner.
        """
        self._check_open()
        allowed: tuple[type, ...] = (CacheKey, CacheKeyByIdAndIndex)
        if self._remote_accessible_flag():
            allowed = (CacheKeyByIdAndIndex,)
        check_isinstance("cache_key", cache_key, allowed)
        entry = self._entry("cache", cache)
        slot = check_int("batch_index", batch_index, "uint32")
        nbytes = check_int("size", size, "int64")
        src_range, dst_range, n = _layer_kwargs(kwargs, allow_empty=True)
        require(nbytes == -1 or nbytes > 0, f"size should be -1 or > 0, but got {nbytes}.")
        require(not entry.is_blocks, "pull_cache needs a contiguous destination cache; use pull_blocks.")
        if isinstance(cache_key, CacheKey):
            _check_cache_key_for_pull(cache_key)
        params = TransferParams("pull", "cache", (), (), src_range, dst_range, n, nbytes, slot)
        await self._transfer(cache_key, entry, params)

    async def pull_blocks(self, src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, dst_cache: Cache,
                          src_blocks: tuple[int, ...] | list[int] | None = (),
                          dst_blocks: tuple[int, ...] | list[int] = (), **kwargs: Any) -> None:
        """Pull remote blocks (``BlocksCacheKey``: B2B) or a remote contiguous slot cut into blocks (C2B) into
        ``dst_blocks`` of ``dst_cache``; block ``src_blocks[i]`` lands in ``dst_blocks[i]``.

        Timeouts and cancellation as :meth:`pull_cache`: the listed destination blocks are unspecified
        afterwards and never written once the call has returned.
        """
        self._check_open()
        check_isinstance("src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey))
        entry = self._entry("dst_cache", dst_cache)
        src = _blocks_arg("src_blocks", src_blocks, allow_none=True)
        dst = _blocks_arg("dst_blocks", dst_blocks, allow_none=False)
        src_range, dst_range, n = _layer_kwargs(kwargs, allow_empty=True)
        require(entry.is_blocks, "pull_blocks needs a blocks destination cache (B2C is not supported).")
        require(len(dst) > 0, "dst_blocks must not be empty.")
        if isinstance(src_cache_key, BlocksCacheKey):
            require(len(src) > 0, "src_blocks must not be empty when pulling by BlocksCacheKey.")
            require(len(src) == len(dst), f"number of src_blocks ({len(src)}) mismatches number of dst_blocks "
                    f"({len(dst)}).")
        else:
            require(len(src) == 0, "src_blocks must be empty when pulling from a contiguous cache (C2B).")
            if isinstance(src_cache_key, CacheKey):
                _check_cache_key_for_pull(src_cache_key)
        params = TransferParams("pull", "blocks", src, dst, src_range, dst_range, n, -1, 0)
        await self._transfer(src_cache_key, entry, params)

    def _check_push_enabled(self, name: str) -> None:
        require(self._remote_accessible_flag() is not False,
                f"{name} is only supported while enable_remote_cache_accessible is True.")

    async def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                         src_layer_range: range | None = None, dst_layer_range: range | None = None,
                         size: int = -1, tensor_num_per_layer: int = 2) -> None:
        """Push slot ``src_batch_index`` of a local contiguous cache into a remote cache's slot.

        Every layer is validated before any byte moves.  Timeouts and cancellation as :meth:`pull_cache`
        (here the remote slot is left unspecified, and never written after the call has returned).
        """
        self._check_open()
        self._check_push_enabled("push_cache")
        if type(dst_cache_key) is not CacheKeyByIdAndIndex:
            raise TypeError(f"dst_cache_key only support ['CacheKeyByIdAndIndex'], but got {type(dst_cache_key)}.")
        entry = self._entry("src_cache", src_cache)
        slot = check_int("src_batch_index", src_batch_index, "uint32")
        nbytes = check_int("size", size, "int64")
        src_range, dst_range, n = _layer_kwargs(
            {"src_layer_range": src_layer_range, "dst_layer_range": dst_layer_range,
             "tensor_num_per_layer": tensor_num_per_layer}, allow_empty=False)
        require(nbytes == -1, f"size should be = -1, but got {nbytes}.")
        require(not entry.is_blocks, "push_cache needs a contiguous source cache; use push_blocks.")
        params = TransferParams("push", "cache", (), (), src_range, dst_range, n, -1, slot)
        await self._transfer(dst_cache_key, entry, params)

    async def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache,
                          src_blocks: tuple[int, ...] | list[int] | None = (),
                          dst_blocks: tuple[int, ...] | list[int] = (), src_layer_range: range | None = None,
                          dst_layer_range: range | None = None, tensor_num_per_layer: int = 2) -> None:
        """Push local blocks ``src_blocks[i]`` into remote blocks ``dst_blocks[i]`` (B2B).

        Timeouts and cancellation as :meth:`push_cache`.
        """
        self._check_open()
        self._check_push_enabled("push_blocks")
        if type(dst_cache_key) is not BlocksCacheKey:
            raise TypeError(f"dst_cache_key only support ['BlocksCacheKey'], but got {type(dst_cache_key)}.")
        entry = self._entry("src_cache", src_cache)
        src = _blocks_arg("src_blocks", src_blocks, allow_none=True)
        dst = _blocks_arg("dst_blocks", dst_blocks, allow_none=False)
        src_range, dst_range, n = _layer_kwargs(
            {"src_layer_range": src_layer_range, "dst_layer_range": dst_layer_range,
             "tensor_num_per_layer": tensor_num_per_layer}, allow_empty=False)
        require(entry.is_blocks, "push_blocks needs a blocks source cache.")
        require(len(dst) > 0, "dst_blocks must not be empty.")
        require(len(src) > 0, "src_blocks must not be empty.")
        require(len(src) == len(dst), f"number of src_blocks ({len(src)}) mismatches number of dst_blocks "
                f"({len(dst)}).")
        params = TransferParams("push", "blocks", src, dst, src_range, dst_range, n, -1, 0)
        await self._transfer(dst_cache_key, entry, params)
