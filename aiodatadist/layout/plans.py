"""Pure layout math: cache geometry, layer ranges and block lists -> validated, coalesced copy plans.

Nothing here does I/O.  Every rule of LLM-DataDist's layer-range and block semantics lives here;
violations raise ``LLMException(LLM_PARAM_INVALID)``.  Plans are numpy arrays so that no caller needs a Python
loop per block.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from .._arrays import UInt64Array
from .._checks import param_invalid, require

_block_runs: Callable[..., bytes | None] | None
try:
    from ._blocks import (
        block_runs as _block_runs,  # the compiled fast path of b2b_runs (optional)
    )
except ImportError:
    _block_runs = None

__all__ = [
    "CacheGeometry",
    "CopyPlan",
    "PlanCache",
    "Runs",
    "Spans",
    "TransferParams",
    "all_tensor_indices",
    "b2b_runs",
    "c2b_runs",
    "coalesce",
    "copy_blocks_runs",
    "copy_cache_run",
    "make_plan",
    "plan_to_spans",
    "pull_tensor_indices",
    "push_tensor_indices",
    "slot_run",
    "swap_blocks_runs",
    "transfer_plan",
]

Int64Array = npt.NDArray[np.int64]
_INT64 = np.dtype(np.int64)


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    """Byte geometry of a cache: ``slots`` = ``shape[0]`` (batch size or number of blocks); ``data_type`` is the
    ``DataType`` value of its elements (-1: not known), which a transfer's two caches must share."""

    num_tensors: int
    tensor_size: int
    slots: int
    is_blocks: bool
    data_type: int = -1

    @property
    def stride(self) -> int:
        """Bytes of one batch slot (contiguous cache) or one block (blocks cache)."""
        return self.tensor_size // self.slots if self.slots else 0


class Runs(NamedTuple):
    """Byte runs inside one tensor: ``src_offset[i]`` -> ``dst_offset[i]``, ``length[i]`` bytes.

    Named tuples, this and :class:`CopyPlan`: a new plan (an engine's new blocks at every call) builds both, and a
    frozen dataclass's ``__init__`` costs several times a tuple's."""

    src_offset: Int64Array
    dst_offset: Int64Array
    length: Int64Array


class CopyPlan(NamedTuple):
    """Runs applied to every tensor pair: tensor ``src_tensor[k]`` -> ``dst_tensor[k]``."""

    src_tensor: Int64Array
    dst_tensor: Int64Array
    runs: Runs
    total_bytes: int  # bytes the plan moves (every run, every tensor pair)

    @property
    def num_spans(self) -> int:
        return len(self.runs.length) * len(self.src_tensor)


@dataclass(frozen=True, slots=True)
class Spans:
    """Absolute copy spans: ``length[i]`` bytes from address ``src[i]`` to address ``dst[i]``."""

    src: UInt64Array
    dst: UInt64Array
    length: UInt64Array

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    def __len__(self) -> int:
        return len(self.length)


def _i64(values: Sequence[int] | npt.ArrayLike) -> Int64Array:
    if type(values) is np.ndarray and values.dtype is _INT64 and values.ndim == 1:
        return values
    try:
        return np.asarray(values, dtype=np.int64).reshape(-1)
    except OverflowError:
        param_invalid("an index is out of range (>= 2**63).")


def coalesce(src: npt.NDArray[np.integer], dst: npt.NDArray[np.integer], length: npt.NDArray[np.integer]) -> tuple[
    npt.NDArray[np.integer], npt.NDArray[np.integer], npt.NDArray[np.integer]
]:
    """Merge consecutive entries that continue each other on both sides (vectorised)."""
    if len(length) <= 1:
        return src, dst, length
    cont = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:])
    if not cont.any():  # the common case for scattered blocks: nothing to merge
        return src, dst, length
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return src[starts], dst[starts], np.add.reduceat(length, starts)


def _runs(src_offset: Int64Array, dst_offset: Int64Array, length: Int64Array) -> Runs:
    s, d, n = coalesce(src_offset, dst_offset, length)
    return Runs(s.astype(np.int64, copy=False), d.astype(np.int64, copy=False), n.astype(np.int64, copy=False))


# -- layer ranges -> tensor indices ----------------------------------------------------------------------------

def _layer_tensors(layer_range: range | None, n: int) -> range | None:
    if layer_range is None or len(layer_range) == 0:
        return None
    return range(layer_range.start * n, layer_range.stop * n)


