"""Enums and value types, as in LLM-DataDist."""

from __future__ import annotations

import socket
from enum import Enum, IntEnum
from typing import Any

import numpy as np
import pytest
from helpers.examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)

U64 = 2**64 - 1
PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID


def assert_param_invalid(info: pytest.ExceptionInfo[LLMException]) -> None:
    assert info.value.status_code is PARAM_INVALID


# --------------------------------------------------------------------------------------------------------------
# Enums
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "value"), [("PROMPT", 1), ("DECODER", 2), ("MIX", 3)])
def test_llm_role(name: str, value: int) -> None:
    member = LLMRole[name]
    assert int(member) == value
    assert LLMRole(value) is member
    assert str(member) == f"LLMRole.{name}"


def test_llm_role_members() -> None:
    assert issubclass(LLMRole, IntEnum)
    assert [m.name for m in LLMRole] == ["PROMPT", "DECODER", "MIX"]


@pytest.mark.parametrize(("name", "value"), [("HOST", 0), ("DEVICE", 1)])
def test_placement(name: str, value: int) -> None:
    member = Placement[name]
    assert int(member) == value
    assert Placement(value) is member
    assert str(member) == f"Placement.{name}"


def test_placement_members() -> None:
    assert issubclass(Placement, IntEnum)
    assert [m.name for m in Placement] == ["HOST", "DEVICE"]


# name, GE value, itemsize, numpy dtype
DTYPES: list[tuple[str, int, int, Any]] = [
    ("DT_FLOAT", 0, 4, np.float32),
    ("DT_FLOAT16", 1, 2, np.float16),
    ("DT_INT8", 2, 1, np.int8),
    ("DT_INT32", 3, 4, np.int32),
    ("DT_UINT8", 4, 1, np.uint8),
    ("DT_INT16", 6, 2, np.int16),
    ("DT_UINT16", 7, 2, np.uint16),
    ("DT_UINT32", 8, 4, np.uint32),
    ("DT_INT64", 9, 8, np.int64),
    ("DT_UINT64", 10, 8, np.uint64),
    ("DT_DOUBLE", 11, 8, np.float64),
    ("DT_BOOL", 12, 1, np.bool_),
    ("DT_BF16", 27, 2, np.uint16),
]


def test_data_type_is_plain_enum() -> None:
    assert issubclass(DataType, Enum)
    assert not issubclass(DataType, int)
    zero: object = 0
    assert DataType.DT_FLOAT != zero  # plain Enum members do not compare equal to ints


def test_data_type_member_set() -> None:
    assert {m.name: m.value for m in DataType} == {**{n: v for n, v, _, _ in DTYPES}, "DT_STRING": 13}


@pytest.mark.parametrize(("name", "value", "itemsize", "np_dtype"), DTYPES)
def test_data_type_values_and_sizes(name: str, value: int, itemsize: int, np_dtype: Any) -> None:
    member = DataType[name]
    assert member.value == value
    assert DataType(value) is member
    assert str(member) == f"DataType.{name}"
    assert member.itemsize == itemsize
    assert member.np_dtype == np.dtype(np_dtype)
    assert isinstance(member.np_dtype, np.dtype)
    assert member.np_dtype.itemsize == itemsize


def test_bf16_is_raw_uint16_words() -> None:
    assert DataType.DT_BF16.np_dtype == np.dtype(np.uint16)
    assert DataType.DT_BF16.itemsize == 2


def test_data_type_string() -> None:
    assert DataType.DT_STRING.value == 13
    assert str(DataType.DT_STRING) == "DataType.DT_STRING"
    with pytest.raises(LLMException) as info:
        _ = DataType.DT_STRING.itemsize
    assert_param_invalid(info)
    with pytest.raises(LLMException) as info:
        _ = DataType.DT_STRING.np_dtype
    assert_param_invalid(info)


# --------------------------------------------------------------------------------------------------------------
# CacheDesc
# --------------------------------------------------------------------------------------------------------------


