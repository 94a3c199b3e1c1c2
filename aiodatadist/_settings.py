"""Typed settings: the option dict given to ``LLMDataDist.init`` (:func:`parse_options` -> :class:`Settings`)
and the ``AIODATADIST_*`` environment variables (:func:`env_knobs` -> :class:`EnvKnobs`).

Every ``AIODATADIST_*`` variable is read and parsed here and nowhere else.  Each has one parser, shared with
the option key it defaults (if any), so a value means the same in the environment and in the options.

An invalid value is never silently replaced by the default:

* The three variables that act per link (``AIODATADIST_NET``, ``AIODATADIST_DIRECTORY``,
  ``AIODATADIST_TCP_CONNECTIONS``) are the process-wide defaults of the options ``llm.Net``,
  ``llm.Directory`` and ``llm.TcpConnections``.  An invalid value is an **error**: ``init`` raises
  ``LLMException(LLM_PARAM_INVALID)`` naming the variable and its accepted values, exactly as for an invalid
  option, unless the instance's options set that key (then the variable is not used).
* The process-wide ones (``AIODATADIST_EXECUTOR``, ``AIODATADIST_COPY_*``, ``AIODATADIST_SAME_HOST``) are read
  deep inside other calls (the first ``init`` building the copy executor, a link probing its peer) where an
  exception would fail an unrelated operation, and each has a safe default; an invalid value logs a
  **warning** (logger ``aiodatadist.settings``) naming the variable, the accepted values and the value used
  instead.  A number above its bound is read as the bound, and an unknown same-host mechanism is dropped (the
  known ones still restrict), with a warning too: both did so silently before.
* ``AIODATADIST_LIBCUDA`` takes any value (a list of library paths).

An empty value counts as unset, except for ``AIODATADIST_SAME_HOST`` where it means "no mechanism".
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import zmq

from ._checks import check_isinstance, require
from .config import (
    MAX_TCP_CONNECTIONS,
    NET_IMPLEMENTATIONS,
    OptionKey,
    parse_curve_key,
    parse_curve_peer_keys,
)
from .errors import LLMException, LLMStatusCode
from .types import Transport

__all__ = [
    "DEFAULT_SYNC_KV_TIMEOUT_MS",
    "KNOBS",
    "CurveKeys",
    "EnvKnobs",
    "Knob",
    "Settings",
    "describe_value",
    "env_knobs",
    "env_knobs_cache_clear",
    "parse_listen_ip_info",
    "parse_options",
    "usable_cpus",
]

log = logging.getLogger("aiodatadist.settings")

DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
MAX_COPY_THREADS: Final = 64
MAX_COPY_NICE: Final = 19
MAX_COPY_SPIN_US: Final = 100_000
SAME_HOST_MECHANISMS: Final = frozenset({"map", "pvm", "fds"})  # fds: segments handed over a Unix socket

ENV_EXECUTOR: Final = "AIODATADIST_EXECUTOR"
ENV_COPY_THREADS: Final = "AIODATADIST_COPY_THREADS"
ENV_COPY_NICE: Final = "AIODATADIST_COPY_NICE"
ENV_COPY_SPIN_US: Final = "AIODATADIST_COPY_SPIN_US"
ENV_SAME_HOST: Final = "AIODATADIST_SAME_HOST"
ENV_NET: Final = "AIODATADIST_NET"
ENV_DIRECTORY: Final = "AIODATADIST_DIRECTORY"
ENV_TCP_CONNECTIONS: Final = "AIODATADIST_TCP_CONNECTIONS"
ENV_LIBCUDA: Final = "AIODATADIST_LIBCUDA"


# -- parsers: raw string -> value, or ValueError ---------------------------------------------------------
def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a serving engine's worker pinned to one core); the
    machine's count where the platform has no affinity."""
    try:
        return len(os.sched_getaffinity(0)) or os.cpu_count() or 2
    except (AttributeError, OSError):
        return os.cpu_count() or 2


def _cpus() -> int:
    return usable_cpus()


def _default_copy_threads() -> int:
    return max(2, min(8, _cpus()))


def _default_tcp_connections() -> int:
    # on two cores, two connections moved 256 MiB 1.2x and 2 MiB 1.5x faster than one
    return max(2, min(4, _cpus()))


def _choice(raw: str, choices: tuple[str, ...]) -> str:
    if raw not in choices:
        raise ValueError(raw)
    return raw


