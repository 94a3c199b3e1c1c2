"""Value types of the LLM-DataDist API: enums, cache descriptions, cache keys, cluster info."""

from __future__ import annotations

import socket
from enum import Enum, IntEnum
from math import prod
from typing import Any

import numpy as np

from ._checks import INT_ONLY, U64_MAX, check_int, check_isinstance, require
from .errors import LLMException, LLMStatusCode

__all__ = [
    "BlocksCacheKey",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "DataType",
    "LLMClusterInfo",
    "LLMRole",
    "Placement",
    "Transport",
    "cluster_info_for",
]


class LLMRole(IntEnum):
    """Role label of an instance; it does not restrict which side pulls or pushes."""

    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self) -> str:
        return f"LLMRole.{self.name}"


class Placement(IntEnum):
    """Where a cache lives: host memory or (CUDA) device memory."""

    HOST = 0
    DEVICE = 1

    def __str__(self) -> str:
        return f"Placement.{self.name}"


class Transport(str, Enum):
    """Data plane choice for links (option ``llm.Transport``): ``nixl`` moves the bytes through NIXL (its UCX
    backend: RDMA where the hosts have it), an optional extra."""

    AUTO = "auto"
    SHM = "shm"
    TCP = "tcp"
    NIXL = "nixl"

    def __str__(self) -> str:
        return self.value


class DataType(Enum):
    """Element types with GE's numeric values (a plain ``Enum``, as in the reference)."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27

    @property
    def itemsize(self) -> int:
        """Bytes per element (``DT_STRING`` has no fixed size and raises ``LLM_PARAM_INVALID``)."""
        return self.np_dtype.itemsize

    @property
    def np_dtype(self) -> np.dtype[Any]:
        """The numpy dtype used for host views; bf16 is exposed as raw 2-byte words (``uint16``)."""
        if self is DataType.DT_STRING:
            raise LLMException("DT_STRING has no fixed item size", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        dtype: np.dtype[Any] = np.dtype(_NP_DTYPES[self])
        return dtype


_NP_DTYPES: dict[DataType, Any] = {
    DataType.DT_FLOAT: np.float32,
    DataType.DT_FLOAT16: np.float16,
    DataType.DT_INT8: np.int8,
    DataType.DT_INT32: np.int32,
    DataType.DT_UINT8: np.uint8,
    DataType.DT_INT16: np.int16,
    DataType.DT_UINT16: np.uint16,
    DataType.DT_UINT32: np.uint32,
    DataType.DT_INT64: np.int64,
    DataType.DT_UINT64: np.uint64,
    DataType.DT_DOUBLE: np.float64,
    DataType.DT_BOOL: np.bool_,
    DataType.DT_BF16: np.uint16,
}


class CacheDesc:
    """Description of a cache: ``num_tensors`` tensors of identical ``shape`` and ``data_type``.

    ``shape[0]`` is the batch size of a contiguous cache and the number of blocks of a blocks cache.
    """

    __slots__ = (
        "_batch_dim_index",
        "_data_type",
        "_kv_tensor_format",
        "_num_tensors",
        "_placement",
        "_seq_len_dim_index",
        "_shape",
        "_size",
    )

    def __init__(
        self,
        num_tensors: int,
        shape: tuple[int, ...] | list[int],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        self._num_tensors = check_int("num_tensors", num_tensors, "uint32")
        check_isinstance("shape", shape, (list, tuple))
        for dim in shape:
            check_int("shape", dim, "int64")
        check_isinstance("data_type", data_type, DataType)
        check_isinstance("placement", placement, Placement)
        check_isinstance("batch_dim_index", batch_dim_index, int)
        require(
            0 <= batch_dim_index < len(shape),
            f"batch_dim_index should be in [0, {len(shape)}), but got {batch_dim_index}.",
        )
        check_int("seq_len_dim_index", seq_len_dim_index, "int32")
        require(
            seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
            f"seq_len_dim_index should be -1 or in [0, {len(shape)}), but got {seq_len_dim_index}.",
        )
        check_isinstance("kv_tensor_format", kv_tensor_format, str, allow_none=True)
        self._shape = shape
        self._data_type = data_type
        self._placement = placement
        self._batch_dim_index = batch_dim_index
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format
        self._size: int | None = None

    @property
    def num_tensors(self) -> int:
        return self._num_tensors

    @property
    def shape(self) -> tuple[int, ...] | list[int]:
        """The shape object passed in (``update_dim`` changes it)."""
        return self._shape

    @property
    def data_type(self) -> DataType:
        return self._data_type

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def batch_dim(self) -> int:
        return self._batch_dim_index

    @property
    def batch_size(self) -> int:
        return int(self._shape[self._batch_dim_index])

    @property
    def seq_len_dim_index(self) -> int:
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> str | None:
        return self._kv_tensor_format

    @property
    def size(self) -> int:
        """Bytes of one tensor (``prod(shape) * itemsize``)."""
        if self._size is None:
            require(
                all(int(d) >= 0 for d in self._shape),
                f"shape {list(self._shape)} has a negative dimension, size is undefined.",
            )
            self._size = prod(int(d) for d in self._shape) * self._data_type.itemsize
        return self._size

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Set ``shape[dim_index] = dim_value`` (in place for lists) and reset the cached size."""
        check_isinstance("dim_index", dim_index, int)
        check_int("dim_value", dim_value, "int64")
        require(0 <= dim_index < len(self._shape), f"dim_index {dim_index} out of range of shape.")
        if isinstance(self._shape, list):
            self._shape[dim_index] = dim_value
        else:
            dims = list(self._shape)
            dims[dim_index] = dim_value
            self._shape = tuple(dims)
        self._size = None

    def copy(self) -> CacheDesc:
        """An independent copy (caches snapshot their description at creation)."""
        return CacheDesc(
            self._num_tensors, tuple(int(d) for d in self._shape), self._data_type, self._placement,
            self._batch_dim_index, self._seq_len_dim_index, self._kv_tensor_format,
        )

    def _key(self) -> tuple[Any, ...]:
        return (self._num_tensors, tuple(int(d) for d in self._shape), self._data_type, self._placement)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheDesc) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, shape={list(self._shape)}, "
            f"data_type={self._data_type}, placement={self._placement})"
        )