def test_cache_desc_defaults() -> None:
    shape = [4, 16, 8]
    desc = CacheDesc(2, shape, DataType.DT_FLOAT16)
    assert desc.num_tensors == 2
    assert desc.shape is shape
    assert desc.data_type is DataType.DT_FLOAT16
    assert desc.placement is Placement.DEVICE
    assert desc.batch_dim == 0
    assert desc.batch_size == 4
    assert desc.seq_len_dim_index == -1
    assert desc.kv_tensor_format is None
    assert desc.size == 4 * 16 * 8 * 2


def test_cache_desc_all_arguments_keyword() -> None:
    shape = (3, 5, 7)
    desc = CacheDesc(
        num_tensors=4,
        shape=shape,
        data_type=DataType.DT_INT32,
        placement=Placement.HOST,
        batch_dim_index=1,
        seq_len_dim_index=2,
        kv_tensor_format="BSH",
    )
    assert desc.num_tensors == 4
    assert desc.shape is shape
    assert desc.placement is Placement.HOST
    assert desc.batch_dim == 1
    assert desc.batch_size == 5
    assert desc.seq_len_dim_index == 2
    assert desc.kv_tensor_format == "BSH"
    assert desc.size == 3 * 5 * 7 * 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_tensors": 0, "shape": [1], "data_type": DataType.DT_FLOAT},  # num_tensors > 0 is checked later
        {"num_tensors": 2**32 - 1, "shape": [1], "data_type": DataType.DT_FLOAT},
        {"num_tensors": True, "shape": [1], "data_type": DataType.DT_FLOAT},  # bool is an int
        {"num_tensors": 1, "shape": (2,), "data_type": DataType.DT_FLOAT},
        {"num_tensors": 1, "shape": [2**63 - 1, -(2**63)], "data_type": DataType.DT_FLOAT},
        {"num_tensors": 1, "shape": [0, 0], "data_type": DataType.DT_STRING},
        {"num_tensors": 1, "shape": [2, 3], "data_type": DataType.DT_BF16, "placement": Placement.HOST},
        {"num_tensors": 1, "shape": [2, 3], "data_type": DataType.DT_FLOAT, "batch_dim_index": 1},
        {"num_tensors": 1, "shape": [2, 3], "data_type": DataType.DT_FLOAT, "seq_len_dim_index": 0},
        {"num_tensors": 1, "shape": [2, 3], "data_type": DataType.DT_FLOAT, "seq_len_dim_index": 1},
        {"num_tensors": 1, "shape": [2, 3], "data_type": DataType.DT_FLOAT, "kv_tensor_format": ""},
        {"num_tensors": 1, "shape": [2, 3], "data_type": DataType.DT_FLOAT, "kv_tensor_format": None},
    ],
)
def test_cache_desc_accepted(kwargs: dict[str, Any]) -> None:
    desc = CacheDesc(**kwargs)
    assert desc.num_tensors == kwargs["num_tensors"]
    assert desc.shape is kwargs["shape"]
    assert desc.data_type is kwargs["data_type"]


BASE_ARGS: dict[str, Any] = {"num_tensors": 2, "shape": [4, 8], "data_type": DataType.DT_FLOAT}


@pytest.mark.parametrize(
    ("override", "exc"),
    [
        ({"num_tensors": -1}, ValueError),
        ({"num_tensors": 2**32}, ValueError),
        ({"num_tensors": "1"}, TypeError),
        ({"num_tensors": 1.0}, TypeError),
        ({"num_tensors": None}, TypeError),
        ({"shape": "48"}, TypeError),
        ({"shape": 4}, TypeError),
        ({"shape": {4: 8}}, TypeError),
        ({"shape": None}, TypeError),
        ({"shape": [4, "8"]}, TypeError),
        ({"shape": [4, 8.0]}, TypeError),
        ({"shape": [4, None]}, TypeError),
        ({"shape": [4, 2**63]}, ValueError),
        ({"shape": [-(2**63) - 1]}, ValueError),
        ({"data_type": 0}, TypeError),
        ({"data_type": "DT_FLOAT"}, TypeError),
        ({"data_type": np.float32}, TypeError),
        ({"placement": 0}, TypeError),
        ({"placement": "HOST"}, TypeError),
        ({"batch_dim_index": "0"}, TypeError),
        ({"batch_dim_index": 0.0}, TypeError),
        ({"seq_len_dim_index": "1"}, TypeError),
        ({"seq_len_dim_index": 2**31}, ValueError),
        ({"seq_len_dim_index": -(2**31) - 1}, ValueError),
        ({"kv_tensor_format": 1}, TypeError),
        ({"kv_tensor_format": b"BSH"}, TypeError),
    ],
)
def test_cache_desc_refused_type_value(override: dict[str, Any], exc: type[Exception]) -> None:
    with pytest.raises(exc):
        CacheDesc(**{**BASE_ARGS, **override})


