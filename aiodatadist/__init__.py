"""aiodatadist: asyncio-native KV-cache transfer for disaggregated LLM serving (the LLM-DataDist API).

The public names load on first use (PEP 562), so that importing one module of the package (e.g. the sans-IO
``aiodatadist.protocol``) does not load the rest, nor the native helper.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache import Cache
    from .cache_manager import CacheManager
    from .config import LLMConfig, LlmConfig
    from .datadist import LLMDataDist
    from .errors import (
        LinkDropReason,
        LLMException,
        LLMLinkError,
        LLMNotInitializedError,
        LLMStatusCode,
        LLMTimeoutError,
    )
    from .layer_transfer import CacheTask
    from .memory import HostMemory
    from .notifications import Notification
    from .stats import LinkStats, NotificationStats, StatsSnapshot
    from .transfer_configs import (
        LayerSynchronizer,
        MemInfo,
        Memtype,
        RegisterMemStatus,
        TransferConfig,
        TransferWithCacheKeyConfig,
    )
    from .types import (
        BlocksCacheKey,
        CacheDesc,
        CacheKey,
        CacheKeyByIdAndIndex,
        DataType,
        LLMClusterInfo,
        LLMRole,
        Placement,
        Transport,
        cluster_info_for,
    )

__version__ = "0.1.0"

_WHERE = {
    "BlocksCacheKey": "types",
    "Cache": "cache",
    "CacheDesc": "types",
    "CacheKey": "types",
    "CacheKeyByIdAndIndex": "types",
    "CacheManager": "cache_manager",
    "CacheTask": "layer_transfer",
    "DataType": "types",
    "HostMemory": "memory",
    "LLMClusterInfo": "types",
    "LLMConfig": "config",
    "LLMDataDist": "datadist",
    "LLMException": "errors",
    "LLMLinkError": "errors",
    "LinkDropReason": "errors",
    "LLMNotInitializedError": "errors",
    "LLMRole": "types",
    "LLMStatusCode": "errors",
    "LLMTimeoutError": "errors",
    "LayerSynchronizer": "transfer_configs",
    "LinkStats": "stats",
    "LlmConfig": "config",
    "MemInfo": "transfer_configs",
    "Memtype": "transfer_configs",
    "Notification": "notifications",
    "NotificationStats": "stats",
    "Placement": "types",
    "RegisterMemStatus": "transfer_configs",
    "StatsSnapshot": "stats",
    "TransferConfig": "transfer_configs",
    "TransferWithCacheKeyConfig": "transfer_configs",
    "Transport": "types",
    "cluster_info_for": "types",
}
"""Each public name -> the module (of this package) that defines it."""


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'aiodatadist' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "DataType",
    "HostMemory",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMLinkError",
    "LLMNotInitializedError",
    "LLMRole",
    "LLMStatusCode",
    "LLMTimeoutError",
    "LayerSynchronizer",
    "LinkDropReason",
    "LinkStats",
    "LlmConfig",
    "MemInfo",
    "Memtype",
    "Notification",
    "NotificationStats",
    "Placement",
    "RegisterMemStatus",
    "StatsSnapshot",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "Transport",
    "__version__",
    "cluster_info_for",
]
