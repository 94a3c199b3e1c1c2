"""aiodatadist: asyncio-native KV-cache transfer for disaggregated LLM serving (the LLM-DataDist API)."""

from .cache import Cache
from .cache_manager import CacheManager
from .config import LLMConfig, LlmConfig
from .datadist import LLMDataDist
from .errors import LLMException, LLMLinkError, LLMNotInitializedError, LLMStatusCode, LLMTimeoutError
from .memory import HostMemory
from .notifications import Notification
from .stats import LinkStats, NotificationStats, StatsSnapshot
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
    "LinkStats",
    "LlmConfig",
    "Notification",
    "NotificationStats",
    "Placement",
    "StatsSnapshot",
    "Transport",
    "__version__",
]