def test_cache_desc_type_error_message() -> None:
    with pytest.raises(TypeError, match=r"^num_tensors only support \['int'\], but got <class 'str'>\.$"):
        CacheDesc("1", [1], DataType.DT_FLOAT)  # type: ignore[arg-type]


def test_cache_desc_value_error_message() -> None:
    with pytest.raises(ValueError, match=r"^num_tensors's value is out of range,-1 is not a uint32 value\.$"):
        CacheDesc(-1, [1], DataType.DT_FLOAT)


@pytest.mark.parametrize(
    ("shape", "batch_dim_index"),
    [([4, 8], 2), ([4, 8], 5), ([4, 8], -1), ([4], 1), ([], 0)],
)
def test_cache_desc_batch_dim_outside_shape(shape: list[int], batch_dim_index: int) -> None:
    with pytest.raises(LLMException) as info:
        CacheDesc(1, shape, DataType.DT_FLOAT, batch_dim_index=batch_dim_index)
    assert_param_invalid(info)


@pytest.mark.parametrize(
    ("shape", "seq_len_dim_index"), [([4, 8], 2), ([4, 8], -2), ([4, 8, 2], 3), ([4], 7)]
)
def test_cache_desc_seq_len_dim_outside_shape(shape: list[int], seq_len_dim_index: int) -> None:
    with pytest.raises(LLMException) as info:
        CacheDesc(1, shape, DataType.DT_FLOAT, seq_len_dim_index=seq_len_dim_index)
    assert_param_invalid(info)


@pytest.mark.parametrize(("name", "value", "itemsize", "np_dtype"), DTYPES)
def test_cache_desc_size_per_dtype(name: str, value: int, itemsize: int, np_dtype: Any) -> None:
    desc = CacheDesc(3, [2, 5, 7], DataType[name], Placement.HOST)
    assert desc.size == 2 * 5 * 7 * itemsize  # bytes of ONE tensor, not of all num_tensors


@pytest.mark.parametrize(("shape", "size"), [([0, 8], 0), ([1], 4), ([3, 1, 1, 1], 12), ((2, 3), 24)])
def test_cache_desc_size(shape: Any, size: int) -> None:
    assert CacheDesc(1, shape, DataType.DT_FLOAT).size == size


def test_cache_desc_size_negative_dim_refused() -> None:
    desc = CacheDesc(1, [-1, 8], DataType.DT_FLOAT)
    with pytest.raises(LLMException) as info:
        _ = desc.size
    assert_param_invalid(info)


def test_cache_desc_size_string_refused() -> None:
    desc = CacheDesc(1, [2, 8], DataType.DT_STRING)
    with pytest.raises(LLMException) as info:
        _ = desc.size
    assert_param_invalid(info)


def test_cache_desc_update_dim_list_in_place_resets_size() -> None:
    shape = [4, 8]
    desc = CacheDesc(2, shape, DataType.DT_FLOAT16)
    assert desc.size == 64
    desc.update_dim(1, 16)
    assert shape == [4, 16]
    assert desc.shape is shape
    assert desc.size == 128
    desc.update_dim(0, 1)
    assert desc.batch_size == 1
    assert desc.size == 32


def test_cache_desc_update_dim_tuple_resets_size() -> None:
    desc = CacheDesc(1, (4, 8), DataType.DT_INT8)
    assert desc.size == 32
    desc.update_dim(0, 2)
    assert list(desc.shape) == [2, 8]
    assert desc.batch_size == 2
    assert desc.size == 16


@pytest.mark.parametrize(
    ("dim_index", "dim_value", "exc"),
    [
        ("0", 1, TypeError),
        (0, "1", TypeError),
        (0, 2**63, ValueError),
        (2, 1, LLMException),
        (-1, 1, LLMException),
    ],
)
def test_cache_desc_update_dim_refused(dim_index: Any, dim_value: Any, exc: type[Exception]) -> None:
    shape = [4, 8]
    desc = CacheDesc(1, shape, DataType.DT_FLOAT)
    with pytest.raises(exc):
        desc.update_dim(dim_index, dim_value)
    assert shape == [4, 8]
    assert desc.size == 128


