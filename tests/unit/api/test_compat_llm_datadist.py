"""``aiodatadist.compat.llm_datadist``: the public names of LLM-DataDist's module and the signatures of its
methods, blocking (``aiodatadist.sync``)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from aiodatadist import sync
from aiodatadist.compat import llm_datadist

# The reference module's __all__ (TensorDesc, Tensor, KvCache and KvCacheManager belong to the legacy V1 mode).
REFERENCE_ALL = {
    "LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig", "DataType", "Status",
    "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache", "BlocksCacheKey", "LLMDataDist",
    "Placement", "RegisterMemStatus", "LayerSynchronizer", "TransferConfig", "CacheTask",
    "TransferWithCacheKeyConfig", "Memtype", "MemInfo", "TensorDesc", "Tensor", "KvCacheManager",
}
V1 = {"KvCache", "TensorDesc", "Tensor", "KvCacheManager"}

# LLMDataDist and CacheManager: parameter names and defaults, in order ("*" marks **kwargs).
LLMDATADIST = {
    "__init__": [("role", None), ("cluster_id", None)],
    "init": [("options", None)],
    "finalize": [],
    "link_clusters": [("clusters", None), ("timeout", 3000)],
    "unlink_clusters": [("clusters", None), ("timeout", 3000), ("force", False)],
    "switch_role": [("role", None), ("switch_options", None)],
    "link": [("comm_name", None), ("cluster_rank_info", None), ("rank_table", None)],
    "unlink": [("comm_id", None)],
    "query_register_mem_status": [("comm_id", None)],
    "check_link_status": [("remote_cluster_id", None)],
}
CACHE_MANAGER = {
    "allocate_cache": [("cache_desc", None), ("cache_keys", ())],
    "allocate_blocks_cache": [("cache_desc", None), ("blocks_cache_key", None)],
    "register_cache": [("cache_desc", None), ("addrs", None), ("cache_keys", ()), ("remote_accessible", None)],
    "register_blocks_cache": [("cache_desc", None), ("addrs", None), ("blocks_cache_key", None),
                              ("remote_accessible", None)],
    "unregister_cache": [("cache_id", None)],
    "deallocate_cache": [("cache", None)],
    "deallocate_blocks_cache": [("cache", None)],
    "remove_cache_key": [("cache_key", None)],
    "copy_blocks": [("cache", None), ("copy_block_info", None)],
    "swap_blocks": [("src_cache", None), ("dst_cache", None), ("src_to_dst", None)],
    "pull_cache": [("cache_key", None), ("cache", None), ("batch_index", 0), ("size", -1), ("*", None)],
    "pull_blocks": [("src_cache_key", None), ("dst_cache", None), ("src_blocks", ()), ("dst_blocks", ()),
                    ("*", None)],
    "push_cache": [("dst_cache_key", None), ("src_cache", None), ("src_batch_index", 0), ("src_layer_range", None),
                   ("dst_layer_range", None), ("size", -1), ("tensor_num_per_layer", 2)],
    "push_blocks": [("dst_cache_key", None), ("src_cache", None), ("src_blocks", ()), ("dst_blocks", ()),
                    ("src_layer_range", None), ("dst_layer_range", None), ("tensor_num_per_layer", 2)],
    "remap_registered_memory": [("mem_infos", None)],
    "transfer_cache_async": [("src_cache", None), ("layer_synchronizer", None), ("transfer_configs", None),
                             ("src_block_indices", None), ("dst_block_indices", None),
                             ("dst_block_memory_size", None)],
}


def positional(function: Any) -> list[tuple[str, Any]]:
    """The reference-visible parameters: positional ones with their defaults, ``**kwargs`` as "*"; the
    keyword-only additions of aiodatadist (``notify=``) are left out."""
    out = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.name == "self" or parameter.kind == parameter.KEYWORD_ONLY:
            continue
        if parameter.kind == parameter.VAR_KEYWORD:
            out.append(("*", None))
            continue
        default = None if parameter.default is parameter.empty else parameter.default
        out.append((parameter.name, default))
    return out


def test_every_public_name_of_the_reference_is_there() -> None:
    assert set(llm_datadist.__all__) == REFERENCE_ALL - V1
    for name in REFERENCE_ALL - V1:
        assert getattr(llm_datadist, name) is not None
    assert llm_datadist.LLMConfig is llm_datadist.LlmConfig
    assert llm_datadist.LLMDataDist is sync.LLMDataDist and llm_datadist.CacheTask is sync.CacheTask
    for name in V1:
        with pytest.raises(AttributeError, match="KvCacheManager mode"):
            getattr(llm_datadist, name)
    with pytest.raises(AttributeError):
        llm_datadist.NoSuchName  # noqa: B018


@pytest.mark.parametrize("method", sorted(LLMDATADIST))
def test_llmdatadist_signatures(method: str) -> None:
    assert positional(getattr(llm_datadist.LLMDataDist, method)) == LLMDATADIST[method]


@pytest.mark.parametrize("method", sorted(CACHE_MANAGER))
def test_cache_manager_signatures(method: str) -> None:
    assert positional(getattr(sync.CacheManager, method)) == CACHE_MANAGER[method]


def test_value_types_and_enums() -> None:
    assert [m.name for m in llm_datadist.RegisterMemStatus] == ["OK", "PREPARING", "FAILED"]
    assert {m.name for m in llm_datadist.Memtype} == {"MEM_TYPE_DEVICE", "MEM_TYPE_HOST"}
    info = llm_datadist.MemInfo(llm_datadist.Memtype.MEM_TYPE_DEVICE, 0x1000, 4096)
    assert (info.mem_type, info.addr, info.size) == (llm_datadist.Memtype.MEM_TYPE_DEVICE, 0x1000, 4096)
    with pytest.raises(TypeError):
        llm_datadist.MemInfo(0, 0x1000, 4096)  # type: ignore[arg-type]
    config = llm_datadist.TransferConfig(3, [1, 2], range(1))
    assert (config.dst_cluster_id, config.dst_addrs, config.src_layer_range, config.src_batch_index,
            config.dst_layer_range) == (3, [1, 2], range(1), 0, None)
    with pytest.raises(llm_datadist.LLMException):
        llm_datadist.TransferConfig(3, [1, 2], range(0, 2, 2))
    with pytest.raises(TypeError):
        llm_datadist.TransferConfig(3, "x")  # type: ignore[arg-type]
    keyed = llm_datadist.TransferWithCacheKeyConfig(llm_datadist.BlocksCacheKey(5, 1), range(2), range(2, 4))
    assert (keyed.dst_cluster_id, keyed.dst_layer_of(1)) == (5, 3)
    status = llm_datadist.Status(llm_datadist.LLMStatusCode.LLM_SUCCESS)
    assert status.is_ok() and not llm_datadist.Status(llm_datadist.LLMStatusCode.LLM_FAILED).is_ok()
    assert issubclass(llm_datadist.LayerSynchronizer, object)
    with pytest.raises(TypeError):
        llm_datadist.LayerSynchronizer()  # type: ignore[abstract]