def _parse_key_args(
    kind: str, args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...], defaults: dict[str, Any]
) -> tuple[dict[str, Any], str]:
    """Positional/keyword parsing shared by CacheKey and BlocksCacheKey (cluster_id may be prompt_cluster_id)."""
    require(len(args) + len(kwargs) <= len(names), f"{kind} takes at most {len(names)} params.")
    values: dict[str, Any] = dict(zip(names, args))
    cluster_kw = "cluster_id"
    for key, value in kwargs.items():
        name = key
        if key == "prompt_cluster_id":
            name = "cluster_id"
            cluster_kw = key
        require(name in names, f"{kind} got an unexpected param {key!r}.")
        require(name not in values, f"{kind} got multiple values for {name!r}.")
        values[name] = value
    require("cluster_id" in values, f"{kind} requires cluster_id (or prompt_cluster_id).")
    for name, default in defaults.items():
        values.setdefault(name, default)
    return values, cluster_kw


class CacheKey:
    """Key of one batch slot of a contiguous cache: ``(cluster_id, req_id, model_id=0, prefix_id=2**64-1)``.

    ``cluster_id`` names the owner (it only selects the link); the owner indexes ``(req_id|prefix_id, model_id)``.
    """

    __slots__ = ("_cluster_id", "_model_id", "_prefix_id", "_req_id")
    _cluster_id: int
    _req_id: int
    _model_id: int
    _prefix_id: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not kwargs and 2 <= len(args) <= 4 and set(map(type, args)) == INT_ONLY \
                and 0 <= min(args) and max(args) <= U64_MAX:  # the common call, checked at a fraction of the cost
            self._cluster_id, self._req_id = args[0], args[1]
            self._model_id = args[2] if len(args) > 2 else 0
            self._prefix_id = args[3] if len(args) > 3 else U64_MAX
            return
        names = ("cluster_id", "req_id", "model_id", "prefix_id")
        values, _ = _parse_key_args("CacheKey", args, kwargs, names, {"model_id": 0, "prefix_id": U64_MAX})
        require("req_id" in values, "CacheKey requires req_id.")
        self._cluster_id = check_int("cluster_id", values["cluster_id"], "uint64")
        self._req_id = check_int("req_id", values["req_id"], "uint64")
        self._model_id = check_int("model_id", values["model_id"], "uint64")
        self._prefix_id = check_int("prefix_id", values["prefix_id"], "uint64")

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        return self._cluster_id

    @property
    def req_id(self) -> int:
        return self._req_id

    @property
    def model_id(self) -> int:
        return self._model_id

    @property
    def prefix_id(self) -> int:
        return self._prefix_id

    @property
    def is_placeholder(self) -> bool:
        """True for the padding key of an unused slot (``req_id == 2**64-1`` and no prefix)."""
        return self._req_id == U64_MAX and self._prefix_id == U64_MAX

    def index_key(self) -> tuple[str, int, int]:
        """The owner-side index entry: by prefix when set, else by request (cluster_id is not part of it)."""
        if self._prefix_id != U64_MAX:
            return ("prefix", self._prefix_id, self._model_id)
        return ("req", self._req_id, self._model_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheKey) and self._tuple() == other._tuple()

    def __hash__(self) -> int:
        return hash(self._tuple())

    def _tuple(self) -> tuple[int, int, int, int]:
        return (self._cluster_id, self._req_id, self._model_id, self._prefix_id)

    def __repr__(self) -> str:
        return (
            f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
            f"model_id={self._model_id}, prefix_id={self._prefix_id})"
        )