def test_cache_desc_equality_and_hash() -> None:
    a = CacheDesc(2, [4, 8], DataType.DT_FLOAT, Placement.HOST)
    b = CacheDesc(2, (4, 8), DataType.DT_FLOAT, Placement.HOST)
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != CacheDesc(3, [4, 8], DataType.DT_FLOAT, Placement.HOST)
    assert a != CacheDesc(2, [4, 9], DataType.DT_FLOAT, Placement.HOST)
    assert a != CacheDesc(2, [4, 8], DataType.DT_INT32, Placement.HOST)
    assert a != CacheDesc(2, [4, 8], DataType.DT_FLOAT, Placement.DEVICE)
    assert a != "CacheDesc"


# --------------------------------------------------------------------------------------------------------------
# CacheKey
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((1, 2), {}, (1, 2, 0, U64)),
        ((1, 2, 3), {}, (1, 2, 3, U64)),
        ((1, 2, 3, 4), {}, (1, 2, 3, 4)),
        ((), {"prompt_cluster_id": 1, "req_id": 2}, (1, 2, 0, U64)),
        ((), {"cluster_id": 1, "req_id": 2}, (1, 2, 0, U64)),
        ((), {"cluster_id": 1, "req_id": 2, "model_id": 3, "prefix_id": 4}, (1, 2, 3, 4)),
        ((), {"prefix_id": 4, "model_id": 3, "req_id": 2, "prompt_cluster_id": 1}, (1, 2, 3, 4)),
        ((1,), {"req_id": 2}, (1, 2, 0, U64)),
        ((1, 2), {"prefix_id": 9}, (1, 2, 0, 9)),
        ((0, U64, U64, U64), {}, (0, U64, U64, U64)),
        ((True, False), {}, (1, 0, 0, U64)),  # bool passes the uint64 check
    ],
)
def test_cache_key_forms(args: tuple[Any, ...], kwargs: dict[str, Any], expected: tuple[int, ...]) -> None:
    key = CacheKey(*args, **kwargs)
    assert (key.cluster_id, key.req_id, key.model_id, key.prefix_id) == expected
    assert key.prompt_cluster_id == key.cluster_id


