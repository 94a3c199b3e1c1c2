"""Wire forms of the transfer conversation (BEGIN parameters, cache descriptors, published entries)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._checks import I64_MAX, U64_LIMIT, check_int
from ..cuda.driver import CU_IPC_HANDLE_SIZE
from ..layout import TransferParams
from ..protocol.codec import ProtocolError, field, int_field, opt_int_list, uint64_array
from ..protocol.messages import WireKey, geometry_from_wire, range_from_wire, range_to_wire, segment_from_wire
from ..types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from .state import Descriptor

__all__ = ["params_from_wire", "params_to_wire", "parse_descriptor", "published_from_wire", "wire_key"]

MAX_IPC_ALLOCATIONS = 4096


def wire_key(key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey) -> WireKey:
    if isinstance(key, CacheKeyByIdAndIndex):
        return WireKey("id", key.cache_id, key.batch_index)
    if isinstance(key, BlocksCacheKey):
        return WireKey("blocks", check_int("model_id", key.model_id, "uint64"), 0)
    kind, ident, model = key.index_key()
    return WireKey(kind, ident, model)


def params_to_wire(p: TransferParams) -> dict[str, Any]:
    return {
        "op": p.op, "api": p.api, "sb": list(p.src_blocks), "db": list(p.dst_blocks),
        "sr": range_to_wire(p.src_layer_range), "dr": range_to_wire(p.dst_layer_range),
        "n": p.tensor_num_per_layer, "size": p.size, "slot": p.local_slot,
    }


def params_from_wire(m: dict[str, Any]) -> TransferParams:
    op, api = field(m, "op", str), field(m, "api", str)
    if op not in ("pull", "push") or api not in ("cache", "blocks"):
        raise ProtocolError("unknown transfer kind")
    return TransferParams(
        op=op, api=api,
        src_blocks=tuple(opt_int_list(m, "sb", 0, I64_MAX)), dst_blocks=tuple(opt_int_list(m, "db", 0, I64_MAX)),
        src_layer_range=range_from_wire(m.get("sr")), dst_layer_range=range_from_wire(m.get("dr")),
        tensor_num_per_layer=int_field(m, "n", 1, 2**32 - 1), size=int_field(m, "size", -1, I64_MAX),
        local_slot=int_field(m, "slot", 0, 2**32 - 1),
    )


def parse_descriptor(value: Any) -> Descriptor:
    """An owner's cache descriptor: geometry, tensor addresses (inside its segment, if any), segment."""
    if not isinstance(value, dict):
        raise ProtocolError("invalid cache descriptor")
    geometry = geometry_from_wire(value.get("geometry"))
    addrs = uint64_array(value, "addrs")
    segment = segment_from_wire(value.get("segment"))
    if len(addrs) != geometry.num_tensors or not _addrs_inside(addrs, geometry.tensor_size, segment):
        raise ProtocolError("the owner announced addresses outside its cache")
    return geometry, addrs, segment, _ipc_from_wire(value.get("ipc"))


def _ipc_from_wire(value: Any) -> list[tuple[bytes, int, int]] | None:
    """A device cache's allocations ``[handle, base, size]``, sorted by base (None: a host cache)."""
    if value is None:
        return None
    if not (isinstance(value, list) and 0 < len(value) <= MAX_IPC_ALLOCATIONS):
        raise ProtocolError("invalid device allocations")
    out = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], bytes)
                and len(item[0]) == CU_IPC_HANDLE_SIZE
                and all(type(v) is int and 0 < v < U64_LIMIT for v in item[1:]) and item[1] + item[2] < U64_LIMIT):
            raise ProtocolError("invalid device allocation")
        out.append((item[0], item[1], item[2]))
    return sorted(out, key=lambda item: item[1])


def published_from_wire(value: Any) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)):
        raise ProtocolError("invalid directory entry")
    return value[0], value[1]


def _addrs_inside(addrs: np.ndarray, tensor_size: int, segment: tuple[Any, int] | None) -> bool:
    if segment is None:
        return True
    identity, base = segment
    return bool(((addrs >= base) & (addrs + np.uint64(tensor_size) <= base + identity.size)).all())