def all_tensor_indices(src: CacheGeometry, dst: CacheGeometry) -> tuple[Int64Array, Int64Array]:
    """Every tensor to the same index; both caches must have the same tensor count."""
    if src.num_tensors != dst.num_tensors:  # (messages are built only when raised: these checks run every call)
        param_invalid(f"num_tensors mismatch: source has {src.num_tensors}, destination has {dst.num_tensors}.")
    idx = _every_tensor(dst.num_tensors)
    return idx, idx


@functools.lru_cache(maxsize=64)
def _every_tensor(count: int) -> Int64Array:
    """``arange(count)``, read-only, made once per count (plans share it)."""
    idx = np.arange(count, dtype=np.int64)
    idx.flags.writeable = False
    return idx


def pull_tensor_indices(
    src: CacheGeometry,
    dst: CacheGeometry,
    src_layer_range: range | None,
    dst_layer_range: range | None,
    tensor_num_per_layer: int,
) -> tuple[Int64Array, Int64Array]:
    """Tensor windows of a pull (the destination is the local cache).

    An unset or empty range means "all"; with only ``src_layer_range`` it must cover the whole destination,
    with only ``dst_layer_range`` the source tensors are taken from the start.
    """
    n = tensor_num_per_layer
    require(n > 0, f"tensor_num_per_layer must be > 0, but got {n}.")
    s = _layer_tensors(src_layer_range, n)
    d = _layer_tensors(dst_layer_range, n)
    if s is None and d is None:
        return all_tensor_indices(src, dst)
    require(
        n <= dst.num_tensors and dst.num_tensors % n == 0,
        f"tensor_num_per_layer {n} must divide the cache's tensor count {dst.num_tensors}.",
    )
    if s is not None:
        require(s.stop <= src.num_tensors, f"src_layer_range {src_layer_range} exceeds the source's layers "
                f"({src.num_tensors // n}).")
    if d is not None:
        require(d.stop <= dst.num_tensors, f"dst_layer_range {dst_layer_range} exceeds the destination's layers "
                f"({dst.num_tensors // n}).")
    if s is not None and d is not None:
        require(len(s) == len(d), f"src_layer_range {src_layer_range} and dst_layer_range {dst_layer_range} "
                "have different lengths.")
    elif s is not None:
        require(len(s) == dst.num_tensors, f"src_layer_range {src_layer_range} selects {len(s)} tensors, "
                f"the destination has {dst.num_tensors}.")
        d = range(dst.num_tensors)
    else:
        assert d is not None
        require(len(d) <= src.num_tensors, f"dst_layer_range {dst_layer_range} needs {len(d)} source tensors, "
                f"the source has {src.num_tensors}.")
        s = range(len(d))
    return np.arange(s.start, s.stop, dtype=np.int64), np.arange(d.start, d.stop, dtype=np.int64)


def push_tensor_indices(
    src: CacheGeometry,
    dst: CacheGeometry,
    src_layer_range: range | None,
    dst_layer_range: range | None,
    tensor_num_per_layer: int,
) -> tuple[Int64Array, Int64Array]:
    """Tensor windows of a push (the source is the local cache); unset ranges = all layers of the source."""
    n = tensor_num_per_layer
    if n <= 0:
        param_invalid(f"tensor_num_per_layer must be > 0, but got {n}.")
    if src.num_tensors % n:
        param_invalid(f"tensor_num_per_layer {n} must divide the source cache's tensor count {src.num_tensors}.")
    for name, value in (("src_layer_range", src_layer_range), ("dst_layer_range", dst_layer_range)):
        if value is not None and value.start >= value.stop:
            param_invalid(f"{name} must satisfy 0 <= start < stop, but got {value}.")
    layers = src.num_tensors // n
    s_layers = src_layer_range if src_layer_range is not None else range(layers)
    d_layers = dst_layer_range if dst_layer_range is not None else range(layers)
    if len(s_layers) != len(d_layers):
        param_invalid(f"src_layer_range {s_layers} and dst_layer_range {d_layers} have different lengths.")
    if s_layers.stop > layers:
        param_invalid(f"src_layer_range {s_layers} exceeds the source's {layers} layers.")
    if d_layers.stop > dst.num_tensors // n:
        param_invalid(f"dst_layer_range {d_layers} exceeds the destination's {dst.num_tensors // n} layers.")
    return _tensor_window(s_layers.start * n, s_layers.stop * n), _tensor_window(d_layers.start * n, d_layers.stop * n)