def test_cache_key_defaults() -> None:
    key = CacheKey(7, 8)
    assert key.model_id == 0
    assert key.prefix_id == 2**64 - 1


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1, 2, 3, 4, 5), {}),
        ((1, 2, 3, 4), {"model_id": 5}),
        ((1, 2), {"foo": 3}),
        ((), {"cluster_id": 1, "request_id": 2}),
        ((1,), {}),
        ((), {"cluster_id": 1}),
        ((), {"prompt_cluster_id": 1, "model_id": 0}),
        ((), {"req_id": 2}),
        ((), {}),
        ((), {"req_id": 2, "model_id": 0, "prefix_id": 1}),
    ],
)
def test_cache_key_refused_param_invalid(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    with pytest.raises(LLMException) as info:
        CacheKey(*args, **kwargs)
    assert_param_invalid(info)


@pytest.mark.parametrize("position", range(4))
@pytest.mark.parametrize(
    ("bad", "exc"),
    [(-1, ValueError), (2**64, ValueError), ("1", TypeError), (1.0, TypeError), (None, TypeError)],
)
def test_cache_key_uint64_checks(position: int, bad: Any, exc: type[Exception]) -> None:
    args: list[Any] = [1, 2, 3, 4]
    args[position] = bad
    with pytest.raises(exc):
        CacheKey(*args)


@pytest.mark.parametrize("name", ["prompt_cluster_id", "cluster_id", "req_id", "model_id", "prefix_id"])
@pytest.mark.parametrize(("bad", "exc"), [(-1, ValueError), (2**64, ValueError), ("x", TypeError)])
def test_cache_key_uint64_checks_keyword(name: str, bad: Any, exc: type[Exception]) -> None:
    kwargs: dict[str, Any] = {"req_id": 2}
    if name not in ("prompt_cluster_id", "cluster_id"):
        kwargs["cluster_id"] = 1
    kwargs[name] = bad
    with pytest.raises(exc):
        CacheKey(**kwargs)


def test_cache_key_value_error_message() -> None:
    with pytest.raises(ValueError, match=r"^req_id's value is out of range,-1 is not a uint64 value\.$"):
        CacheKey(1, -1)


_KEY_FIELD = st.one_of(st.integers(-2, 3), st.integers(2**64 - 2, 2**64 + 1), st.booleans(),
                       st.integers(0, 9).map(np.int64), st.just(1.0), st.none())


def _outcome(make: Any) -> Any:
    try:
        key = make()
    except Exception as exc:  # noqa: BLE001 - the outcome compared is the exception's type
        return type(exc)
    return (key.cluster_id, getattr(key, "req_id", None), key.model_id, getattr(key, "prefix_id", None))


@settings(max_examples=300, deadline=None)
@given(st.lists(_KEY_FIELD, min_size=0, max_size=5))
def test_key_positional_forms_match_keyword_forms(values: list[Any]) -> None:
    """The positional forms (checked on a shorter path for plain ints) accept, refuse and store exactly as the
    keyword forms do."""
    names = ("cluster_id", "req_id", "model_id", "prefix_id")
    positional = _outcome(lambda: CacheKey(*values))
    if len(values) <= 4:
        assert positional == _outcome(lambda: CacheKey(**dict(zip(names, values))))
    else:
        assert positional is LLMException
    positional = _outcome(lambda: BlocksCacheKey(*values))
    if len(values) <= 2:
        assert positional == _outcome(lambda: BlocksCacheKey(**dict(zip(("cluster_id", "model_id"), values))))
    else:
        assert positional is LLMException


def test_cache_key_equality_and_hash() -> None:
    a = CacheKey(1, 2)
    b = CacheKey(prompt_cluster_id=1, req_id=2, model_id=0, prefix_id=U64)
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != CacheKey(2, 2)
    assert a != CacheKey(1, 3)
    assert a != CacheKey(1, 2, 1)
    assert a != CacheKey(1, 2, 0, 5)
    assert a != (1, 2, 0, U64)
    assert {a: "v"}[CacheKey(cluster_id=1, req_id=2)] == "v"


# --------------------------------------------------------------------------------------------------------------
# CacheKeyByIdAndIndex
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((1, 2), (1, 2, 0)),
        ((1, 2, 3), (1, 2, 3)),
        ((0, -1, 0), (0, -1, 0)),
        ((U64, 2**63 - 1, 2**32 - 1), (U64, 2**63 - 1, 2**32 - 1)),
        ((0, -(2**63), 0), (0, -(2**63), 0)),
    ],
)
def test_cache_key_by_id_accepted(args: tuple[int, ...], expected: tuple[int, int, int]) -> None:
    key = CacheKeyByIdAndIndex(*args)
    assert (key.cluster_id, key.cache_id, key.batch_index) == expected


def test_cache_key_by_id_keywords() -> None:
    key = CacheKeyByIdAndIndex(cluster_id=5, cache_id=6, batch_index=7)
    assert (key.cluster_id, key.cache_id, key.batch_index) == (5, 6, 7)


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        ((-1, 1), ValueError),
        ((2**64, 1), ValueError),
        (("1", 1), TypeError),
        ((None, 1), TypeError),
        ((1, 2**63), ValueError),
        ((1, -(2**63) - 1), ValueError),
        ((1, "1"), TypeError),
        ((1, 1.5), TypeError),
        ((1, 1, -1), ValueError),
        ((1, 1, 2**32), ValueError),
        ((1, 1, "0"), TypeError),
        ((1, 1, None), TypeError),
    ],
)
def test_cache_key_by_id_refused(args: tuple[Any, ...], exc: type[Exception]) -> None:
    with pytest.raises(exc):
        CacheKeyByIdAndIndex(*args)


def test_cache_key_by_id_messages() -> None:
    with pytest.raises(TypeError, match=r"^cluster_id only support \['int'\], but got <class 'str'>\.$"):
        CacheKeyByIdAndIndex("a", 1)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"^batch_index's value is out of range,4294967296 is not a uint32 value\.$"
    ):
        CacheKeyByIdAndIndex(1, 1, 2**32)


