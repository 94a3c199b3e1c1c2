"""aiodatadist: asyncio-native KV-cache transfer for disaggregated LLM serving (the LLM-DataDist API).

The public names load on first use (PEP 562), so that importing one module of the package (e.g. the sans-IO
``aiodatadist.protocol``) does not load the rest, nor the native helper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names

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
    from .stats import LinkStats, MessageStats, NotificationStats, StagingStats, StatsSnapshot
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
    "MessageStats": "stats",
    "Memtype": "transfer_configs",
    "Notification": "notifications",
    "NotificationStats": "stats",
    "Placement": "types",
    "RegisterMemStatus": "transfer_configs",
    "StagingStats": "stats",
    "StatsSnapshot": "stats",
    "TransferConfig": "transfer_configs",
    "TransferWithCacheKeyConfig": "transfer_configs",
    "Transport": "types",
    "cluster_info_for": "types",
}
"""Each public name -> the module (of this package) that defines it."""


__getattr__, __dir__ = lazy_names(__name__, globals(), _WHERE)

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
    "MessageStats",
    "Notification",
    "NotificationStats",
    "Placement",
    "RegisterMemStatus",
    "StagingStats",
    "StatsSnapshot",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "Transport",
    "__version__",
    "cluster_info_for",
]
