"""aiodatadist: asyncio-native KV-cache transfer for disaggregated LLM serving (the LLM-DataDist API)."""

from .cache import Cache
from .cache_manager import CacheManager
from .config import LLMConfig, LlmConfig
from .datadist import LLMDataDist
from .errors import LLMException, LLMLinkError, LLMNotInitializedError, LLMStatusCode, LLMTimeoutError
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
)

__version__ = "0.1.0"

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
]