def _tensor_window(start: int, stop: int) -> Int64Array:
    return _every_tensor(stop) if start == 0 else np.arange(start, stop, dtype=np.int64)


# -- block lists and slots -> byte runs -----------------------------------------------------------------------

def _check_blocks(name: str, blocks: Int64Array, geometry: CacheGeometry) -> None:
    if len(blocks):
        low, high = (min(blocks.tolist()), max(blocks.tolist())) if len(blocks) <= 64 else (
            int(blocks.min()), int(blocks.max()))
        require(low >= 0, f"{name} has a negative block index.")
        require(high < geometry.slots, f"{name} has block index {high} >= num_blocks {geometry.slots}.")


def _check_unique(name: str, values: Int64Array) -> None:
    n = len(values)
    distinct = len(set(values.tolist())) if n <= 512 else len(np.unique(values))  # cheapest either way
    require(distinct == n, f"{name} contains duplicate block indices.")


def b2b_runs(
    src_blocks: Sequence[int] | npt.ArrayLike,
    dst_blocks: Sequence[int] | npt.ArrayLike,
    src: CacheGeometry,
    dst: CacheGeometry,
) -> Runs:
    """Block ``src_blocks[i]`` -> block ``dst_blocks[i]``; both caches are blocks caches of equal block size.

    The runs are in source order: read in ascending addresses, scattered blocks copy 10-15 % faster (the
    hardware prefetchers and DRAM pages see one forward stream), and pairs given in any order still merge.
    Lists and tuples (every call's case) are checked and turned into runs in one native pass where the helper
    is built; anything it does not take (arrays, invalid input) goes through the vectorised checks."""
    if _block_runs is not None and src.stride == dst.stride:
        table = _block_runs(src_blocks, dst_blocks, src.slots, dst.slots, dst.stride)
        if table is not None:
            return _thirds(np.frombuffer(table, dtype=np.int64))  # read-only: the bytes are immutable
    s, d = _i64(src_blocks), _i64(dst_blocks)
    require(len(s) > 0, "src_blocks must not be empty.")
    require(len(d) > 0, "dst_blocks must not be empty.")
    require(len(s) == len(d), f"number of src_blocks ({len(s)}) mismatches number of dst_blocks ({len(d)}).")
    require(src.stride == dst.stride, f"block size mismatch: source {src.stride} bytes, destination {dst.stride}.")
    _check_blocks("src_blocks", s, src)
    _check_blocks("dst_blocks", d, dst)
    _check_unique("dst_blocks", d)
    if len(s) > 1 and not (s[1:] >= s[:-1]).all():
        order = np.argsort(s, kind="stable")
        s, d = s[order], d[order]
    stride = dst.stride
    return _runs(s * stride, d * stride, np.full(len(s), stride, dtype=np.int64))


def _table_runs(values: Sequence[int]) -> Runs:
    """Runs from ``n`` source offsets, then ``n`` destination offsets, then ``n`` lengths: one read-only array whose
    thirds are the runs' arrays (they inherit its read-only flag: plans are cached and shared, and marking each
    array read-only on its own costs ~0.9 us apiece here, a nested array ~1 us more than a flat one)."""
    try:
        table = np.array(values, dtype=np.int64)
    except OverflowError:
        param_invalid("an offset is out of range (>= 2**63).")
    table.flags.writeable = False
    return _thirds(table)


def _thirds(table: Int64Array) -> Runs:
    n = len(table) // 3
    return Runs(table[:n], table[n:2 * n], table[2 * n:])


