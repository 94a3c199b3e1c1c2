"""``LLMConfig``: validating option builder whose ``generate_options()`` feeds ``LLMDataDist.init``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from ._checks import check_bool, check_int, check_isinstance, require
from .settings.curve_keys import (  # the CURVE keys' parsers stay importable from here
    parse_curve_key,
    parse_curve_peer_keys,
    peer_keys_text,
    secret_key_text,
)
from .settings.keys import MAX_TCP_CONNECTIONS, NET_IMPLEMENTATIONS, OptionKey
from .types import Transport

__all__ = ["LLMConfig", "LlmConfig", "OptionKey", "parse_curve_key", "parse_curve_peer_keys"]

def _check_pool_cfg(name: str, value: str) -> None:
    """``{"memory_size": int > 0, "page_shift": int in [10, 31)}`` (accepted for compatibility)."""
    try:
        cfg = json.loads(value)
    except ValueError:
        cfg = None
    require(isinstance(cfg, dict), f"{name} must be a JSON object string, but got {value!r}.")
    assert isinstance(cfg, dict)
    size = cfg.get("memory_size")
    require(isinstance(size, int) and not isinstance(size, bool) and size > 0,
            f"{name}.memory_size must be an int > 0.")
    shift = cfg.get("page_shift", 16)
    require(isinstance(shift, int) and not isinstance(shift, bool) and 10 <= shift < 31,
            f"{name}.page_shift must be an int in [10, 31).")


class LLMConfig:
    """Options for :meth:`LLMDataDist.init`; every property validates on assignment.

    ``generate_options()`` returns the option dict (the same dict object every call, as in the reference).
    """

    __slots__ = (
        "_auth_key",
        "_compat",
        "_curve_peer_keys",
        "_curve_secret_key",
        "_device_id",
        "_device_staging",
        "_directory",
        "_enable_cache_manager",
        "_enable_remote_cache_accessible",
        "_enable_switch_role",
        "_ge_options",
        "_host_mem_pool_cfg",
        "_link_retry_count",
        "_link_total_time",
        "_listen_ip_info",
        "_local_comm_res",
        "_mem_pool_cfg",
        "_mem_utilization",
        "_net",
        "_options",
        "_sync_kv_timeout",
        "_tcp_connections",
        "_transport",
    )

    def __init__(self) -> None:
        self._options: dict[str, str] = {}
        self._device_id: int | list[int] | tuple[int, ...] | None = None
        self._sync_kv_timeout: int | str | None = None
        self._listen_ip_info = ""
        self._enable_cache_manager: bool | None = None
        self._enable_remote_cache_accessible: bool | None = None
        self._enable_switch_role = False
        self._local_comm_res: str | None = None
        self._link_total_time: int | None = None
        self._link_retry_count: int | None = None
        self._mem_pool_cfg = ""
        self._host_mem_pool_cfg = ""
        self._ge_options: dict[str, str] = {}
        self._transport: Transport | None = None
        self._auth_key: str | None = None
        self._net: str | None = None
        self._directory: bool | None = None
        self._device_staging: bool | None = None
        self._tcp_connections: int | None = None
        self._curve_secret_key: str | None = None
        self._curve_peer_keys: str | None = None
        self._compat: dict[str, str] = {}
        self._mem_utilization = 0.95

    # -- fields of the reference ------------------------------------------------------------------------
    @property
    def device_id(self) -> int | list[int] | tuple[int, ...] | None:
        """Device ordinal (CUDA ordinal for DEVICE caches); an int >= 0 or a list of them."""
        return self._device_id

    @device_id.setter
    def device_id(self, value: int | list[int] | tuple[int, ...]) -> None:
        check_isinstance("device_id", value, (int, list, tuple))
        ids = list(value) if isinstance(value, (list, tuple)) else [value]
        require(len(ids) > 0, "device_id list must not be empty.")
        for dev in ids:
            check_int("device_id", dev, "int32")
            require(dev >= 0, f"device_id must be >= 0, but got {dev}.")
        self._device_id = value

    @property
    def sync_kv_timeout(self) -> int | str | None:
        """Timeout in ms of pull/push calls (default 1000 when unset)."""
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, value: int | str) -> None:
        check_isinstance("sync_kv_timeout", value, (int, str))
        if isinstance(value, str):
            require(value.isascii() and value.isdigit(),
                    f"sync_kv_timeout must be a positive integer, but got {value!r}.")
            number = int(value)
        else:
            number = value
        check_int("sync_kv_timeout", number, "int32")
        require(number > 0, f"sync_kv_timeout must be > 0, but got {number}.")
        self._sync_kv_timeout = value

    @property
    def listen_ip_info(self) -> str:
        """``"ip:port"`` this instance listens on; setting it makes the instance a server."""
        return self._listen_ip_info

    @listen_ip_info.setter
    def listen_ip_info(self, value: str) -> None:
        check_isinstance("listen_ip_info", value, str)
        self._listen_ip_info = value

    @property
    def enable_cache_manager(self) -> bool:
        return bool(self._enable_cache_manager)

    @enable_cache_manager.setter
    def enable_cache_manager(self, value: bool) -> None:
        self._enable_cache_manager = check_bool("enable_cache_manager", value)

    @property
    def enable_remote_cache_accessible(self) -> bool:
        return bool(self._enable_remote_cache_accessible)

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, value: bool) -> None:
        self._enable_remote_cache_accessible = check_bool("enable_remote_cache_accessible", value)

    @property
    def enable_switch_role(self) -> bool:
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, value: bool) -> None:
        self._enable_switch_role = check_bool("enable_switch_role", value)

    @property
    def local_comm_res(self) -> str:
        """Accepted for compatibility (HCCL resources do not exist here); presence implies cache-manager mode."""
        return self._local_comm_res or ""

    @local_comm_res.setter
    def local_comm_res(self, value: str) -> None:
        check_isinstance("local_comm_res", value, str)
        self._local_comm_res = value

    @property
    def link_total_time(self) -> int:
        """Seconds a link attempt may take in total; 0 = use the ``timeout`` of ``link_clusters``."""
        return self._link_total_time or 0

    @link_total_time.setter
    def link_total_time(self, value: int) -> None:
        self._link_total_time = check_int("link_total_time", value, "uint32")

    @property
    def link_retry_count(self) -> int:
        """Connection attempts per link, in [1, 100]."""
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, value: int) -> None:
        check_int("link_retry_count", value, "uint32")
        require(1 <= value <= 100, f"link_retry_count should be in [1, 100], but got {value}.")
        self._link_retry_count = value

    @property
    def mem_pool_cfg(self) -> str:
        """Deprecated in the reference; validated and accepted, not needed (caches are allocated directly)."""
        return self._mem_pool_cfg

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, value: str) -> None:
        check_isinstance("mem_pool_cfg", value, str)
        if value:
            _check_pool_cfg("mem_pool_cfg", value)
        self._mem_pool_cfg = value

    @property
    def host_mem_pool_cfg(self) -> str:
        """Deprecated in the reference; validated and accepted, not needed (caches are allocated directly)."""
        return self._host_mem_pool_cfg

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, value: str) -> None:
        check_isinstance("host_mem_pool_cfg", value, str)
        if value:
            _check_pool_cfg("host_mem_pool_cfg", value)
        self._host_mem_pool_cfg = value

    @property
    def ge_options(self) -> dict[str, str]:
        """Extra raw options, merged first (later keys override them)."""
        return self._ge_options

    @ge_options.setter
    def ge_options(self, value: dict[str, str]) -> None:
        check_isinstance("ge_options", value, dict)
        for key, item in value.items():
            check_isinstance("ge_options key", key, str)
            check_isinstance("ge_options value", item, str)
        self._ge_options = dict(value)

    # -- accepted for compatibility (Ascend/HCCL settings with no meaning here; emitted, otherwise ignored) ----
    def _set_compat(self, key: str, value: str) -> None:
        self._compat[key] = value

    @property
    def rdma_traffic_class(self) -> int | None:
        value = self._compat.get(OptionKey.RDMA_TRAFFIC_CLASS)
        return None if value is None else int(value)

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, value: int) -> None:
        self._set_compat(OptionKey.RDMA_TRAFFIC_CLASS, str(check_int("rdma_traffic_class", value, "uint32")))

    @property
    def rdma_service_level(self) -> int | None:
        value = self._compat.get(OptionKey.RDMA_SERVICE_LEVEL)
        return None if value is None else int(value)

    @rdma_service_level.setter
    def rdma_service_level(self, value: int) -> None:
        self._set_compat(OptionKey.RDMA_SERVICE_LEVEL, str(check_int("rdma_service_level", value, "uint32")))

    @property
    def transfer_backend(self) -> str:
        return self._compat.get(OptionKey.TRANSFER_BACKEND, "")

    @transfer_backend.setter
    def transfer_backend(self, value: str) -> None:
        check_isinstance("transfer_backend", value, str)
        self._set_compat(OptionKey.TRANSFER_BACKEND, value)

    @property
    def global_resource_config(self) -> str:
        return self._compat.get(OptionKey.GLOBAL_RESOURCE_CONFIG, "")

    @global_resource_config.setter
    def global_resource_config(self, value: str) -> None:
        check_isinstance("global_resource_config", value, str)
        self._set_compat(OptionKey.GLOBAL_RESOURCE_CONFIG, value)

    @property
    def buf_pool_cfg(self) -> str:
        return self._compat.get(OptionKey.BUF_POOL_CONFIG, "")

    @buf_pool_cfg.setter
    def buf_pool_cfg(self, value: str) -> None:
        check_isinstance("buf_pool_cfg", value, str)
        if value:
            self._set_compat(OptionKey.BUF_POOL_CONFIG, value)

    @property
    def deploy_res_path(self) -> str:
        return self._compat.get(OptionKey.DEPLOY_RES_PATH, "")

    @deploy_res_path.setter
    def deploy_res_path(self, value: str) -> None:
        check_isinstance("deploy_res_path", value, str)
        if value:
            self._set_compat(OptionKey.DEPLOY_RES_PATH, value)

    @property
    def cluster_info(self) -> str:
        return self._compat.get(OptionKey.CLUSTER_INFO, "")

    @cluster_info.setter
    def cluster_info(self, value: str) -> None:
        check_isinstance("cluster_info", value, str)
        self._set_compat(OptionKey.CLUSTER_INFO, value)

    @property
    def output_max_size(self) -> int | None:
        value = self._compat.get(OptionKey.OUTPUT_MAX_SIZE)
        return None if value is None else int(value)

    @output_max_size.setter
    def output_max_size(self, value: int) -> None:
        self._set_compat(OptionKey.OUTPUT_MAX_SIZE, str(check_int("output_max_size", value, "int64")))

    @property
    def mem_utilization(self) -> float:
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, value: float) -> None:
        check_isinstance("mem_utilization", value, (float, int))
        require(0 <= value <= 1, f"mem_utilization should be in [0, 1], but got {value}.")
        self._mem_utilization = float(value)

    # -- aiodatadist additions ----------------------------------------------------------------------------
    @property
    def transport(self) -> Transport:
        """Data plane for links: ``auto`` (default), ``shm`` (same host only) or ``tcp``."""
        return self._transport or Transport.AUTO

    @transport.setter
    def transport(self, value: Transport | str) -> None:
        check_isinstance("transport", value, (Transport, str))
        try:
            self._transport = Transport(value)
        except ValueError:
            raise ValueError(f"transport must be one of {[t.value for t in Transport]}, but got {value!r}.") from None

    @property
    def auth_key(self) -> str | None:
        """Shared secret peers must prove before any request is served (``None`` = no authentication)."""
        return self._auth_key

    @auth_key.setter
    def auth_key(self, value: str) -> None:
        check_isinstance("auth_key", value, str)
        require(len(value) > 0, "auth_key must not be empty.")
        self._auth_key = value

    @property
    def net(self) -> str | None:
        """TCP data plane of this instance's links: ``"native"`` (the helper's I/O threads, which also serve
        and make one-sided reads) or ``"python"`` (Python threads, for diagnosis); ``None`` (unset) = the
        ``AIODATADIST_NET`` variable, else ``"native"``.  Python threads are used where the helper is not
        built."""
        return self._net

    @net.setter
    def net(self, value: str) -> None:
        check_isinstance("net", value, str)
        require(value in NET_IMPLEMENTATIONS,
                f"net must be one of {list(NET_IMPLEMENTATIONS)}, but got {value!r}.")
        self._net = value

    @property
    def directory(self) -> bool | None:
        """Whether a same-host requester reads the owner's cache directory to skip asking it (``False``: every
        transfer resolves its key through the owner, for diagnosis); ``None`` (unset) = the
        ``AIODATADIST_DIRECTORY`` variable, else ``True``."""
        return self._directory

    @directory.setter
    def directory(self, value: bool) -> None:
        self._directory = check_bool("directory", value)

    @property
    def device_staging(self) -> bool | None:
        """Whether TCP links move ``Placement.DEVICE`` caches staged through page-locked host memory (``False``:
        they refuse them with ``LLM_FEATURE_NOT_ENABLED``, fail closed); ``None`` (unset) = on."""
        return self._device_staging

    @device_staging.setter
    def device_staging(self, value: bool) -> None:
        self._device_staging = check_bool("device_staging", value)

    @property
    def tcp_connections(self) -> int | None:
        """Data connections of each TCP link this instance accepts as the server (the client opens as many as
        the server asks for), in [1, 16]; ``None`` (unset) = the ``AIODATADIST_TCP_CONNECTIONS`` variable, else
        one per CPU the process may run on, 2 to 4."""
        return self._tcp_connections

    @tcp_connections.setter
    def tcp_connections(self, value: int) -> None:
        check_int("tcp_connections", value, "uint32")
        require(1 <= value <= MAX_TCP_CONNECTIONS,
                f"tcp_connections should be in [1, {MAX_TCP_CONNECTIONS}], but got {value}.")
        self._tcp_connections = value

    @property
    def curve_secret_key(self) -> str | None:
        """This instance's CURVE secret key (Z85, 40 characters, e.g. the second value of
        ``zmq.curve_keypair()``): with it every control connection of the instance is encrypted and
        authenticated by key (ZeroMQ CURVE), and peers without CURVE are refused; ``None`` (default) = no CURVE.
        Needs :attr:`curve_peer_keys`.  See ``docs/security.md``."""
        return self._curve_secret_key

    @curve_secret_key.setter
    def curve_secret_key(self, value: str) -> None:
        self._curve_secret_key = secret_key_text(value)

    @property
    def curve_peer_keys(self) -> str | None:
        """The CURVE public keys of the peers this instance trusts, as ``llm.CurvePeerKeys`` text:
        comma-separated ``PUBLIC_KEY`` (a peer with any cluster id) or ``CLUSTER_ID=PUBLIC_KEY`` (the peer that is
        that cluster) entries.  A client linking to cluster N expects the server key listed for N (else the only key
        listed without an id); a server admits only clients whose key is listed (for the cluster id they claim,
        when the key is bound to ids).  Set from a string, a list of entries or a ``{cluster_id: key}`` dict."""
        return self._curve_peer_keys

    @curve_peer_keys.setter
    def curve_peer_keys(self, value: str | list[str] | tuple[str, ...] | dict[int, str]) -> None:
        self._curve_peer_keys = peer_keys_text(value)

    @property
    def options(self) -> dict[str, str]:
        """The internal option dict (filled by ``generate_options``)."""
        return self._options

    def generate_options(self) -> dict[str, str]:
        """Build the option dict for ``LLMDataDist.init``; keys are only ever added."""
        opts = self._options
        opts.update(self._ge_options)
        if self._device_id is not None:
            ids: list[Any] = (
                list(self._device_id) if isinstance(self._device_id, (list, tuple)) else [self._device_id]
            )
            opts[OptionKey.DEVICE_ID] = ";".join(str(int(d)) for d in ids)
            opts[OptionKey.SESSION_DEVICE_ID] = str(int(ids[0]))
        for key, value in self._set_options():
            opts[key] = value
        opts.update(self._compat)
        opts[OptionKey.MEMORY_UTILIZATION] = str(self._mem_utilization)
        return opts

    gen_options = generate_options

    def _set_options(self) -> Iterator[tuple[str, str]]:
        """The options this config sets (besides device ids, ``ge_options`` and compatibility keys), in a fixed
        order, as option strings."""
        candidates: tuple[tuple[str, Any, Callable[[Any], str]], ...] = (
            (OptionKey.SYNC_KV_TIMEOUT, self._sync_kv_timeout, str),
            (OptionKey.MEM_POOL_CONFIG, self._mem_pool_cfg or None, str),
            (OptionKey.HOST_MEM_POOL_CONFIG, self._host_mem_pool_cfg or None, str),
            (OptionKey.ENABLE_CACHE_MANAGER, self._enable_cache_manager, _flag),
            (OptionKey.ENABLE_REMOTE_CACHE_ACCESSIBLE, self._enable_remote_cache_accessible, _flag),
            (OptionKey.LISTEN_IP_INFO, self._listen_ip_info or None, str),
            (OptionKey.LINK_TOTAL_TIME, self._link_total_time, str),
            (OptionKey.LINK_RETRY_COUNT, self._link_retry_count, str),
            (OptionKey.LOCAL_COMM_RES, self._local_comm_res, str),
            (OptionKey.ENABLE_SWITCH_ROLE, True if self._enable_switch_role else None, _flag),
            (OptionKey.TRANSPORT, self._transport.value if self._transport is not None else None, str),
            (OptionKey.AUTH_KEY, self._auth_key, str),
            (OptionKey.NET, self._net, str),
            (OptionKey.DIRECTORY, self._directory, _flag),
            (OptionKey.DEVICE_STAGING, self._device_staging, _flag),
            (OptionKey.TCP_CONNECTIONS, self._tcp_connections, str),
            (OptionKey.CURVE_SECRET_KEY, self._curve_secret_key, str),
            (OptionKey.CURVE_PEER_KEYS, self._curve_peer_keys, str),
        )
        for key, value, text in candidates:
            if value is not None:
                yield key, text(value)


def _flag(on: Any) -> str:
    return "1" if on else "0"


LlmConfig = LLMConfig
