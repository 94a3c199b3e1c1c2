"""DEVICE caches without CUDA (CI has no GPU): refused with the reason, on a linked pair that stays usable
(the CPU-side math and wire validation of device caches are in ``unit/copy/test_device_cpu.py``)."""

from __future__ import annotations

import pytest
from helpers.internals import registry_of

from aiodatadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode, Placement
from aiodatadist.cuda import cuda_status
from aiodatadist.testing import linked_pair

DEV = CacheDesc(2, (8, 4096), DataType.DT_UINT8, Placement.DEVICE)
no_gpu = pytest.mark.skipif(not cuda_status().startswith("CUDA unavailable"), reason="a GPU is present")


@no_gpu
async def test_device_caches_are_refused_with_the_reason_and_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODATADIST_LIBCUDA", "/nonexistent/libcuda.so.1")
    async with linked_pair() as (prompt, decoder):
        cm = prompt.cache_manager
        for call in (lambda: cm.allocate_blocks_cache(DEV, BlocksCacheKey(1, 0)), lambda: cm.allocate_cache(DEV),
                     lambda: cm.register_blocks_cache(DEV, [1 << 20, 2 << 20])):
            with pytest.raises(LLMException) as info:
                call()
            assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
            assert "CUDA" in str(info.value) or "libcuda" in str(info.value)
        assert registry_of(cm).entries() == []
        host = cm.allocate_blocks_cache(CacheDesc(2, (8, 4096), DataType.DT_UINT8, Placement.HOST),
                                        BlocksCacheKey(1, 0))
        assert host.cache_id == 1  # no id was used up by the refused calls
        dst = decoder.cache_manager.allocate_blocks_cache(CacheDesc(2, (8, 4096), DataType.DT_UINT8, Placement.HOST))
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [1])