def _digits(raw: str, low: int, high: int) -> int:
    """A decimal integer in [``low``, ``high``] (digits only: no sign, no spaces)."""
    if not (raw.isascii() and raw.isdigit()) or not low <= int(raw) <= high:
        raise ValueError(raw)
    return int(raw)


def parse_net(raw: str) -> bool:
    """``"native"`` / ``"python"`` -> whether TCP links use the native helper's I/O threads."""
    return _choice(raw, NET_IMPLEMENTATIONS) == "native"


def parse_directory(raw: str) -> bool:
    return _choice(raw, ("0", "1")) == "1"


def parse_tcp_connections(raw: str) -> int:
    return _digits(raw, 1, MAX_TCP_CONNECTIONS)


def _parse_executor(raw: str) -> str:
    return _choice(raw, ("native", "python"))


def _same_host_names(raw: str) -> list[str]:
    return [v.strip() for v in raw.split(",") if v.strip()]


def _parse_same_host(raw: str) -> frozenset[str]:
    names = _same_host_names(raw)
    if any(n not in SAME_HOST_MECHANISMS for n in names):
        raise ValueError(raw)
    return frozenset(names)


def _salvage_same_host(raw: str) -> frozenset[str]:
    """An unknown name is ignored, the known ones kept (a restriction with a typo still restricts)."""
    return frozenset(_same_host_names(raw)) & SAME_HOST_MECHANISMS


def _clamp(bound: int) -> Callable[[str], int | None]:
    """A number above ``bound`` becomes ``bound``; anything else invalid gives the default."""
    def salvage(raw: str) -> int | None:
        return bound if raw.isascii() and raw.isdigit() and int(raw) > bound else None
    return salvage


def _parse_libcuda(raw: str) -> tuple[str, ...]:
    return tuple(p for p in raw.split(os.pathsep) if p)


