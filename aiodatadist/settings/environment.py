"""The ``AIODATADIST_*`` environment variables: :func:`env_knobs` -> :class:`EnvKnobs`.

Every ``AIODATADIST_*`` variable is read and parsed here and nowhere else.  Each has one parser, shared with
the option key it defaults (if any; :mod:`aiodatadist.settings.options` parses the options), so a value means the same
in the environment and in the options.

An invalid value is never silently replaced by the default:

* The three variables that act per link (``AIODATADIST_NET``, ``AIODATADIST_DIRECTORY``,
  ``AIODATADIST_TCP_CONNECTIONS``) are the process-wide defaults of the options ``llm.Net``,
  ``llm.Directory`` and ``llm.TcpConnections``.  An invalid value is an **error**: ``init`` raises
  ``LLMException(LLM_PARAM_INVALID)`` naming the variable and its accepted values, exactly as for an invalid
  option, unless the instance's options set that key (then the variable is not used).
* The process-wide ones (``AIODATADIST_EXECUTOR``, ``AIODATADIST_COPY_*``, ``AIODATADIST_SAME_HOST``,
  ``AIODATADIST_POLL_US``, ``AIODATADIST_TCP_CONGESTION``, ``AIODATADIST_HUGE_PAGES``) are read
  deep inside other calls (the first ``init`` building the copy executor, a link probing its peer) where an
  exception would fail an unrelated operation, and each has a safe default; an invalid value logs a
  **warning** (logger ``aiodatadist.settings``) naming the variable, the accepted values and the value used
  instead.  A number above its bound is read as the bound, and an unknown same-host mechanism is dropped (the
  known ones still restrict), with a warning too: both did so silently before.
* ``AIODATADIST_LIBCUDA`` and ``AIODATADIST_LIBASCENDCL`` take any value (a list of library paths);
  ``AIODATADIST_DEVICE_RUNTIME`` (``auto``, ``cuda`` or ``acl``) is process-wide too: an invalid value warns and
  reads as ``auto``.

An empty value counts as unset, except for ``AIODATADIST_SAME_HOST`` where it means "no mechanism".
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from ..errors import LLMException, LLMStatusCode
from .keys import MAX_TCP_CONNECTIONS, NET_IMPLEMENTATIONS, OptionKey

__all__ = [
    "DEVICE_RUNTIMES",
    "ENV_COPY_NICE",
    "ENV_COPY_SPIN_US",
    "ENV_COPY_THREADS",
    "ENV_DEVICE_RUNTIME",
    "ENV_DIRECTORY",
    "ENV_EXECUTOR",
    "ENV_HUGE_PAGES",
    "ENV_LIBASCENDCL",
    "ENV_LIBCUDA",
    "ENV_NET",
    "ENV_POLL_US",
    "ENV_SAME_HOST",
    "ENV_STAGING_BYTES",
    "ENV_TCP_CONGESTION",
    "ENV_TCP_CONNECTIONS",
    "HUGE_PAGE_MODES",
    "KNOBS",
    "SAME_HOST_MECHANISMS",
    "EnvKnobs",
    "Knob",
    "default_unless_set",
    "describe_value",
    "env_knobs",
    "env_knobs_cache_clear",
    "knob_of",
    "usable_cpus",
]

log = logging.getLogger("aiodatadist.settings")

MAX_COPY_THREADS: Final = 64
MAX_COPY_NICE: Final = 19
MAX_COPY_SPIN_US: Final = 100_000
MAX_POLL_US: Final = 100_000
SAME_HOST_MECHANISMS: Final = frozenset({"map", "pvm", "fds"})  # fds: segments handed over a Unix socket

ENV_EXECUTOR: Final = "AIODATADIST_EXECUTOR"
ENV_COPY_THREADS: Final = "AIODATADIST_COPY_THREADS"
ENV_COPY_NICE: Final = "AIODATADIST_COPY_NICE"
ENV_COPY_SPIN_US: Final = "AIODATADIST_COPY_SPIN_US"
ENV_POLL_US: Final = "AIODATADIST_POLL_US"
ENV_SAME_HOST: Final = "AIODATADIST_SAME_HOST"
ENV_NET: Final = "AIODATADIST_NET"
ENV_DIRECTORY: Final = "AIODATADIST_DIRECTORY"
ENV_TCP_CONNECTIONS: Final = "AIODATADIST_TCP_CONNECTIONS"
ENV_STAGING_BYTES: Final = "AIODATADIST_STAGING_BYTES"
MIN_STAGING_BYTES: Final = 4 << 20  # two slots
MAX_STAGING_BYTES: Final = 1 << 40
ENV_TCP_CONGESTION: Final = "AIODATADIST_TCP_CONGESTION"
ENV_LIBCUDA: Final = "AIODATADIST_LIBCUDA"
ENV_LIBASCENDCL: Final = "AIODATADIST_LIBASCENDCL"
ENV_DEVICE_RUNTIME: Final = "AIODATADIST_DEVICE_RUNTIME"
DEVICE_RUNTIMES: Final = ("auto", "cuda", "acl")
"""Which device runtime ``Placement.DEVICE`` caches use (``AIODATADIST_DEVICE_RUNTIME``): ``auto`` takes the one
that has a device (CUDA when both do), ``cuda`` the NVIDIA driver, ``acl`` Ascend's ACL runtime."""
ENV_HUGE_PAGES: Final = "AIODATADIST_HUGE_PAGES"
HUGE_PAGE_MODES: Final = ("try", "on", "off")
"""How host caches and host memory may use the system's huge pages (``AIODATADIST_HUGE_PAGES``): ``try`` where they
are free (ordinary pages otherwise), ``on`` (or fail with ``LLM_OUT_OF_MEMORY``), ``off`` (never); the names of
PostgreSQL's ``huge_pages`` setting."""


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


