"""Typed settings: the option dict given to ``LLMDataDist.init`` (:func:`parse_options` -> :class:`Settings`).

The options only: the ``AIODATADIST_*`` environment variables are read in :mod:`aiodatadist.settings.environment` (three
of them are the defaults of per-link options, taken from there when the options do not set them), and the CURVE
keys (``llm.CurveSecretKey``, ``llm.CurvePeerKeys``) are parsed in :mod:`aiodatadist.settings.curve_keys`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._checks import check_isinstance, require
from ..errors import LLMException, LLMStatusCode
from ..types import Transport
from .curve_keys import CurveKeys, curve_keys_from_options
from .environment import (
    ENV_DIRECTORY,
    ENV_NET,
    ENV_TCP_CONNECTIONS,
    EnvKnobs,
    env_knobs,
    knob_of,
)
from .keys import OptionKey

__all__ = ["DEFAULT_SYNC_KV_TIMEOUT_MS", "Settings", "parse_listen_ip_info", "parse_options"]

DEFAULT_SYNC_KV_TIMEOUT_MS = 1000


@dataclass(frozen=True, slots=True)
class Settings:
    """What ``init`` understood from its options (and, for options absent, from the environment)."""

    device_id: int
    sync_kv_timeout_ms: int
    listen: tuple[str, int] | None
    transport: Transport
    auth_key: str | None = field(repr=False)  # a secret: never in a repr (nor is raw, which holds it too)
    # None = unset: pull_cache takes both key types, push works; True: CacheKeyByIdAndIndex only; False: no push
    enable_remote_cache_accessible: bool | None
    has_local_comm_res: bool  # llm.LocalCommRes was given (even ""): local_ip_info_list may be empty
    native_net: bool  # TCP links use the native helper's I/O threads where it is built (llm.Net)
    directory: bool  # same-host requesters read the owner's cache directory (llm.Directory)
    tcp_connections: int  # data connections of each TCP link this instance serves (llm.TcpConnections)
    device_staging: bool  # TCP links move device caches staged through page-locked memory (llm.DeviceStaging)
    link_total_time_s: int  # bound of a two-sided link's bring-up (llm.LinkTotalTime; 0: the default)
    raw: dict[str, str] = field(repr=False)  # the options as given (plus the keys llm.LocalCommRes defaults)
    curve: CurveKeys | None = None  # ZeroMQ CURVE on every control socket (llm.CurveSecretKey, llm.CurvePeerKeys)


def parse_listen_ip_info(value: str) -> tuple[str, int]:
    """``"ip:port"`` -> ``(ip, port)``; exactly one ``:`` as in the reference."""
    parts = value.split(":")
    require(len(parts) == 2 and parts[1].isdigit(),
            f"listen_ip_info should be \"ip:port\", but got {value!r}.")
    port = int(parts[1])
    require(0 <= port <= 65535, f"listen port {port} out of range.")
    return (parts[0] or "0.0.0.0"), port


def _flag(options: dict[str, str], key: str) -> bool | None:
    value = options.get(key)
    if value is None:
        return None
    require(value in ("0", "1"), f"option {key} must be \"0\" or \"1\", but got {value!r}.")
    return value == "1"


def _positive_int(options: dict[str, str], key: str, default: int, *, minimum: int = 1) -> int:
    value = options.get(key)
    if value is None:
        return default
    require(value.isdigit() and int(value) >= minimum, f"option {key} must be an integer >= {minimum}, "
            f"but got {value!r}.")
    return int(value)


def _per_link(options: dict[str, str], knobs: EnvKnobs, env: str) -> Any:
    """The option that ``env`` defaults: parsed from the options if there, else the variable's value."""
    knob = knob_of(env)
    assert knob.option is not None
    value = options.get(knob.option)
    if value is None:
        knobs.check(env)
        return getattr(knobs, knob.field)
    try:
        return knob.parse(value)
    except ValueError:
        raise LLMException(f"option {knob.option} must be {knob.accepted}, but got {value!r}.",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID) from None


def parse_options(options: Any, knobs: EnvKnobs | None = None) -> Settings:
    """Validate ``options`` (a ``dict[str, str]``); raise TypeError / LLMException(LLM_PARAM_INVALID).

    ``knobs`` (default: :func:`env_knobs`) gives the defaults of the per-link options."""
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
    if _flag(opts, OptionKey.ENABLE_CACHE_MANAGER) is False:
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
            f"option {OptionKey.TRANSPORT} must be one of auto/shm/tcp/nixl, but got {transport_value!r}.")
    auth_key = opts.get(OptionKey.AUTH_KEY) or None
    # Validated as in the reference, otherwise unused: role switches need no flag here, and one-sided links are
    # bounded by link_clusters' timeout with one attempt (docs/api.md, "Differences").  LinkTotalTime bounds the
    # bring-up of a two-sided link.
    _flag(opts, OptionKey.ENABLE_SWITCH_ROLE)
    link_total_time = _positive_int(opts, OptionKey.LINK_TOTAL_TIME, 0, minimum=0)
    _positive_int(opts, OptionKey.LINK_RETRY_COUNT, 1)
    curve = curve_keys_from_options(opts, Transport(transport_value))
    knobs = env_knobs() if knobs is None else knobs
    return Settings(
        device_id=int(device),
        sync_kv_timeout_ms=_positive_int(opts, OptionKey.SYNC_KV_TIMEOUT, DEFAULT_SYNC_KV_TIMEOUT_MS),
        listen=listen,
        transport=Transport(transport_value),
        auth_key=auth_key,
        # aiodatadist resolves keys on the owner at transfer time, so remote access is always possible; the flag
        # only gates this side's calls, as in the reference, and each of its three states has its own effect.
        enable_remote_cache_accessible=_flag(opts, OptionKey.ENABLE_REMOTE_CACHE_ACCESSIBLE),
        has_local_comm_res=OptionKey.LOCAL_COMM_RES in opts,
        native_net=_per_link(opts, knobs, ENV_NET),
        directory=_per_link(opts, knobs, ENV_DIRECTORY),
        tcp_connections=_per_link(opts, knobs, ENV_TCP_CONNECTIONS),
        device_staging=_flag(opts, OptionKey.DEVICE_STAGING) is not False,
        link_total_time_s=link_total_time,
        raw=opts,
        curve=curve,
    )
