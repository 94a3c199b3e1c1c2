"""The option keys of ``LLMDataDist.init`` (:class:`OptionKey`, public as ``aiodatadist.config.OptionKey``) and
the bounds their values share with the environment variables that default them."""

from __future__ import annotations

from .curve_keys import PEER_KEYS_OPTION, SECRET_KEY_OPTION

__all__ = ["MAX_TCP_CONNECTIONS", "NET_IMPLEMENTATIONS", "OptionKey"]

NET_IMPLEMENTATIONS = ("native", "python")  # values of llm.Net / AIODATADIST_NET
MAX_TCP_CONNECTIONS = 16  # data connections per TCP link (MAX_CONNS in native/src/net.c)


class OptionKey:
    """Option keys understood by ``LLMDataDist.init`` (reference names, plus aiodatadist's own)."""

    DEVICE_ID = "ge.exec.deviceId"
    SESSION_DEVICE_ID = "ge.session_device_id"
    SYNC_KV_TIMEOUT = "llm.SyncKvCacheWaitTime"
    LISTEN_IP_INFO = "llm.listenIpInfo"
    ENABLE_CACHE_MANAGER = "llm.EnableCacheManager"
    ENABLE_REMOTE_CACHE_ACCESSIBLE = "llm.EnableRemoteCacheAccessible"
    ENABLE_SWITCH_ROLE = "llm.EnableSwitchRole"
    LOCAL_COMM_RES = "llm.LocalCommRes"
    LINK_TOTAL_TIME = "llm.LinkTotalTime"
    LINK_RETRY_COUNT = "llm.LinkRetryCount"
    MEM_POOL_CONFIG = "llm.MemPoolConfig"
    HOST_MEM_POOL_CONFIG = "llm.HostMemPoolConfig"
    TRANSPORT = "llm.Transport"
    AUTH_KEY = "llm.AuthKey"
    NET = "llm.Net"
    DIRECTORY = "llm.Directory"
    TCP_CONNECTIONS = "llm.TcpConnections"
    DEVICE_STAGING = "llm.DeviceStaging"
    CURVE_SECRET_KEY = SECRET_KEY_OPTION  # the CURVE options are named with their keys, in curve_keys
    CURVE_PEER_KEYS = PEER_KEYS_OPTION
    # Accepted for compatibility; they configure Ascend/HCCL resources that do not exist here.
    RDMA_TRAFFIC_CLASS = "llm.RdmaTrafficClass"
    RDMA_SERVICE_LEVEL = "llm.RdmaServiceLevel"
    TRANSFER_BACKEND = "llm.TransferBackend"
    GLOBAL_RESOURCE_CONFIG = "llm.GlobalResourceConfig"
    BUF_POOL_CONFIG = "llm.BufPoolCfg"
    MEMORY_UTILIZATION = "llm.MemoryUtilization"
    DEPLOY_RES_PATH = "llm.deployResPath"
    CLUSTER_INFO = "llm.ClusterInfo"
    OUTPUT_MAX_SIZE = "llm.OutputMaxSize"
