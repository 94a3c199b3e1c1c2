"""``llm_datadist``, the Python module of Huawei's LLM-DataDist, on aiodatadist: change one import::

    import aiodatadist.compat.llm_datadist as llm_datadist
    from aiodatadist.compat.llm_datadist import LLMDataDist, LLMConfig, LLMRole, BlocksCacheKey, ...

Every public name of the reference module is here, with its blocking signatures (``LLMDataDist`` and its
``cache_manager`` are those of :mod:`aiodatadist.sync`: thread-safe, one library event loop thread), the enums and
value types, and ``LLMConfig`` (alias ``LlmConfig``) with the reference's defaults.  The legacy KvCacheManager
mode's names (``KvCache``, ``KvCacheManager``, ``TensorDesc``, ``Tensor``) are not supported: using them raises
``AttributeError`` saying so (the reference imports them lazily from ``llm_datadist_v1``).  What differs from the
reference is listed in docs/api.md ("Differences from LLM-DataDist").
"""

from __future__ import annotations

from typing import Any

from ..cache import Cache
from ..config import LLMConfig, LlmConfig
from ..errors import LLMException, LLMStatusCode
from ..sync import CacheTask, LLMDataDist
from ..transfer_configs import (
    LayerSynchronizer,
    MemInfo,
    Memtype,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from ..types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMRole,
    Placement,
)

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheTask",
    "DataType",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LayerSynchronizer",
    "LlmConfig",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "Status",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
]

V1_NAMES = frozenset({"KvCache", "KvCacheManager", "TensorDesc", "Tensor"})
"""The reference's legacy KvCacheManager-mode names, which aiodatadist does not provide."""


class Status:
    """A status code with ``is_ok()`` (exported by the reference, unused by its API)."""

    def __init__(self, status: LLMStatusCode | int) -> None:
        self._status_code = LLMStatusCode(status)

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code

    def is_ok(self) -> bool:
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    def __repr__(self) -> str:
        return f"Status({self._status_code.name})"


def __getattr__(name: str) -> Any:
    if name in V1_NAMES:
        raise AttributeError(f"llm_datadist.{name} belongs to the legacy KvCacheManager mode (llm_datadist_v1), "
                             "which aiodatadist does not provide: use LLMDataDist.cache_manager (CacheManager "
                             "mode, llm.EnableCacheManager=1)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
