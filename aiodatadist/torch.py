"""Torch interop: dtypes, cache descriptions and registrations from tensors, zero-copy torch views of caches.

Nothing else in the package imports this module, and ``import aiodatadist`` never imports torch: torch is
imported here, when this module is.  It works with the asyncio :class:`aiodatadist.CacheManager` and with the
blocking one of :mod:`aiodatadist.sync` (the registration functions only call ``register_cache`` /
``register_blocks_cache``)::

    from aiodatadist.torch import register_blocks_cache_from_tensors, tensors_of

    kv = [torch.zeros(num_blocks, block_size, heads, head_dim, dtype=torch.bfloat16) for _ in range(2 * layers)]
    cache = register_blocks_cache_from_tensors(cache_manager, kv, BlocksCacheKey(cluster_id, 0))

Registered tensors are caller-owned memory, exactly as with ``register_cache``: keep them alive (and do not
resize them) until the cache is unregistered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - only without torch
    raise ImportError("aiodatadist.torch needs torch; install it (pip install torch) or use the numpy API "
                      "(Cache.tensors, register_cache with data_ptr() addresses)") from exc

from ._checks import check_isinstance, param_invalid, require
from .cache import Cache
from .memory import HostMemory
from .types import BlocksCacheKey, CacheDesc, CacheKey, DataType, Placement

__all__ = [
    "DEVICE_TYPES",
    "Registrar",
    "cache_desc_from_tensors",
    "from_torch_dtype",
    "host_memory_tensor",
    "placement_of",
    "register_blocks_cache_from_tensors",
    "register_cache_from_tensors",
    "tensors_of",
    "to_torch_dtype",
]

_TORCH_DTYPES: dict[DataType, torch.dtype] = {
    DataType.DT_FLOAT: torch.float32,
    DataType.DT_FLOAT16: torch.float16,
    DataType.DT_BF16: torch.bfloat16,
    DataType.DT_DOUBLE: torch.float64,
    DataType.DT_INT8: torch.int8,
    DataType.DT_INT16: torch.int16,
    DataType.DT_INT32: torch.int32,
    DataType.DT_INT64: torch.int64,
    DataType.DT_UINT8: torch.uint8,
    DataType.DT_BOOL: torch.bool,
}
for _name, _data_type in (("uint16", DataType.DT_UINT16), ("uint32", DataType.DT_UINT32),
                          ("uint64", DataType.DT_UINT64)):
    _dtype = getattr(torch, _name, None)  # torch >= 2.3 (limited support, but enough to hold and view bytes)
    if isinstance(_dtype, torch.dtype):
        _TORCH_DTYPES[_data_type] = _dtype
del _name, _data_type, _dtype
_DATA_TYPES: dict[torch.dtype, DataType] = {dtype: data_type for data_type, dtype in _TORCH_DTYPES.items()}


class Registrar(Protocol):
    """What the registration functions need of a cache manager: the asyncio ``aiodatadist.CacheManager`` and
    ``aiodatadist.sync.CacheManager`` both are one."""

    def register_cache(self, cache_desc: CacheDesc, addrs: list[int],
                       cache_keys: tuple[CacheKey, ...] | list[CacheKey] = (),
                       remote_accessible: bool | None = None) -> Cache: ...

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: list[int],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache: ...


# -- dtypes ------------------------------------------------------------------------------------------------------
def to_torch_dtype(data_type: DataType) -> torch.dtype:
    """The torch dtype of a ``DataType`` (``DT_BF16`` is ``torch.bfloat16``); ``DT_STRING`` has none
    (``LLM_PARAM_INVALID``); not a ``DataType``: ``TypeError``."""
    check_isinstance("data_type", data_type, DataType)
    dtype = _TORCH_DTYPES.get(data_type)
    if dtype is None:
        param_invalid(f"{data_type} has no torch dtype.")
    return dtype


def from_torch_dtype(dtype: torch.dtype) -> DataType:
    """The ``DataType`` of a torch dtype; one without a counterpart (complex, float8, quantized...) raises
    ``LLM_PARAM_INVALID``; not a ``torch.dtype``: ``TypeError``."""
    check_isinstance("dtype", dtype, torch.dtype)
    data_type = _DATA_TYPES.get(dtype)
    if data_type is None:
        param_invalid(f"torch dtype {dtype} has no DataType; supported: {sorted(str(d) for d in _DATA_TYPES)}.")
    return data_type


DEVICE_TYPES = ("cuda", "npu")
"""Torch device types whose tensors are ``Placement.DEVICE`` memory: CUDA, and Ascend NPUs (torch_npu's ``npu``,
recognised by name: this module never imports torch_npu)."""


def placement_of(device: torch.device | str) -> Placement:
    """``Placement.HOST`` for a CPU device, ``Placement.DEVICE`` for a CUDA or NPU device; others
    ``LLM_PARAM_INVALID``."""
    check_isinstance("device", device, (torch.device, str))
    kind = device.type if isinstance(device, torch.device) else device.partition(":")[0]
    if kind not in DEVICE_TYPES:
        kind = torch.device(device).type  # (also validates a string torch knows)
    if kind == "cpu":
        return Placement.HOST
    if kind in DEVICE_TYPES:
        return Placement.DEVICE
    param_invalid(f"tensors on {device} are not supported (only cpu, cuda and npu).")


# -- descriptions and registration -------------------------------------------------------------------------------
def _check_tensors(tensors: Any) -> tuple[list[torch.Tensor], DataType, torch.device]:
    """The tensors of one cache: a non-empty list or tuple of contiguous, dense tensors of one shape, dtype and
    device (cpu, cuda or npu), each holding at least one element."""
    check_isinstance("tensors", tensors, (list, tuple))
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors inner type only support ['Tensor'], but got {type(tensor)}.")
    items: list[torch.Tensor] = list(tensors)
    require(len(items) > 0, "tensors must not be empty.")
    first = items[0]
    for i, tensor in enumerate(items):
        require(tensor.layout == torch.strided, f"tensors[{i}] has layout {tensor.layout}; only dense (strided) "
                "tensors can be registered.")
        require(tensor.dtype == first.dtype, f"tensors[{i}] has dtype {tensor.dtype}, tensors[0] {first.dtype}.")
        require(tensor.shape == first.shape,
                f"tensors[{i}] has shape {list(tensor.shape)}, tensors[0] {list(first.shape)}.")
        require(tensor.device == first.device,
                f"tensors[{i}] is on {tensor.device}, tensors[0] on {first.device}; a cache lives on one device.")
        require(tensor.is_contiguous(), f"tensors[{i}] is not contiguous (strides {list(tensor.stride())}); "
                "register .contiguous() copies or the underlying buffer.")
    require(first.dim() >= 1 and first.numel() > 0,
            f"tensors must have at least one dimension and one element, but got shape {list(first.shape)}.")
    placement_of(first.device)
    return items, from_torch_dtype(first.dtype), first.device


def cache_desc_from_tensors(tensors: Sequence[torch.Tensor], *, batch_dim_index: int = 0,
                            seq_len_dim_index: int = -1, kv_tensor_format: str | None = None) -> CacheDesc:
    """The ``CacheDesc`` of a list of tensors: ``num_tensors=len(tensors)``, their shape and data type, and
    ``Placement.HOST`` (cpu) or ``Placement.DEVICE`` (cuda, npu).

    The tensors must be a non-empty list or tuple (``TypeError`` for another container or a non-tensor) of
    contiguous dense tensors with one shape, one dtype that has a ``DataType`` and one device, each with at least
    one element (``LLM_PARAM_INVALID`` otherwise).
    """
    items, data_type, device = _check_tensors(tensors)
    return CacheDesc(len(items), tuple(int(d) for d in items[0].shape), data_type, placement_of(device),
                     batch_dim_index, seq_len_dim_index, kv_tensor_format)


def _desc_and_addrs(cache_manager: Any, tensors: Any, cache_desc: CacheDesc | None) -> tuple[CacheDesc, list[int]]:
    items, data_type, device = _check_tensors(tensors)
    placement = placement_of(device)
    if cache_desc is None:
        desc = CacheDesc(len(items), tuple(int(d) for d in items[0].shape), data_type, placement)
    else:
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        desc = cache_desc
        require(desc.num_tensors == len(items),
                f"cache_desc.num_tensors {desc.num_tensors} != len(tensors) {len(items)}.")
        require(desc.data_type == data_type,
                f"cache_desc.data_type {desc.data_type} does not match the tensors' dtype {items[0].dtype}.")
        require(desc.placement == placement,
                f"cache_desc.placement {desc.placement} does not match the tensors' device {device}.")
    nbytes = items[0].numel() * items[0].element_size()
    require(nbytes == desc.size,
            f"each tensor holds {nbytes} bytes, but cache_desc.size is {desc.size}: the tensors must be exactly as "
            "large as the description.")
    if placement == Placement.DEVICE:
        device_id = getattr(cache_manager, "device_id", None)
        index = device.index
        if index is None:  # the backend's current device (torch.cuda, or torch.npu once torch_npu is imported)
            backend = getattr(torch, device.type, None)
            index = backend.current_device() if backend is not None else None
        require(not isinstance(device_id, int) or index is None or index == device_id,
                f"the tensors are on {device}, but the instance's device_id is {device_id}.")
    return desc, [int(t.data_ptr()) for t in items]


def register_cache_from_tensors(cache_manager: Registrar, tensors: Sequence[torch.Tensor],
                                cache_keys: tuple[CacheKey, ...] | list[CacheKey] = (),
                                remote_accessible: bool | None = None, *,
                                cache_desc: CacheDesc | None = None) -> Cache:
    """``register_cache`` of a contiguous cache made of ``tensors`` (one per tensor of the cache).

    The description is :func:`cache_desc_from_tensors`, or ``cache_desc`` when given (another shape of the same
    bytes: it must have ``len(tensors)`` tensors, their data type and placement, and ``size`` equal to each
    tensor's bytes).  The tensors are checked as in :func:`cache_desc_from_tensors`; CUDA tensors must be on the
    instance's ``device_id``.  Keep them alive until ``unregister_cache``.
    """
    desc, addrs = _desc_and_addrs(cache_manager, tensors, cache_desc)
    return cache_manager.register_cache(desc, addrs, cache_keys, remote_accessible)


def register_blocks_cache_from_tensors(cache_manager: Registrar, tensors: Sequence[torch.Tensor],
                                       blocks_cache_key: BlocksCacheKey | None = None,
                                       remote_accessible: bool | None = None, *,
                                       cache_desc: CacheDesc | None = None) -> Cache:
    """``register_blocks_cache`` of a paged cache made of ``tensors`` (``shape[0]`` blocks each); checks and
    ``cache_desc`` as in :func:`register_cache_from_tensors`."""
    desc, addrs = _desc_and_addrs(cache_manager, tensors, cache_desc)
    return cache_manager.register_blocks_cache(desc, addrs, blocks_cache_key, remote_accessible)


# -- views -------------------------------------------------------------------------------------------------------
def tensors_of(cache: Cache) -> list[torch.Tensor]:
    """Zero-copy CPU torch views of a HOST cache's tensors, with ``cache_desc.shape`` and the torch dtype of its
    data type (bf16 as ``torch.bfloat16``).  They share memory with ``cache.tensors`` (and with the registered
    tensors of a registered cache) and are valid while the cache is: do not use them after it was released.

    A released cache raises ``LLM_KV_CACHE_NOT_EXIST`` and a DEVICE cache ``LLM_FEATURE_NOT_ENABLED``, as
    ``Cache.tensors`` does; ``DT_STRING`` raises ``LLM_PARAM_INVALID``.
    """
    check_isinstance("cache", cache, Cache)
    desc = cache.cache_desc
    dtype = to_torch_dtype(desc.data_type)
    shape = tuple(int(d) for d in desc.shape)
    views = []
    for array in cache.tensors:
        raw = np.asarray(array).reshape(-1).view(np.uint8)  # a view: the cache's tensors are contiguous
        views.append(torch.from_numpy(raw).view(dtype).view(shape))
    return views


def host_memory_tensor(memory: HostMemory, dtype: torch.dtype | DataType, shape: Sequence[int], *,
                       offset: int = 0) -> torch.Tensor:
    """A zero-copy CPU torch tensor of ``shape`` and ``dtype`` (a ``torch.dtype`` or a :class:`DataType`) over
    ``memory`` (from ``CacheManager.allocate_host_memory``) at byte ``offset``: an engine's KV tensors in
    shareable memory.  It shares the bytes with ``memory.array()``; register it with
    :func:`register_blocks_cache_from_tensors` (or ``data_ptr()`` addresses) to take the mapped path.  Raises
    ``LLM_PARAM_INVALID`` when the tensor does not fit or ``offset`` is not aligned to the dtype.
    """
    check_isinstance("memory", memory, HostMemory)
    torch_dtype = to_torch_dtype(dtype) if isinstance(dtype, DataType) else dtype
    check_isinstance("dtype", torch_dtype, torch.dtype)
    dims = tuple(int(d) for d in shape)
    require(all(d >= 0 for d in dims), f"shape {list(dims)} must be all >= 0.")
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    count = int(np.prod(dims, dtype=np.int64)) if dims else 1
    require(offset >= 0 and offset % itemsize == 0, f"offset {offset} must be >= 0 and a multiple of {itemsize}.")
    require(offset + count * itemsize <= memory.size,
            f"{count * itemsize} bytes at offset {offset} exceed the host memory's {memory.size} bytes.")
    raw = torch.from_numpy(memory.array()[offset: offset + count * itemsize])
    return raw.view(torch_dtype).view(dims)