def _parse_congestion(raw: str) -> str:
    """``auto``, ``system``, or an algorithm's name as the kernel spells them (lower case, at most 15 characters)."""
    if raw in ("auto", "system") or (0 < len(raw) < 16 and raw.isascii()
                                     and all(c.islower() or c.isdigit() or c == "_" for c in raw)):
        return raw
    raise ValueError(raw)


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
    Knob(ENV_POLL_US, "poll_us", f"an integer in [0, {MAX_POLL_US}] (microseconds)", lambda: 300,
         lambda raw: _digits(raw, 0, MAX_POLL_US), "warning", salvage=_clamp(MAX_POLL_US),
         help="a transfer expected to end within this time is awaited with the event loop polling, not "
              "sleeping (us; 0: never)"),
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
    Knob(ENV_TCP_CONGESTION, "tcp_congestion", '"auto", "system" or a congestion control algorithm\'s name',
         lambda: "auto", _parse_congestion, "warning",
         help="TCP data connections' congestion control (auto: a pacing one (bbr) becomes cubic on "
              "connections to this host)"),
    Knob(ENV_HUGE_PAGES, "huge_pages", '"try", "on" or "off"', lambda: "try",
         lambda raw: _choice(raw, HUGE_PAGE_MODES), "warning",
         help="host caches and host memory on the system's huge pages (hugetlb): where free, else ordinary "
              "pages (try); or fail (on); never (off)"),
    Knob(ENV_STAGING_BYTES, "staging_bytes", f"an integer in [{MIN_STAGING_BYTES}, {MAX_STAGING_BYTES}] (bytes)",
         lambda: 256 << 20, lambda raw: _digits(raw, MIN_STAGING_BYTES, MAX_STAGING_BYTES), "warning",
         salvage=_clamp(MAX_STAGING_BYTES),
         help="page-locked memory this process may hold for staging device caches over TCP links (bytes)"),
    Knob(ENV_LIBCUDA, "libcuda", "paths of the CUDA driver library", lambda: (), _parse_libcuda, "none",
         help="CUDA driver library to load (default: search)"),
    Knob(ENV_LIBASCENDCL, "libascendcl", "paths of the ACL runtime library", lambda: (), _parse_libcuda, "none",
         help="Ascend ACL runtime library (libascendcl.so) to load (default: search)"),
    Knob(ENV_DEVICE_RUNTIME, "device_runtime", '"auto", "cuda" or "acl"', lambda: "auto",
         lambda raw: _choice(raw, DEVICE_RUNTIMES), "warning",
         help="device runtime of Placement.DEVICE caches (auto: the one with a device, CUDA if both)"),
)
_BY_ENV: Final = {k.env: k for k in KNOBS}


def knob_of(env: str) -> Knob:
    """The knob of variable ``env`` (one of the ``ENV_*`` names); KeyError for any other name."""
    return _BY_ENV[env]


@dataclass(frozen=True, slots=True)
class EnvKnobs:
    """Every ``AIODATADIST_*`` variable, parsed (defaults where unset or invalid: see the module docstring)."""

    executor: str = "native"
    copy_threads: int = field(default_factory=_default_copy_threads)
    copy_nice: int = 10
    copy_spin_us: int = 200
    poll_us: int = 300
    same_host: frozenset[str] = SAME_HOST_MECHANISMS
    native_net: bool = True
    directory: bool = True
    tcp_connections: int = field(default_factory=_default_tcp_connections)
    tcp_congestion: str = "auto"
    huge_pages: str = "try"
    staging_bytes: int = 256 << 20
    libcuda: tuple[str, ...] = ()
    libascendcl: tuple[str, ...] = ()
    device_runtime: str = "auto"
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


def default_unless_set(env: str, value: str) -> None:
    """Make ``value`` this process's value of variable ``env`` (one of :data:`KNOBS`) unless the environment sets
    it: for an integration that knows its host better than the library's defaults do.  Only what is read after
    the call sees it (the copy threads, e.g., take their values when the first instance starts them)."""
    if env not in _NAMES:
        raise ValueError(f"{env} is not an aiodatadist environment variable")
    os.environ.setdefault(env, value)


env_knobs_cache_clear = _parsed.cache_clear  # tests: forget parsed values (so warnings are logged again)