def describe_value(value: Any) -> str:
    """A knob's value as ``info`` prints it."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, frozenset):
        return ",".join(sorted(value)) or "(none)"
    if isinstance(value, tuple):
        return os.pathsep.join(value) or "(search)"
    return str(value)


@dataclass(frozen=True, slots=True)
class Knob:
    """One ``AIODATADIST_*`` variable: how it parses and what an invalid value does."""

    env: str
    field: str  # the EnvKnobs field it sets
    accepted: str  # the accepted values, in words (error and warning messages)
    default: Callable[[], Any]
    parse: Callable[[str], Any]
    on_invalid: Literal["error", "warning", "none"]
    option: str | None = None  # the option key it is the process-wide default of
    salvage: Callable[[str], Any] | None = None  # "warning" knobs: what an invalid value gives (None: default)
    empty_is_unset: bool = True
    help: str = ""
    show: Callable[[Any], str] = describe_value  # the value as info prints it, in the variable's terms


KNOBS: Final[tuple[Knob, ...]] = (
    Knob(ENV_EXECUTOR, "executor", '"native" or "python"', lambda: "native", _parse_executor, "warning",
         help="copy executor: the helper's native pool, or Python threads"),
    Knob(ENV_COPY_THREADS, "copy_threads", f"an integer in [1, {MAX_COPY_THREADS}]", _default_copy_threads,
         lambda raw: _digits(raw, 1, MAX_COPY_THREADS), "warning", salvage=_clamp(MAX_COPY_THREADS),
         help="copy threads (default: one per CPU the process may run on, 2 to 8)"),
    Knob(ENV_COPY_NICE, "copy_nice", f"an integer in [0, {MAX_COPY_NICE}]", lambda: 10,
         lambda raw: _digits(raw, 0, MAX_COPY_NICE), "warning", salvage=_clamp(MAX_COPY_NICE),
         help="how much lower the native copy threads' priority is"),
    Knob(ENV_COPY_SPIN_US, "copy_spin_us", f"an integer in [0, {MAX_COPY_SPIN_US}] (microseconds)",
         lambda: 200,
         lambda raw: _digits(raw, 0, MAX_COPY_SPIN_US), "warning", salvage=_clamp(MAX_COPY_SPIN_US),
         help="how long an idle native copy thread spins before sleeping (us)"),
    Knob(ENV_SAME_HOST, "same_host", 'a comma-separated list of "map", "pvm" and "fds" (empty: none)',
         lambda: SAME_HOST_MECHANISMS, _parse_same_host, "warning", empty_is_unset=False,
         salvage=_salvage_same_host,
         help="same-host mechanisms this process may use"),
    Knob(ENV_NET, "native_net", '"native" or "python"', lambda: True, parse_net, "error",
         option=OptionKey.NET,
         show=lambda native: "native" if native else "python",
         help="TCP data plane: native I/O threads (with one-sided reads) or Python threads"),
    Knob(ENV_DIRECTORY, "directory", '"0" or "1"', lambda: True, parse_directory, "error",
         option=OptionKey.DIRECTORY, help="same-host requesters read the owner's cache directory"),
    Knob(ENV_TCP_CONNECTIONS, "tcp_connections", f"an integer in [1, {MAX_TCP_CONNECTIONS}]",
         _default_tcp_connections, parse_tcp_connections, "error", option=OptionKey.TCP_CONNECTIONS,
         help="data connections per TCP link, set by its server (default: one per CPU the process may run on, 2 to 4)"),
    Knob(ENV_LIBCUDA, "libcuda", "paths of the CUDA driver library", lambda: (), _parse_libcuda, "none",
         help="CUDA driver library to load (default: search)"),
)
_BY_ENV: Final = {k.env: k for k in KNOBS}


@dataclass(frozen=True, slots=True)
class EnvKnobs:
    """Every ``AIODATADIST_*`` variable, parsed (defaults where unset or invalid: see the module docstring)."""

    executor: str = "native"
    copy_threads: int = field(default_factory=_default_copy_threads)
    copy_nice: int = 10
    copy_spin_us: int = 200
    same_host: frozenset[str] = SAME_HOST_MECHANISMS
    native_net: bool = True
    directory: bool = True
    tcp_connections: int = field(default_factory=_default_tcp_connections)
    libcuda: tuple[str, ...] = ()
    raw: Mapping[str, str] = field(default_factory=dict, compare=False)  # the variables that were set
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)  # env name -> where the value is from
    errors: Mapping[str, str] = field(default_factory=dict, compare=False)  # env name -> why ("error" knobs)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> EnvKnobs:
        """Parse ``environ`` (``os.environ`` or a test's dict); logs a warning per invalid "warning" knob."""
        values: dict[str, Any] = {}
        raw: dict[str, str] = {}
        sources: dict[str, str] = {}
        errors: dict[str, str] = {}
        for knob in KNOBS:
            value = environ.get(knob.env)
            sources[knob.env] = "default"
            if value is None:
                continue
            raw[knob.env] = value
            if value == "" and knob.empty_is_unset:
                sources[knob.env] = "default (set but empty)"
                continue
            try:
                values[knob.field] = knob.parse(value)
                sources[knob.env] = "env"
                continue
            except ValueError:
                pass
            message = f"environment variable {knob.env} must be {knob.accepted}, but got {value!r}"
            if knob.on_invalid == "error":
                errors[knob.env] = (f"{message} (it is the default of option {knob.option}; set that "
                                    "option or fix the variable).")
                sources[knob.env] = f"default; INVALID {value!r}: init raises unless {knob.option} is given"
                continue
            salvaged = knob.salvage(value) if knob.salvage is not None else None
            if salvaged is not None:
                values[knob.field] = salvaged
                log.warning("%s; using %s", message, describe_value(salvaged))
                sources[knob.env] = f"env, invalid {value!r} read as {describe_value(salvaged)} (warned)"
            else:
                log.warning("%s; using the default, %s", message, describe_value(knob.default()))
                sources[knob.env] = f"default; invalid {value!r} ignored (warned)"
        return cls(**values, raw=raw, sources=sources, errors=errors)

    def check(self, env: str) -> None:
        """Raise ``LLMException(LLM_PARAM_INVALID)`` if variable ``env`` has an invalid value."""
        message = self.errors.get(env)
        if message is not None:
            raise LLMException(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)

    def report(self) -> list[tuple[Knob, str, str]]:
        """``(knob, value as text, where it came from)`` for every knob, in :data:`KNOBS` order."""
        return [(k, k.show(getattr(self, k.field)), self.sources.get(k.env, "default")) for k in KNOBS]


_NAMES: Final = tuple(k.env for k in KNOBS)


@functools.lru_cache(maxsize=8)
def _parsed(values: tuple[str | None, ...]) -> EnvKnobs:
    return EnvKnobs.from_environ({n: v for n, v in zip(_NAMES, values) if v is not None})


def env_knobs() -> EnvKnobs:
    """The ``AIODATADIST_*`` variables of this process, parsed once per distinct set of values (a warning is
    logged once, not at every use; a test that sets a variable gets it re-read)."""
    return _parsed(tuple(os.environ.get(name) for name in _NAMES))


env_knobs_cache_clear = _parsed.cache_clear  # tests: forget parsed values (so warnings are logged again)


# -- options ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CurveKeys:
    """ZeroMQ CURVE on the control plane (``llm.CurveSecretKey`` + ``llm.CurvePeerKeys``; docs/security.md).

    Keys are Z85 text (bytes), as ZeroMQ's socket options take them."""

    secret_key: bytes = field(repr=False)
    public_key: bytes  # derived from the secret key (zmq.curve_public)
    peers: tuple[tuple[int | None, bytes], ...]  # (cluster id, or None for any, public key)

    def server_key(self, cluster_id: int) -> bytes | None:
        """The public key a client expects from the server of cluster ``cluster_id``: the one listed for that id,
        else the only one listed without an id; None when there is none (or several) to choose from."""
        for cluster, key in self.peers:
            if cluster == cluster_id:
                return key
        unbound = {key for cluster, key in self.peers if cluster is None}
        return unbound.pop() if len(unbound) == 1 else None

    def clusters_of(self, public_key: bytes) -> frozenset[int] | None:
        """Server side: the cluster ids a client with ``public_key`` may claim; None = any (listed without an
        id); empty = the key is not trusted at all."""
        ids: set[int] = set()
        for cluster, key in self.peers:
            if key == public_key:
                if cluster is None:
                    return None
                ids.add(cluster)
        return frozenset(ids)

    def trusts(self, public_key: bytes) -> bool:
        return any(key == public_key for _, key in self.peers)


_curve_warned = False


def _curve(opts: dict[str, str], transport: Transport) -> CurveKeys | None:
    """The CURVE keys of ``opts``: both options or neither; an empty value is refused, never read as "off"."""
    secret = opts.get(OptionKey.CURVE_SECRET_KEY)
    peers = opts.get(OptionKey.CURVE_PEER_KEYS)
    if secret is None and peers is None:
        return None
    require(secret is not None, f"option {OptionKey.CURVE_PEER_KEYS} needs {OptionKey.CURVE_SECRET_KEY} (this "
            "instance's own CURVE secret key).")
    require(peers is not None and peers != "", f"option {OptionKey.CURVE_SECRET_KEY} needs "
            f"{OptionKey.CURVE_PEER_KEYS} (the public keys of the peers this instance trusts).")
    assert secret is not None and peers is not None
    if not zmq.has("curve"):
        raise LLMException(f"option {OptionKey.CURVE_SECRET_KEY}: this pyzmq/libzmq ({zmq.zmq_version()}) was built "
                           "without CURVE security (zmq.has('curve') is False).",
                           status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
    try:
        secret_key = parse_curve_key(secret)
    except ValueError as exc:  # the value itself is never put in the message: it is a secret
        raise LLMException(f"option {OptionKey.CURVE_SECRET_KEY} must be a Z85-encoded CURVE secret key "
                           f"(zmq.curve_keypair()[1]): {exc}.",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
    try:
        trusted = parse_curve_peer_keys(peers)
    except ValueError as exc:
        raise LLMException(f"option {OptionKey.CURVE_PEER_KEYS} must be comma-separated PUBLIC_KEY or "
                           f"CLUSTER_ID=PUBLIC_KEY entries (Z85 CURVE public keys): {exc}.",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
    global _curve_warned  # once per process
    if not _curve_warned and transport is not Transport.SHM:
        _curve_warned = True
        log.warning("CURVE encrypts and authenticates the control plane only: the TCP data plane still carries "
                    "KV cache bytes in the clear (see docs/security.md; use IPsec/WireGuard on untrusted networks)")
    return CurveKeys(secret_key, zmq.curve_public(secret_key), trusted)


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
    knob = _BY_ENV[env]
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
    curve = _curve(opts, Transport(transport_value))
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
        link_total_time_s=link_total_time,
        raw=opts,
        curve=curve,
    )