def c2b_runs(
    src_slot: int, src: CacheGeometry, dst_blocks: Sequence[int] | npt.ArrayLike, dst: CacheGeometry
) -> Runs:
    """Cut the source slot into chunks of the destination block size; chunk ``i`` lands in ``dst_blocks[i]``.

    ``dst_blocks`` may be shorter than the number of chunks (only a prefix of the slot is moved), never longer.
    """
    d = _i64(dst_blocks)
    require(len(d) > 0, "dst_blocks must not be empty.")
    require(0 <= src_slot < src.slots, f"batch_index {src_slot} out of range [0, {src.slots}).")
    _check_blocks("dst_blocks", d, dst)
    _check_unique("dst_blocks", d)
    block, slot = dst.stride, src.stride
    require(block > 0, "destination block size is 0.")
    chunks = -(-slot // block)
    require(len(d) <= chunks, f"{len(d)} dst_blocks given, but the source slot of {slot} bytes fills only "
            f"{chunks} blocks of {block} bytes.")
    start = np.arange(len(d), dtype=np.int64) * block
    length = np.minimum(start + block, slot) - start
    return _runs(src_slot * slot + start, d * block, length)


def slot_run(
    src_slot: int, src: CacheGeometry, dst_slot: int, dst: CacheGeometry, size: int = -1
) -> Runs:
    """One batch slot to another (``pull_cache``/``push_cache``); ``size`` -1 = the destination slot."""
    require(0 <= src_slot < src.slots, f"source batch_index {src_slot} out of range [0, {src.slots}).")
    require(0 <= dst_slot < dst.slots, f"destination batch_index {dst_slot} out of range [0, {dst.slots}).")
    require(size == -1 or size > 0, f"size should be -1 or > 0, but got {size}.")
    nbytes = dst.stride if size == -1 else size
    require(nbytes <= dst.stride, f"size {nbytes} exceeds the destination slot of {dst.stride} bytes.")
    require(nbytes <= src.stride, f"size {nbytes} exceeds the source slot of {src.stride} bytes.")
    return _table_runs((src_slot * src.stride, dst_slot * dst.stride, nbytes))


def copy_cache_run(
    geometry: CacheGeometry, dst_slot: int, src_slot: int, offset: int = 0, size: int = -1
) -> Runs:
    """``copy_cache``: ``size`` bytes at ``offset`` within a slot, between slots of two same-shaped caches."""
    stride = geometry.stride
    require(0 <= src_slot < geometry.slots, f"src_batch_index {src_slot} out of range [0, {geometry.slots}).")
    require(0 <= dst_slot < geometry.slots, f"dst_batch_index {dst_slot} out of range [0, {geometry.slots}).")
    require(0 <= offset < stride, f"offset {offset} out of range [0, {stride}).")
    require(size == -1 or size > 0, f"size should be -1 or > 0, but got {size}.")
    nbytes = stride - offset if size == -1 else size
    require(offset + nbytes <= stride, f"offset {offset} + size {nbytes} exceeds the slot of {stride} bytes.")
    return _runs(_i64([src_slot * stride + offset]), _i64([dst_slot * stride + offset]), _i64([nbytes]))


def copy_blocks_runs(copy_block_info: Mapping[int, Sequence[int]], geometry: CacheGeometry) -> Runs:
    """``copy_blocks``: each source block to each of its destination blocks, within one blocks cache.

    Destinations must be unique and must not be sources of the same call (the result would depend on order).
    """
    require(len(copy_block_info) > 0, "copy_block_info must not be empty.")
    src_list = list(copy_block_info.keys())
    counts = [len(v) for v in copy_block_info.values()]
    require(all(c > 0 for c in counts), "every source block needs at least one destination block.")
    s = np.repeat(_i64(src_list), counts)
    d = _i64([b for v in copy_block_info.values() for b in v])
    _check_blocks("source blocks", s, geometry)
    _check_blocks("destination blocks", d, geometry)
    _check_unique("destination blocks", d)
    require(not np.isin(d, s).any(), "a destination block is also a source block of the same copy.")
    order = np.lexsort((d, s))  # source order, as b2b_runs; a source's destinations in a row
    stride = geometry.stride
    return _runs(s[order] * stride, d[order] * stride, np.full(len(d), stride, dtype=np.int64))


def swap_blocks_runs(src_to_dst: Mapping[int, int], src: CacheGeometry, dst: CacheGeometry) -> Runs:
    """``swap_blocks``: block ``k`` of ``src`` -> block ``src_to_dst[k]`` of ``dst`` (equal block sizes)."""
    require(len(src_to_dst) > 0, "src_to_dst must not be empty.")
    require(src.stride == dst.stride, f"block size mismatch: source {src.stride} bytes, destination {dst.stride}.")
    require(src.num_tensors == dst.num_tensors,
            f"num_tensors mismatch: source {src.num_tensors}, destination {dst.num_tensors}.")
    s = _i64(list(src_to_dst.keys()))
    d = _i64(list(src_to_dst.values()))
    _check_blocks("source blocks", s, src)
    _check_blocks("destination blocks", d, dst)
    _check_unique("destination blocks", d)
    order = np.argsort(s, kind="stable")
    stride = src.stride
    return _runs(s[order] * stride, d[order] * stride, np.full(len(s), stride, dtype=np.int64))


# -- plans -> absolute spans ----------------------------------------------------------------------------------

def make_plan(src_tensors: Int64Array, dst_tensors: Int64Array, runs: Runs) -> CopyPlan:
    require(len(src_tensors) == len(dst_tensors), "tensor index lists differ in length.")
    src, dst = _i64(src_tensors), _i64(dst_tensors)
    lengths = runs.length  # (a numpy reduction costs ~3 us whatever the size; a short list's sum less)
    per_tensor = sum(lengths.tolist()) if len(lengths) <= 64 else int(lengths.sum())
    return CopyPlan(src, dst, runs, per_tensor * len(src))


def plan_to_spans(plan: CopyPlan, src_addrs: npt.ArrayLike, dst_addrs: npt.ArrayLike) -> Spans:
    """Absolute address spans of a plan, tensor-major, merged where memory is contiguous on both sides."""
    sa = np.asarray(src_addrs, dtype=np.uint64)
    da = np.asarray(dst_addrs, dtype=np.uint64)
    runs = plan.runs
    # (tensor, run) grids by broadcasting; offsets and lengths are non-negative, so the uint64 views are exact.
    src = (sa[plan.src_tensor][:, None] + runs.src_offset.view(np.uint64)[None, :]).ravel()
    dst = (da[plan.dst_tensor][:, None] + runs.dst_offset.view(np.uint64)[None, :]).ravel()
    length = np.empty((len(plan.src_tensor), len(runs.length)), dtype=np.uint64)
    length[:] = runs.length.view(np.uint64)
    s, d, n = coalesce(src, dst, length.ravel())
    return Spans(s.astype(np.uint64, copy=False), d.astype(np.uint64, copy=False), n.astype(np.uint64, copy=False))


V = TypeVar("V")


class PlanCache(OrderedDict[tuple[Any, ...], tuple["CopyPlan", V]]):
    """What was derived from a plan and the memory it runs on (span lists, a prepared launch), least recently used
    first out.  Keyed by the plan's ``id`` and the caller's parts (the tensors' addresses, as bytes): an entry keeps
    its plan alive, so the ``id`` still names it, and a hit checks that it is that plan.  Memory re-registered
    elsewhere has other addresses, hence other entries.  Thread-safe: instances on event loops of several threads
    share one.

    A value is kept only from its key's second sight on: a serving engine's transfers name new blocks at nearly
    every call, and keeping each of those one-off values would cost every call an insertion and an eviction (and
    whatever the evicted value held).  Keys seen once are remembered by hash (:attr:`SEEN_PER_ENTRY` per entry
    kept); a collision only keeps a value early."""

    SEEN_PER_ENTRY = 4

    def __init__(self, size: int, on_evict: Callable[[V], None] | None = None) -> None:
        super().__init__()
        self.size = size
        self._on_evict = on_evict  # told of each value pushed out (under the cache's lock: keep it short)
        self._lock = threading.Lock()
        self._seen: OrderedDict[int, None] = OrderedDict()  # hashes of keys seen once, oldest first

    def get_or_make(self, plan: CopyPlan, parts: tuple[Any, ...], make: Callable[[bool], V]) -> V:
        """The value kept for ``plan`` and ``parts``, or one made now (outside the lock) by ``make(kept)``:
        ``kept`` says whether the cache keeps it (its key's second sight) or the caller has it for this once."""
        key = (id(plan), *parts)
        with self._lock:
            found = self.get(key)
            if found is not None and found[0] is plan:
                self.move_to_end(key)
                return found[1]
            seen = hash(key)
            keep = found is not None or seen in self._seen
            if keep:
                self._seen.pop(seen, None)
            else:
                self._seen[seen] = None
                if len(self._seen) > self.SEEN_PER_ENTRY * self.size:
                    self._seen.popitem(last=False)
        value = make(keep)
        if keep:
            with self._lock:
                replaced = self.get(key)
                self[key] = (plan, value)
                while len(self) > self.size:
                    _, (_, evicted) = self.popitem(last=False)
                    if self._on_evict is not None:
                        self._on_evict(evicted)
                if replaced is not None and self._on_evict is not None:
                    self._on_evict(replaced[1])
        return value

    def clear(self) -> None:
        with self._lock:
            super().clear()
            self._seen.clear()


# -- transfers between two caches -----------------------------------------------------------------------------

class TransferParams(NamedTuple):
    """What a pull/push asks for, as both sides see it (``local_slot`` is the requester's batch slot).

    A named tuple, not a frozen dataclass: every call builds one, and a frozen dataclass's ``__init__`` costs
    several times as much (one ``object.__setattr__`` per field)."""

    op: str  # "pull" (owner is the source) or "push" (owner is the destination)
    api: str  # "cache" (pull_cache/push_cache) or "blocks" (pull_blocks/push_blocks)
    src_blocks: tuple[int, ...] = ()
    dst_blocks: tuple[int, ...] = ()
    src_layer_range: range | None = None
    dst_layer_range: range | None = None
    tensor_num_per_layer: int = 2
    size: int = -1
    local_slot: int = 0


def _type_name(value: int) -> str:
    from ..types import DataType  # layout stays free of the API types but for this message

    try:
        return DataType(value).name
    except ValueError:
        return f"data type {value}"


PLAN_CACHE_SIZE = 1024
"""Transfer plans kept (least recently used first out): a call that repeats a recent transfer's block lists and
geometries reuses its plan, on both ends."""


def transfer_plan(params: TransferParams, requester: CacheGeometry, owner: CacheGeometry, owner_slot: int) -> CopyPlan:
    """The validated plan of a pull or push; requester and owner compute the same plan independently.

    Plans are cached by their arguments: a plan holds no address, only tensor indices and byte offsets, so it is
    right for any memory of these geometries (caches re-registered elsewhere included), and its arrays are
    read-only.  Invalid arguments raise every time (errors are not cached)."""
    return _cached_plan(params, requester, owner, owner_slot)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _cached_plan(params: TransferParams, requester: CacheGeometry, owner: CacheGeometry, owner_slot: int) -> CopyPlan:
    plan = _transfer_plan(params, requester, owner, owner_slot)
    for array in (plan.src_tensor, plan.dst_tensor, plan.runs.src_offset, plan.runs.dst_offset, plan.runs.length):
        if array.flags.writeable:
            array.flags.writeable = False
    return plan


def _transfer_plan(params: TransferParams, requester: CacheGeometry, owner: CacheGeometry,
                   owner_slot: int) -> CopyPlan:
    require(params.op in ("pull", "push") and params.api in ("cache", "blocks"), "unknown transfer kind.")
    if requester.data_type != owner.data_type:  # (the message names the types: built only when it is raised)
        param_invalid(f"data type mismatch: the local cache holds {_type_name(requester.data_type)}, the remote "
                      f"cache {_type_name(owner.data_type)}.")
    if params.op == "pull":
        src, dst, src_slot, dst_slot = owner, requester, owner_slot, params.local_slot
        tensors = pull_tensor_indices(src, dst, params.src_layer_range, params.dst_layer_range,
                                      params.tensor_num_per_layer)
    else:
        src, dst, src_slot, dst_slot = requester, owner, params.local_slot, owner_slot
        tensors = push_tensor_indices(src, dst, params.src_layer_range, params.dst_layer_range,
                                      params.tensor_num_per_layer)
    if params.api == "cache":
        require(not src.is_blocks, "the source is a blocks cache: use pull_blocks/push_blocks (B2C is not supported).")
        require(not dst.is_blocks, "the destination is a blocks cache: use pull_blocks/push_blocks.")
        runs = slot_run(src_slot, src, dst_slot, dst, params.size)
    else:
        require(dst.is_blocks, "Pulling from discrete memory to continuous memory is not supported "
                "(the destination must be a blocks cache).")
        if src.is_blocks:
            require(src_slot == 0, "a blocks cache is addressed with batch_index 0.")
            runs = b2b_runs(params.src_blocks, params.dst_blocks, src, dst)
        else:
            require(len(params.src_blocks) == 0, "src_blocks must be empty when the source is a contiguous cache.")
            runs = c2b_runs(src_slot, src, params.dst_blocks, dst)
    return make_plan(tensors[0], tensors[1], runs)
