"""aiodatadist.torch: dtype mapping, descriptions and registrations from tensors (and every refusal), zero-copy
views of host caches, torch tensors as block lists, and a bf16 transfer between two linked instances.

Skipped without torch (CI does not install it); ``import aiodatadist`` never imports torch
(tests/unit/package/test_imports.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers.ids import new_cluster_id
from helpers.internals import registry_of
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import aiodatadist.torch as adt
from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheManager,
    DataType,
    LLMConfig,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist import sync as adsync
from aiodatadist._checks import check_index_list
from aiodatadist.testing import linked_pair

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID

EXPECTED = {
    DataType.DT_FLOAT: torch.float32,
    DataType.DT_FLOAT16: torch.float16,
    DataType.DT_BF16: torch.bfloat16,
    DataType.DT_DOUBLE: torch.float64,
    DataType.DT_INT8: torch.int8,
    DataType.DT_INT16: torch.int16,
    DataType.DT_INT32: torch.int32,
    DataType.DT_INT64: torch.int64,
    DataType.DT_UINT8: torch.uint8,
    DataType.DT_UINT16: torch.uint16,
    DataType.DT_UINT32: torch.uint32,
    DataType.DT_UINT64: torch.uint64,
    DataType.DT_BOOL: torch.bool,
}


@contextlib.contextmanager
def param_invalid() -> Iterator[None]:
    with pytest.raises(LLMException) as info:
        yield
    assert info.value.status_code == PARAM_INVALID, info.value


# -- dtypes --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("data_type", list(EXPECTED))
def test_dtype_mapping_both_ways(data_type: DataType) -> None:
    dtype = adt.to_torch_dtype(data_type)
    assert dtype == EXPECTED[data_type]
    assert adt.from_torch_dtype(dtype) is data_type
    assert torch.empty(0, dtype=dtype).element_size() == data_type.itemsize


def test_bf16_is_bfloat16() -> None:
    assert adt.to_torch_dtype(DataType.DT_BF16) is torch.bfloat16
    assert adt.from_torch_dtype(torch.bfloat16) is DataType.DT_BF16
    assert adt.from_torch_dtype(torch.float16) is DataType.DT_FLOAT16  # not confused with bf16


def test_every_data_type_but_string_has_a_torch_dtype() -> None:
    assert set(EXPECTED) == set(DataType) - {DataType.DT_STRING}
    with param_invalid():
        adt.to_torch_dtype(DataType.DT_STRING)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.quint8])
def test_torch_dtypes_without_a_data_type(dtype: Any) -> None:
    with param_invalid():
        adt.from_torch_dtype(dtype)


def test_dtype_arguments_are_type_checked() -> None:
    with pytest.raises(TypeError):
        adt.to_torch_dtype(torch.float16)
    with pytest.raises(TypeError):
        adt.to_torch_dtype(1)
    with pytest.raises(TypeError):
        adt.from_torch_dtype(DataType.DT_FLOAT)
    with pytest.raises(TypeError):
        adt.from_torch_dtype("float16")


def test_placement_of_devices() -> None:
    assert adt.placement_of(torch.device("cpu")) is Placement.HOST
    assert adt.placement_of("cuda:1") is Placement.DEVICE
    with param_invalid():
        adt.placement_of(torch.device("meta"))


# -- descriptions --------------------------------------------------------------------------------------------------
def kv(n: int = 4, shape: tuple[int, ...] = (8, 4, 16), dtype: Any = torch.bfloat16) -> list[Any]:
    return [torch.zeros(shape, dtype=dtype) for _ in range(n)]


def test_cache_desc_from_tensors() -> None:
    desc = adt.cache_desc_from_tensors(kv(6, (8, 4, 16)))
    assert desc == CacheDesc(6, (8, 4, 16), DataType.DT_BF16, Placement.HOST)
    assert desc.size == 8 * 4 * 16 * 2
    desc = adt.cache_desc_from_tensors(tuple(kv(2, (3, 5), torch.float32)), batch_dim_index=1,
                                       seq_len_dim_index=0, kv_tensor_format="BSH")
    assert (desc.num_tensors, list(desc.shape), desc.data_type) == (2, [3, 5], DataType.DT_FLOAT)
    assert (desc.batch_dim, desc.seq_len_dim_index, desc.kv_tensor_format) == (1, 0, "BSH")
    # contiguous slices of a bigger buffer are fine
    pool = torch.zeros(2, 8, 4, 16, dtype=torch.float16)
    assert adt.cache_desc_from_tensors([pool[0], pool[1]]).num_tensors == 2


def refusals() -> list[tuple[str, Any, Any]]:
    base = torch.zeros(8, 4, 16, dtype=torch.bfloat16)
    return [
        ("not a list", base, TypeError),
        ("a generator", (t for t in kv()), TypeError),
        ("not tensors", [base, np.zeros((8, 4, 16))], TypeError),
        ("empty", [], PARAM_INVALID),
        ("non-contiguous", [base, torch.zeros(16, 4, 8, dtype=torch.bfloat16).transpose(0, 2)], PARAM_INVALID),
        ("strided slice", [torch.zeros(8, 8, 16, dtype=torch.bfloat16)[:, ::2]] * 2, PARAM_INVALID),
        ("shapes differ", [base, torch.zeros(8, 4, 8, dtype=torch.bfloat16)], PARAM_INVALID),
        ("dtypes differ", [base, torch.zeros(8, 4, 16, dtype=torch.float16)], PARAM_INVALID),
        ("devices differ", [base, torch.zeros(8, 4, 16, dtype=torch.bfloat16, device="meta")], PARAM_INVALID),
        ("meta device", [torch.zeros(4, device="meta")], PARAM_INVALID),
        ("0-d", [torch.tensor(1.0)], PARAM_INVALID),
        ("no element", [torch.zeros(0, 4)], PARAM_INVALID),
        ("complex", [torch.zeros(4, dtype=torch.complex64)], PARAM_INVALID),
        ("sparse", [torch.zeros(4, 4).to_sparse()], PARAM_INVALID),
    ]


@pytest.mark.parametrize(("case", "tensors", "error"), refusals(), ids=[c[0] for c in refusals()])
def test_cache_desc_refusals(case: str, tensors: Any, error: Any) -> None:
    if isinstance(error, LLMStatusCode):
        with param_invalid():
            adt.cache_desc_from_tensors(tensors)
    else:
        with pytest.raises(error):
            adt.cache_desc_from_tensors(tensors)


# -- registration --------------------------------------------------------------------------------------------------
def test_register_from_tensors(cache_manager: CacheManager) -> None:
    tensors = kv(4, (8, 4, 16))
    cache = adt.register_blocks_cache_from_tensors(cache_manager, tensors, BlocksCacheKey(1, 3))
    assert cache.is_blocks_cache
    assert cache.cache_desc == CacheDesc(4, (8, 4, 16), DataType.DT_BF16, Placement.HOST)
    assert cache.tensor_addrs == [t.data_ptr() for t in tensors]
    entry = registry_of(cache_manager).by_id(cache.cache_id)
    assert entry.remote_accessible and not entry.owned
    contiguous = adt.register_cache_from_tensors(cache_manager, kv(2, (4, 32), torch.float32),
                                                 [CacheKey(1, 10), CacheKey(1, 11)], remote_accessible=False)
    assert not contiguous.is_blocks_cache
    assert not registry_of(cache_manager).by_id(contiguous.cache_id).remote_accessible
    assert registry_of(cache_manager).resolve_wire("req", 11, 0)[1] == 1
    # another shape of the same bytes
    flat = adt.register_blocks_cache_from_tensors(
        cache_manager, kv(2, (8, 4, 16)), cache_desc=CacheDesc(2, [8, 64], DataType.DT_BF16, Placement.HOST))
    assert list(flat.cache_desc.shape) == [8, 64]


@pytest.mark.parametrize(("case", "tensors", "error"), refusals(), ids=[c[0] for c in refusals()])
def test_register_refusals(cache_manager: CacheManager, case: str, tensors: Any, error: Any) -> None:
    for register in (adt.register_cache_from_tensors, adt.register_blocks_cache_from_tensors):
        if isinstance(error, LLMStatusCode):
            with param_invalid():
                register(cache_manager, tensors)
        else:
            with pytest.raises(error):
                register(cache_manager, tensors)
    assert registry_of(cache_manager).entries() == []


def test_register_refuses_a_description_that_does_not_fit(cache_manager: CacheManager) -> None:
    tensors = kv(2, (8, 4, 16))
    bad = [
        CacheDesc(2, [8, 4, 8], DataType.DT_BF16, Placement.HOST),  # smaller than the tensors
        CacheDesc(2, [8, 4, 32], DataType.DT_BF16, Placement.HOST),  # larger: would run past them
        CacheDesc(3, [8, 4, 16], DataType.DT_BF16, Placement.HOST),  # tensor count
        CacheDesc(2, [8, 4, 16], DataType.DT_FLOAT16, Placement.HOST),  # data type
        CacheDesc(2, [8, 4, 16], DataType.DT_BF16, Placement.DEVICE),  # placement
    ]
    for desc in bad:
        for register in (adt.register_cache_from_tensors, adt.register_blocks_cache_from_tensors):
            with param_invalid():
                register(cache_manager, tensors, cache_desc=desc)
    with pytest.raises(TypeError):
        adt.register_cache_from_tensors(cache_manager, tensors, cache_desc=[2, 8])
    # the manager's own checks still apply
    with pytest.raises(TypeError):
        adt.register_cache_from_tensors(cache_manager, tensors, cache_keys=[1])
    with pytest.raises(TypeError):
        adt.register_blocks_cache_from_tensors(cache_manager, tensors, remote_accessible=1)
    assert registry_of(cache_manager).entries() == []


def test_register_with_the_blocking_api() -> None:
    dd = adsync.LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    dd.init(LLMConfig().generate_options())
    try:
        tensors = kv(2, (4, 8), torch.float16)
        cache = adt.register_blocks_cache_from_tensors(dd.cache_manager, tensors)
        assert cache.tensor_addrs == [t.data_ptr() for t in tensors]
        views = adt.tensors_of(cache)
        tensors[1][2, 3] = 7.5
        assert views[1][2, 3].item() == 7.5
        dd.cache_manager.unregister_cache(cache.cache_id)
    finally:
        dd.finalize()


# -- views ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("data_type", list(EXPECTED))
def test_views_of_an_allocated_cache_share_memory(cache_manager: CacheManager, data_type: DataType) -> None:
    desc = CacheDesc(3, [4, 6], data_type, Placement.HOST)
    cache = cache_manager.allocate_blocks_cache(desc)
    views = adt.tensors_of(cache)
    arrays = cache.tensors
    assert len(views) == 3
    for i, (view, array) in enumerate(zip(views, arrays)):
        assert view.dtype == EXPECTED[data_type]
        assert tuple(view.shape) == (4, 6)
        assert view.device.type == "cpu" and view.is_contiguous()
        assert view.data_ptr() == cache.tensor_addrs[i] == array.ctypes.data  # zero-copy
        # write through numpy, read through torch, and back
        raw = array.view(np.uint8).reshape(-1)
        raw[...] = (np.arange(raw.size) + i + 1).astype(np.uint8)
        assert bytes(view.view(torch.uint8).flatten().numpy()) == raw.tobytes()
        view.view(torch.uint8)[0, 0] = 0xAB
        assert raw[0] == 0xAB


def test_bf16_values_through_views(cache_manager: CacheManager) -> None:
    cache = cache_manager.allocate_cache(CacheDesc(2, [2, 8], DataType.DT_BF16, Placement.HOST))
    views = adt.tensors_of(cache)
    values = torch.linspace(-3, 3, 16, dtype=torch.bfloat16).reshape(2, 8)
    views[1].copy_(values)
    assert torch.equal(views[1], values)
    # numpy sees the same bf16 words (as uint16)
    assert np.array_equal(cache.tensors[1], values.view(torch.uint16).numpy())


def test_views_of_registered_tensors_are_the_tensors(cache_manager: CacheManager) -> None:
    tensors = [torch.randn(4, 8).to(torch.bfloat16) for _ in range(2)]
    cache = adt.register_cache_from_tensors(cache_manager, tensors)
    views = adt.tensors_of(cache)
    for view, tensor in zip(views, tensors):
        assert view.data_ptr() == tensor.data_ptr() and view.dtype == torch.bfloat16
        assert torch.equal(view, tensor)
    tensors[0][1, 1] = 42.0
    assert views[0][1, 1].item() == 42.0


def test_views_of_released_or_bad_caches(cache_manager: CacheManager) -> None:
    cache = cache_manager.allocate_cache(CacheDesc(1, [2, 8], DataType.DT_BF16, Placement.HOST))
    cache_manager.deallocate_cache(cache)
    with pytest.raises(LLMException) as info:
        adt.tensors_of(cache)
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    with pytest.raises(TypeError):
        adt.tensors_of(torch.zeros(2))


# -- torch tensors as block lists ----------------------------------------------------------------------------------
INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.uint16, torch.uint32, torch.uint64]


@given(st.lists(st.integers(0, 255), max_size=40), st.sampled_from(INT_DTYPES))
def test_tensor_block_lists_mean_the_list(xs: list[int], dtype: Any) -> None:
    tensor = torch.tensor(xs, dtype=dtype) if xs else torch.empty(0, dtype=dtype)
    assert check_index_list("dst_blocks", tensor, "uint64") == xs
    assert check_index_list("dst_blocks", tensor[::2], "uint64") == xs[::2]  # a non-contiguous view


@pytest.mark.parametrize("value", [
    torch.tensor([True, False]),
    torch.tensor([1.0, 2.0]),
    torch.tensor([1.0], dtype=torch.bfloat16),
    torch.tensor([[1, 2]]),
    torch.tensor(3),
])
def test_tensor_block_lists_refused(value: Any) -> None:
    with pytest.raises(TypeError):
        check_index_list("dst_blocks", value, "uint64")


def test_negative_tensor_block_lists_refused() -> None:
    with pytest.raises(ValueError):
        check_index_list("dst_blocks", torch.tensor([1, -1]), "uint64")


# -- a real transfer -----------------------------------------------------------------------------------------------
async def test_bf16_tensor_transfer_between_linked_instances() -> None:
    layers, blocks, block_tokens, heads, head_dim = 3, 16, 4, 2, 8
    shape = (blocks, block_tokens, heads, head_dim)
    gen = torch.Generator().manual_seed(1234)
    src = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2 * layers)]
    for t in src:  # random bits as well, so that every bf16 word (NaNs included) must arrive as it was
        t.view(torch.int16)[::3] = torch.randint(-(2**15), 2**15, t[::3].shape, generator=gen,
                                                 dtype=torch.int16)
    dst = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2 * layers)]
    prompt_id, decoder_id = new_cluster_id(), new_cluster_id()
    async with linked_pair(prompt_id, decoder_id) as (prompt, decoder):
        owner = adt.register_blocks_cache_from_tensors(prompt.cache_manager, src, BlocksCacheKey(prompt_id, 0))
        local = adt.register_blocks_cache_from_tensors(decoder.cache_manager, dst)
        src_blocks = torch.tensor([5, 0, 9, 10, 11])
        dst_blocks = np.array([1, 2, 3, 4, 5], dtype=np.int64)
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(prompt_id, 0), local, src_blocks, dst_blocks)
        for s, d in zip(src, dst):
            got = d.view(torch.int16)
            want = s.view(torch.int16)
            assert torch.equal(got[1:6], want[[5, 0, 9, 10, 11]])
            assert not got[0].any() and not got[6:].any()
        # the other way: the prompt pulls decoder blocks (a range and a tensor as block lists)
        for t in dst:
            t.view(torch.int16)[12:14] = torch.randint(-(2**15), 2**15, t[12:14].shape, generator=gen,
                                                       dtype=torch.int16)
        remote = adt.register_blocks_cache_from_tensors(decoder.cache_manager, dst, BlocksCacheKey(decoder_id, 0))
        await prompt.cache_manager.pull_blocks(BlocksCacheKey(decoder_id, 0), owner, range(12, 14),
                                               torch.tensor([14, 15]))
        for s, d in zip(src, dst):
            assert torch.equal(s.view(torch.int16)[14:16], d.view(torch.int16)[12:14])
        # views of both registrations are the tensors, byte for byte
        for view, tensor in zip(adt.tensors_of(remote), dst):
            assert torch.equal(view.view(torch.int16), tensor.view(torch.int16))
