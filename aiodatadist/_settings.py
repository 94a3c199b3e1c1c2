"""Parsing of the option dict given to ``LLMDataDist.init`` into typed settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._checks import check_isinstance, require
from .config import OptionKey
from .errors import LLMException, LLMStatusCode
from .types import Transport

__all__ = ["DEFAULT_SYNC_KV_TIMEOUT_MS", "Settings", "parse_listen_ip_info", "parse_options"]

DEFAULT_SYNC_KV_TIMEOUT_MS = 1000


@dataclass(frozen=True, slots=True)
class Settings:
    """What ``init`` understood from its options."""

    device_id: int
    sync_kv_timeout_ms: int
    listen: tuple[str, int] | None
    transport: Transport
    auth_key: str | None
    enable_remote_cache_accessible: bool
    enable_switch_role: bool
    link_total_time_s: int
    link_retry_count: int
    raw: dict[str, str]


def parse_listen_ip_info(value: str) -> tuple[str, int]:
    """``"ip:port"`` -> ``(ip, port)``; exactly one ``:`` as in the reference."""
    parts = value.split(":")
    require(len(parts) == 2 and parts[1].isdigit(),
            f"listen_ip_info should be \"ip:port\", but got {value!r}.")
    port = int(parts[1])
    require(0 <= port <= 65535, f"listen port {port} out of range.")
    return (parts[0] or "0.0.0.0"), port


def _flag(options: dict[str, str], key: str, default: bool) -> bool:
    value = options.get(key)
    if value is None:
        return default
    require(value in ("0", "1"), f"option {key} must be \"0\" or \"1\", but got {value!r}.")
    return value == "1"


def _positive_int(options: dict[str, str], key: str, default: int, *, minimum: int = 1) -> int:
    value = options.get(key)
    if value is None:
        return default
    require(value.isdigit() and int(value) >= minimum, f"option {key} must be an integer >= {minimum}, "
            f"but got {value!r}.")
    return int(value)


def parse_options(options: Any) -> Settings:
    """Validate ``options`` (a ``dict[str, str]``); raise TypeError / LLMException(LLM_PARAM_INVALID)."""
    check_isinstance("options", options, dict)
    for key, value in options.items():
        check_isinstance("options key", key, str)
        check_isinstance(f"options[{key!r}]", value, str)
    opts: dict[str, str] = dict(options)
    flow = opts.get("ge.flowGraphMemMaxSize")
    if flow is not None:
        require(flow.isdigit(), f"ge.flowGraphMemMaxSize must be a single integer, but got {flow!r}.")
    if OptionKey.LOCAL_COMM_RES in opts:
        opts.setdefault(OptionKey.ENABLE_CACHE_MANAGER, "1")
        opts.setdefault(OptionKey.ENABLE_REMOTE_CACHE_ACCESSIBLE, "1")
    if not _flag(opts, OptionKey.ENABLE_CACHE_MANAGER, True):
        raise LLMException(
            "aiodatadist implements CacheManager mode only; llm.EnableCacheManager=\"0\" (KvCacheManager mode) "
            "is not supported.",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )
    device = opts.get(OptionKey.DEVICE_ID, "0").split(";")[0]
    require(device.isdigit(), f"option {OptionKey.DEVICE_ID} must be a device ordinal, but got {device!r}.")
    listen_value = opts.get(OptionKey.LISTEN_IP_INFO, "")
    listen = parse_listen_ip_info(listen_value) if listen_value else None
    transport_value = opts.get(OptionKey.TRANSPORT, Transport.AUTO.value)
    require(transport_value in {t.value for t in Transport},
            f"option {OptionKey.TRANSPORT} must be one of auto/shm/tcp, but got {transport_value!r}.")
    auth_key = opts.get(OptionKey.AUTH_KEY) or None
    return Settings(
        device_id=int(device),
        sync_kv_timeout_ms=_positive_int(opts, OptionKey.SYNC_KV_TIMEOUT, DEFAULT_SYNC_KV_TIMEOUT_MS),
        listen=listen,
        transport=Transport(transport_value),
        auth_key=auth_key,
        # aiodatadist resolves keys on the owner at transfer time, so remote access is always possible; the flag
        # only gates push, as in the reference.
        enable_remote_cache_accessible=_flag(opts, OptionKey.ENABLE_REMOTE_CACHE_ACCESSIBLE, True),
        enable_switch_role=_flag(opts, OptionKey.ENABLE_SWITCH_ROLE, False),
        link_total_time_s=_positive_int(opts, OptionKey.LINK_TOTAL_TIME, 0, minimum=0),
        link_retry_count=_positive_int(opts, OptionKey.LINK_RETRY_COUNT, 1),
        raw=opts,
    )