def test_cache_key_by_id_equality_and_hash() -> None:
    a = CacheKeyByIdAndIndex(1, 2)
    b = CacheKeyByIdAndIndex(1, 2, 0)
    assert a == b
    assert hash(a) == hash(b)
    assert a != CacheKeyByIdAndIndex(1, 2, 1)
    assert a != CacheKeyByIdAndIndex(1, 3)
    assert a != CacheKeyByIdAndIndex(2, 2)
    assert a != CacheKey(1, 2)


# --------------------------------------------------------------------------------------------------------------
# BlocksCacheKey
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((1,), {}, (1, 0)),
        ((1, 2), {}, (1, 2)),
        ((), {"cluster_id": 1}, (1, 0)),
        ((), {"prompt_cluster_id": 1}, (1, 0)),
        ((), {"prompt_cluster_id": 1, "model_id": 2}, (1, 2)),
        ((), {"model_id": 2, "cluster_id": 1}, (1, 2)),
        ((1,), {"model_id": 2}, (1, 2)),
        ((-1, 2**70), {}, (-1, 2**70)),  # no range check
    ],
)
def test_blocks_cache_key_forms(
    args: tuple[Any, ...], kwargs: dict[str, Any], expected: tuple[int, int]
) -> None:
    key = BlocksCacheKey(*args, **kwargs)
    assert (key.cluster_id, key.model_id) == expected
    assert key.prompt_cluster_id == key.cluster_id


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1, 2, 3), {}),
        ((1, 2), {"model_id": 3}),
        ((1,), {"foo": 1}),
        ((), {"cluster_id": 1, "req_id": 1}),
        ((), {"model_id": 1}),
        ((), {}),
    ],
)
def test_blocks_cache_key_refused_param_invalid(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    with pytest.raises(LLMException) as info:
        BlocksCacheKey(*args, **kwargs)
    assert_param_invalid(info)


@pytest.mark.parametrize(
    ("args", "kwargs", "prefix"),
    [
        (("1",), {}, "The first param"),
        ((1.0,), {}, "The first param"),
        ((), {"cluster_id": None}, "The first param"),
        ((), {"prompt_cluster_id": "1"}, "The first param"),
        ((1, "2"), {}, "The second param"),
        ((1, 2.0), {}, "The second param"),
        ((), {"cluster_id": 1, "model_id": None}, "The second param"),
    ],
)
def test_blocks_cache_key_type_errors(args: tuple[Any, ...], kwargs: dict[str, Any], prefix: str) -> None:
    with pytest.raises(TypeError, match=f"^{prefix}"):
        BlocksCacheKey(*args, **kwargs)


@pytest.mark.parametrize("kw", ["cluster_id", "prompt_cluster_id"])
def test_blocks_cache_key_repr_echoes_keyword(kw: str) -> None:
    text = repr(BlocksCacheKey(**{kw: 11}, model_id=3))
    assert f"{kw}=11" in text
    assert "model_id=3" in text
    if kw == "cluster_id":
        assert "prompt_cluster_id" not in text


def test_blocks_cache_key_equality_and_hash() -> None:
    a = BlocksCacheKey(1)
    b = BlocksCacheKey(prompt_cluster_id=1, model_id=0)
    assert a == b
    assert hash(a) == hash(b)
    assert a != BlocksCacheKey(1, 1)
    assert a != BlocksCacheKey(2)


# --------------------------------------------------------------------------------------------------------------
# LLMClusterInfo
# --------------------------------------------------------------------------------------------------------------


def test_cluster_info_initial_state() -> None:
    info = LLMClusterInfo()
    assert info.remote_cluster_id is None
    assert info.local_ip_info_list == []
    assert info.remote_ip_info_list == []


@pytest.mark.parametrize("value", [0, 1, U64, True])
def test_cluster_info_remote_cluster_id_accepted(value: int) -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = value
    assert info.remote_cluster_id == value


@pytest.mark.parametrize(
    ("value", "exc"),
    [(-1, ValueError), (2**64, ValueError), ("1", TypeError), (1.0, TypeError), (None, TypeError)],
)
def test_cluster_info_remote_cluster_id_refused(value: Any, exc: type[Exception]) -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = 5
    with pytest.raises(exc):
        info.remote_cluster_id = value
    assert info.remote_cluster_id == 5


@pytest.mark.parametrize(
    ("ip", "expected"),
    [
        ("1.2.3.4", 0x04030201),
        ("127.0.0.1", 0x0100007F),
        ("0.0.0.0", 0),
        ("255.255.255.255", 0xFFFFFFFF),
        ("192.168.1.10", 0x0A01A8C0),
        (0x04030201, 0x04030201),
        (0, 0),
        (2**32 - 1, 2**32 - 1),
    ],
)
def test_cluster_info_append_ip(ip: Any, expected: int) -> None:
    info = LLMClusterInfo()
    info.append_local_ip_info(ip, 26000)
    assert info.local_ip_info_list == [(expected, 26000)]
    assert info.remote_ip_info_list == []
    info = LLMClusterInfo()
    info.append_remote_ip_info(ip, 26001)
    assert info.remote_ip_info_list == [(expected, 26001)]
    assert info.local_ip_info_list == []


def test_cluster_info_append_keeps_order() -> None:
    info = LLMClusterInfo()
    info.append_remote_ip_info("1.2.3.4", 1)
    info.append_remote_ip_info("5.6.7.8", 2)
    info.append_local_ip_info("10.0.0.1", 0)
    assert info.remote_ip_info_list == [(0x04030201, 1), (0x08070605, 2)]
    assert info.local_ip_info_list == [(0x0100000A, 0)]


@settings(max_examples=examples(50), deadline=None)
@given(st.ip_addresses(v=4))
def test_cluster_info_ip_is_little_endian_inet_aton(addr: Any) -> None:
    info = LLMClusterInfo()
    info.append_remote_ip_info(str(addr), 80)
    value = info.remote_ip_info_list[0][0]
    assert value == int.from_bytes(socket.inet_aton(str(addr)), "little")
    assert socket.inet_ntoa(value.to_bytes(4, "little")) == str(addr)


@pytest.mark.parametrize("ip", ["abc", "1.2.3.256", "999.1.1.1", "", "::1", "1.2.3.4.5", "localhost"])
def test_cluster_info_bad_ip_string(ip: str) -> None:
    info = LLMClusterInfo()
    for side in ("local", "remote"):
        with pytest.raises(LLMException, match="Can not parse ip str") as exc:
            getattr(info, f"append_{side}_ip_info")(ip, 80)
        assert isinstance(exc.value, RuntimeError)
        assert exc.value.status_code is PARAM_INVALID
        assert getattr(info, f"{side}_ip_info_list") == []


@pytest.mark.parametrize(
    ("ip", "port", "exc"),
    [
        ("1.2.3.4", 70000, ValueError),
        ("1.2.3.4", 65536, ValueError),
        ("1.2.3.4", -1, ValueError),
        ("1.2.3.4", "80", TypeError),
        ("1.2.3.4", 80.0, TypeError),
        ("1.2.3.4", None, TypeError),
        (1.5, 80, TypeError),
        (None, 80, TypeError),
        (b"1.2.3.4", 80, TypeError),
        (-1, 80, ValueError),
        (2**32, 80, ValueError),
    ],
)
def test_cluster_info_append_refused(ip: Any, port: Any, exc: type[Exception]) -> None:
    info = LLMClusterInfo()
    for side in ("local", "remote"):
        with pytest.raises(exc):
            getattr(info, f"append_{side}_ip_info")(ip, port)
        assert getattr(info, f"{side}_ip_info_list") == []


@pytest.mark.parametrize("port", [0, 1, 26000, 65535])
def test_cluster_info_port_range(port: int) -> None:
    info = LLMClusterInfo()
    info.append_local_ip_info("1.2.3.4", port)
    assert info.local_ip_info_list == [(0x04030201, port)]


@pytest.mark.parametrize("attr", ["local_ip_info_list", "remote_ip_info_list"])
def test_cluster_info_lists_read_only(attr: str) -> None:
    info = LLMClusterInfo()
    with pytest.raises(AttributeError):
        setattr(info, attr, [(1, 2)])
    assert getattr(info, attr) == []