class CacheKeyByIdAndIndex:
    """Address of a remote cache by its ``cache_id`` and a batch slot."""

    __slots__ = ("_batch_index", "_cache_id", "_cluster_id")

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        self._cluster_id = check_int("cluster_id", cluster_id, "uint64")
        self._cache_id = check_int("cache_id", cache_id, "int64")
        self._batch_index = check_int("batch_index", batch_index, "uint32")

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def batch_index(self) -> int:
        return self._batch_index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheKeyByIdAndIndex) and self._tuple() == other._tuple()

    def __hash__(self) -> int:
        return hash(self._tuple())

    def _tuple(self) -> tuple[int, int, int]:
        return (self._cluster_id, self._cache_id, self._batch_index)

    def __repr__(self) -> str:
        return (
            f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
            f"batch_index={self._batch_index})"
        )


class BlocksCacheKey:
    """Key of a paged (blocks) cache: ``(cluster_id, model_id=0)``; the owner indexes ``model_id`` only."""

    __slots__ = ("_cluster_id", "_cluster_kw", "_model_id")
    _cluster_id: int
    _model_id: int
    _cluster_kw: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not kwargs and 1 <= len(args) <= 2 and set(map(type, args)) == INT_ONLY:  # the common call
            self._cluster_id, self._model_id, self._cluster_kw = args[0], args[1] if len(args) > 1 else 0, "cluster_id"
            return
        values, self._cluster_kw = _parse_key_args(
            "BlocksCacheKey", args, kwargs, ("cluster_id", "model_id"), {"model_id": 0}
        )
        if not isinstance(values["cluster_id"], int):
            raise TypeError(f"The first param cluster_id only support ['int'], but got {type(values['cluster_id'])}.")
        if not isinstance(values["model_id"], int):
            raise TypeError(f"The second param model_id only support ['int'], but got {type(values['model_id'])}.")
        self._cluster_id = int(values["cluster_id"])
        self._model_id = int(values["model_id"])

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        return self._cluster_id

    @property
    def model_id(self) -> int:
        return self._model_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlocksCacheKey) and (self._cluster_id, self._model_id) == (
            other._cluster_id, other._model_id
        )

    def __hash__(self) -> int:
        return hash((self._cluster_id, self._model_id))

    def __repr__(self) -> str:
        return f"BlocksCacheKey({self._cluster_kw}={self._cluster_id}, model_id={self._model_id})"


def _ip_to_int(ip: str | int) -> int:
    if isinstance(ip, bool) or not isinstance(ip, (str, int)):
        raise TypeError(f"ip only support ['str', 'int'], but got {type(ip)}.")
    if isinstance(ip, int):
        return check_int("ip", ip, "uint32")
    try:
        return int.from_bytes(socket.inet_aton(ip), "little")
    except OSError as exc:
        raise LLMException(f"Can not parse ip str:{ip}", status_code=LLMStatusCode.LLM_PARAM_INVALID) from exc


def ip_int_to_str(ip: int) -> str:
    """Inverse of the reference's ``inet_aton`` + little-endian conversion."""
    return socket.inet_ntoa(int(ip).to_bytes(4, "little"))


class LLMClusterInfo:
    """Who to link to: ``remote_cluster_id`` plus local and remote ``(ip, port)`` entries."""

    __slots__ = ("_local_ip_info_list", "_remote_cluster_id", "_remote_ip_info_list", "_remote_role_type")

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: int = 0
        self._local_ip_info_list: list[tuple[int, int]] = []
        self._remote_ip_info_list: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        self._remote_cluster_id = check_int("remote_cluster_id", value, "uint64")

    @property
    def remote_role_type(self) -> int:
        """Accepted for compatibility; ignored, as in the reference."""
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: int) -> None:
        self._remote_role_type = check_int("remote_role_type", value, "int32")

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        return list(self._local_ip_info_list)

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        return list(self._remote_ip_info_list)

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Add this host's IP (dotted string or the reference's little-endian int) and a port."""
        self._local_ip_info_list.append((_ip_to_int(ip), check_int("port", port, "uint16")))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add the server's host IP and listen port."""
        self._remote_ip_info_list.append((_ip_to_int(ip), check_int("port", port, "uint16")))

    def __repr__(self) -> str:
        remote = [(ip_int_to_str(ip), port) for ip, port in self._remote_ip_info_list]
        return f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, remote_ip_info={remote})"


def cluster_info_for(remote_cluster_id: int, host: str, port: int, *,
                     local_ip: str | None = None) -> LLMClusterInfo:
    """An ``LLMClusterInfo`` for ``link_clusters``/``unlink_clusters``: cluster ``remote_cluster_id``, listening
    on ``host:port`` (the prompt's ``llm.listenIpInfo``, or its ``listen_address`` when it bound port 0).

    ``local_ip`` fills ``local_ip_info_list``, which LLM-DataDist requires and aiodatadist only checks for
    presence; it defaults to ``host``.  Invalid values raise as the ``LLMClusterInfo`` setters do
    (``TypeError``/``ValueError``)::

        code, codes = await decoder.link_clusters([cluster_info_for(1, "10.0.0.5", 26000)], timeout=3000)
    """
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster_id
    info.append_local_ip_info(local_ip if local_ip is not None else host, 0)
    info.append_remote_ip_info(host, port)
    return info
