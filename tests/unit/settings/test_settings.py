"""Settings: the ``AIODATADIST_*`` environment variables (``EnvKnobs``), the per-link options that they
default (``llm.Net``, ``llm.Directory``, ``llm.TcpConnections``), and what ``parse_options`` keeps."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest

import aiodatadist
from aiodatadist import LLMConfig, LLMException, LLMStatusCode
from aiodatadist.config import MAX_TCP_CONNECTIONS, OptionKey
from aiodatadist.settings import environment as env_module
from aiodatadist.settings.environment import (
    KNOBS,
    EnvKnobs,
    default_unless_set,
    env_knobs,
    env_knobs_cache_clear,
)
from aiodatadist.settings.options import Settings, parse_options

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID
LOGGER = "aiodatadist.settings"
CPUS = len(os.sched_getaffinity(0))
NAMES = [k.env for k in KNOBS]


def knobs(**env: str) -> EnvKnobs:
    return EnvKnobs.from_environ(env)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


# -- the knobs -----------------------------------------------------------------------------------------
def test_every_variable_is_a_knob() -> None:
    assert NAMES == [
        "AIODATADIST_EXECUTOR", "AIODATADIST_COPY_THREADS", "AIODATADIST_COPY_NICE",
        "AIODATADIST_COPY_SPIN_US", "AIODATADIST_POLL_US",
        "AIODATADIST_SAME_HOST", "AIODATADIST_NET", "AIODATADIST_DIRECTORY", "AIODATADIST_TCP_CONNECTIONS",
        "AIODATADIST_TCP_CONGESTION", "AIODATADIST_HUGE_PAGES", "AIODATADIST_STAGING_BYTES", "AIODATADIST_LIBCUDA",
        "AIODATADIST_LIBASCENDCL", "AIODATADIST_DEVICE_RUNTIME",
    ]
    assert {k.field for k in KNOBS} <= set(EnvKnobs.__dataclass_fields__)


def test_defaults_are_those_of_before(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    k = knobs()
    assert k.executor == "native"
    assert k.copy_threads == max(2, min(8, CPUS))
    assert k.copy_nice == 10
    assert k.copy_spin_us == 200
    assert k.poll_us == 300
    assert k.same_host == frozenset({"map", "pvm", "fds"})
    assert k.native_net is True
    assert k.directory is True
    assert k.tcp_connections == max(2, min(4, CPUS))
    assert k.tcp_congestion == "auto"
    assert k.huge_pages == "try"
    assert k.libcuda == ()
    assert k == EnvKnobs()
    assert all(getattr(k, knob.field) == knob.default() for knob in KNOBS)
    assert all(k.sources[name] == "default" for name in NAMES)
    assert not k.errors and not warnings(caplog)


@pytest.mark.parametrize(("env", "raw", "field", "value"), [
    ("AIODATADIST_EXECUTOR", "python", "executor", "python"),
    ("AIODATADIST_EXECUTOR", "native", "executor", "native"),
    ("AIODATADIST_COPY_THREADS", "1", "copy_threads", 1),
    ("AIODATADIST_COPY_THREADS", "64", "copy_threads", 64),
    ("AIODATADIST_COPY_NICE", "0", "copy_nice", 0),
    ("AIODATADIST_COPY_NICE", "19", "copy_nice", 19),
    ("AIODATADIST_COPY_SPIN_US", "0", "copy_spin_us", 0),
    ("AIODATADIST_COPY_SPIN_US", "100000", "copy_spin_us", 100_000),
    ("AIODATADIST_POLL_US", "0", "poll_us", 0),
    ("AIODATADIST_POLL_US", "100000", "poll_us", 100_000),
    ("AIODATADIST_TCP_CONGESTION", "system", "tcp_congestion", "system"),
    ("AIODATADIST_TCP_CONGESTION", "cubic", "tcp_congestion", "cubic"),
    ("AIODATADIST_TCP_CONGESTION", "dctcp", "tcp_congestion", "dctcp"),
    ("AIODATADIST_HUGE_PAGES", "on", "huge_pages", "on"),
    ("AIODATADIST_HUGE_PAGES", "off", "huge_pages", "off"),
    ("AIODATADIST_HUGE_PAGES", "try", "huge_pages", "try"),
    ("AIODATADIST_STAGING_BYTES", "4194304", "staging_bytes", 4 << 20),
    ("AIODATADIST_STAGING_BYTES", "1073741824", "staging_bytes", 1 << 30),
    ("AIODATADIST_SAME_HOST", "map", "same_host", frozenset({"map"})),
    ("AIODATADIST_SAME_HOST", " pvm , map ", "same_host", frozenset({"map", "pvm"})),
    ("AIODATADIST_SAME_HOST", "", "same_host", frozenset()),  # empty: no same-host mechanism
    ("AIODATADIST_NET", "python", "native_net", False),
    ("AIODATADIST_NET", "native", "native_net", True),
    ("AIODATADIST_DIRECTORY", "0", "directory", False),
    ("AIODATADIST_DIRECTORY", "1", "directory", True),
    ("AIODATADIST_TCP_CONNECTIONS", "1", "tcp_connections", 1),
    ("AIODATADIST_TCP_CONNECTIONS", "16", "tcp_connections", 16),
    ("AIODATADIST_LIBCUDA", f"/a/libcuda.so{os.pathsep}/b/libcuda.so.1", "libcuda",
     ("/a/libcuda.so", "/b/libcuda.so.1")),
])
def test_valid_values(env: str, raw: str, field: str, value: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    k = knobs(**{env: raw})
    assert getattr(k, field) == value
    assert k.sources[env] == "env"
    assert k.raw == {env: raw}
    assert not k.errors and not warnings(caplog)


@pytest.mark.parametrize("env", [k.env for k in KNOBS if k.empty_is_unset])
def test_an_empty_value_is_unset(env: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    k = knobs(**{env: ""})
    assert k == EnvKnobs()
    assert k.sources[env].startswith("default")
    assert not k.errors and not warnings(caplog)


@pytest.mark.parametrize(("env", "raw", "field", "value", "accepted"), [
    ("AIODATADIST_EXECUTOR", "Python", "executor", "native", '"native" or "python"'),
    ("AIODATADIST_EXECUTOR", "cuda", "executor", "native", '"native" or "python"'),
    ("AIODATADIST_COPY_THREADS", "0", "copy_threads", max(2, min(8, CPUS)), "[1, 64]"),
    ("AIODATADIST_COPY_THREADS", "four", "copy_threads", max(2, min(8, CPUS)), "[1, 64]"),
    ("AIODATADIST_COPY_THREADS", "-3", "copy_threads", max(2, min(8, CPUS)), "[1, 64]"),
    ("AIODATADIST_COPY_THREADS", "100", "copy_threads", 64, "[1, 64]"),  # clamped, as before, but said
    ("AIODATADIST_COPY_NICE", "x", "copy_nice", 10, "[0, 19]"),
    ("AIODATADIST_COPY_NICE", "25", "copy_nice", 19, "[0, 19]"),
    ("AIODATADIST_COPY_SPIN_US", "1.5", "copy_spin_us", 200, "[0, 100000]"),
    ("AIODATADIST_COPY_SPIN_US", "200000", "copy_spin_us", 100_000, "[0, 100000]"),
    ("AIODATADIST_POLL_US", "-1", "poll_us", 300, "[0, 100000]"),
    ("AIODATADIST_POLL_US", "250000", "poll_us", 100_000, "[0, 100000]"),
    ("AIODATADIST_TCP_CONGESTION", "Cubic", "tcp_congestion", "auto", "a congestion control algorithm"),
    ("AIODATADIST_TCP_CONGESTION", "bbr; rm", "tcp_congestion", "auto", "a congestion control algorithm"),
    ("AIODATADIST_TCP_CONGESTION", "x" * 16, "tcp_congestion", "auto", "a congestion control algorithm"),
    ("AIODATADIST_HUGE_PAGES", "ON", "huge_pages", "try", '"try", "on" or "off"'),
    ("AIODATADIST_HUGE_PAGES", "1", "huge_pages", "try", '"try", "on" or "off"'),
    ("AIODATADIST_STAGING_BYTES", "1000", "staging_bytes", 256 << 20, "[4194304, 1099511627776]"),
    ("AIODATADIST_STAGING_BYTES", "64MiB", "staging_bytes", 256 << 20, "[4194304, 1099511627776]"),
    ("AIODATADIST_SAME_HOST", "map,mmap", "same_host", frozenset({"map"}), '"map", "pvm" and "fds"'),
    ("AIODATADIST_SAME_HOST", "shm", "same_host", frozenset(), '"map", "pvm" and "fds"'),
])
def test_an_invalid_process_wide_value_warns(env: str, raw: str, field: str, value: Any, accepted: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    k = knobs(**{env: raw})
    assert getattr(k, field) == value
    assert not k.errors
    [message] = warnings(caplog)
    assert env in message and repr(raw) in message and accepted in message
    assert "using" in message
    assert f"invalid {raw!r}" in k.sources[env]


@pytest.mark.parametrize(("env", "raw", "option", "accepted"), [
    ("AIODATADIST_NET", "py", "llm.Net", '"native" or "python"'),
    ("AIODATADIST_NET", "PYTHON", "llm.Net", '"native" or "python"'),
    ("AIODATADIST_DIRECTORY", "off", "llm.Directory", '"0" or "1"'),
    ("AIODATADIST_DIRECTORY", "2", "llm.Directory", '"0" or "1"'),
    ("AIODATADIST_TCP_CONNECTIONS", "0", "llm.TcpConnections", "[1, 16]"),
    ("AIODATADIST_TCP_CONNECTIONS", "17", "llm.TcpConnections", "[1, 16]"),
    ("AIODATADIST_TCP_CONNECTIONS", "many", "llm.TcpConnections", "[1, 16]"),
])
def test_an_invalid_per_link_value_is_an_error_at_init(env: str, raw: str, option: str, accepted: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    k = knobs(**{env: raw})  # parsing never raises: info must still show everything
    assert env in k.errors and not warnings(caplog)
    assert "INVALID" in k.sources[env]
    with pytest.raises(LLMException) as info:
        parse_options({}, k)
    assert info.value.status_code is PARAM_INVALID
    message = str(info.value)
    assert env in message and accepted in message and repr(raw) in message and option in message
    # the instance's own option makes the variable irrelevant
    good = {"llm.Net": "native", "llm.Directory": "1", "llm.TcpConnections": "3"}[option]
    parse_options({option: good}, k)


def test_env_knobs_reads_the_environment_and_parses_each_value_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    assert env_knobs() == EnvKnobs()
    monkeypatch.setenv("AIODATADIST_COPY_NICE", "oops")
    env_knobs_cache_clear()
    assert env_knobs().copy_nice == 10
    assert env_knobs() is env_knobs()  # parsed once: one warning, not one per use
    assert len(warnings(caplog)) == 1
    monkeypatch.setenv("AIODATADIST_COPY_NICE", "3")  # a changed variable is read again
    assert env_knobs().copy_nice == 3
    env_knobs_cache_clear()


# -- the per-link options ------------------------------------------------------------------------------
def test_per_link_settings_default_to_the_variables() -> None:
    s = parse_options({}, knobs())
    assert (s.native_net, s.directory, s.tcp_connections) == (True, True, max(2, min(4, CPUS)))
    k = knobs(AIODATADIST_NET="python", AIODATADIST_DIRECTORY="0", AIODATADIST_TCP_CONNECTIONS="5")
    s = parse_options({}, k)
    assert (s.native_net, s.directory, s.tcp_connections) == (False, False, 5)


def test_an_integration_default_yields_to_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODATADIST_COPY_NICE", "1")  # recorded, so that the test's own value is undone
    monkeypatch.delenv("AIODATADIST_COPY_NICE")
    default_unless_set("AIODATADIST_COPY_NICE", "0")
    assert env_knobs().copy_nice == 0
    monkeypatch.setenv("AIODATADIST_COPY_NICE", "5")
    default_unless_set("AIODATADIST_COPY_NICE", "0")
    assert env_knobs().copy_nice == 5
    with pytest.raises(ValueError, match="AIODATADIST_NOPE"):
        default_unless_set("AIODATADIST_NOPE", "1")
    assert "AIODATADIST_NOPE" not in os.environ


def test_parse_options_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODATADIST_TCP_CONNECTIONS", "7")
    monkeypatch.setenv("AIODATADIST_NET", "python")
    s = parse_options({})
    assert s.tcp_connections == 7 and s.native_net is False
    monkeypatch.setenv("AIODATADIST_NET", "nope")
    with pytest.raises(LLMException) as info:
        parse_options({})
    assert info.value.status_code is PARAM_INVALID


def test_options_override_the_variables() -> None:
    k = knobs(AIODATADIST_NET="python", AIODATADIST_DIRECTORY="0", AIODATADIST_TCP_CONNECTIONS="5")
    s = parse_options({"llm.Net": "native", "llm.Directory": "1", "llm.TcpConnections": "2"}, k)
    assert (s.native_net, s.directory, s.tcp_connections) == (True, True, 2)
    s = parse_options({"llm.Net": "python", "llm.Directory": "0", "llm.TcpConnections": "16"}, knobs())
    assert (s.native_net, s.directory, s.tcp_connections) == (False, False, 16)


def test_two_instances_in_one_process_can_differ() -> None:
    k = knobs(AIODATADIST_TCP_CONNECTIONS="4")
    a = LLMConfig()
    a.net = "python"
    a.directory = False
    a.tcp_connections = 1
    b = LLMConfig()
    b.net = "native"
    first, second, third = (parse_options(a.generate_options(), k), parse_options(b.generate_options(), k),
                            parse_options(LLMConfig().generate_options(), k))
    assert (first.native_net, first.directory, first.tcp_connections) == (False, False, 1)
    assert (second.native_net, second.directory, second.tcp_connections) == (True, True, 4)
    assert (third.native_net, third.directory, third.tcp_connections) == (True, True, 4)
    assert first != second


@pytest.mark.parametrize(("key", "value"), [
    ("llm.Net", "py"), ("llm.Net", ""), ("llm.Net", "Native"),
    ("llm.Directory", "true"), ("llm.Directory", ""), ("llm.Directory", "2"),
    ("llm.TcpConnections", "0"), ("llm.TcpConnections", "17"), ("llm.TcpConnections", ""),
    ("llm.TcpConnections", "-1"), ("llm.TcpConnections", " 2"),
])
def test_bad_per_link_options(key: str, value: str) -> None:
    with pytest.raises(LLMException) as info:
        parse_options({key: value}, knobs())
    assert info.value.status_code is PARAM_INVALID
    assert key in str(info.value)


def test_option_keys() -> None:
    assert (OptionKey.NET, OptionKey.DIRECTORY, OptionKey.TCP_CONNECTIONS) == (
        "llm.Net", "llm.Directory", "llm.TcpConnections")
    assert [k.option for k in KNOBS if k.option] == [
        OptionKey.NET, OptionKey.DIRECTORY, OptionKey.TCP_CONNECTIONS]


def test_config_properties_unset() -> None:
    cfg = LLMConfig()
    assert cfg.net is None and cfg.directory is None and cfg.tcp_connections is None
    opts = cfg.generate_options()
    assert not {"llm.Net", "llm.Directory", "llm.TcpConnections"} & set(opts)


def test_config_properties_emit_their_keys() -> None:
    cfg = LLMConfig()
    cfg.net = "python"
    cfg.directory = False
    cfg.tcp_connections = 16
    assert (cfg.net, cfg.directory, cfg.tcp_connections) == ("python", False, 16)
    opts = cfg.generate_options()
    assert (opts["llm.Net"], opts["llm.Directory"], opts["llm.TcpConnections"]) == ("python", "0", "16")
    cfg.directory = True
    assert cfg.generate_options()["llm.Directory"] == "1"


@pytest.mark.parametrize(("name", "value", "error"), [
    ("net", "py", LLMException),
    ("net", "", LLMException),
    ("net", 1, TypeError),
    ("net", None, TypeError),
    ("directory", "0", TypeError),
    ("directory", 1, TypeError),
    ("tcp_connections", 0, LLMException),
    ("tcp_connections", 17, LLMException),
    ("tcp_connections", -1, ValueError),
    ("tcp_connections", "4", TypeError),
    ("tcp_connections", 2.0, TypeError),
])
def test_config_properties_validate(name: str, value: Any, error: type[Exception]) -> None:
    cfg = LLMConfig()
    with pytest.raises(error):
        setattr(cfg, name, value)
    assert getattr(cfg, name) is None


def test_the_connection_bound_is_the_data_planes() -> None:
    from aiodatadist.transport.tcp.python_connections import MAX_DATA_CONNECTIONS

    assert MAX_TCP_CONNECTIONS == MAX_DATA_CONNECTIONS == 16


# -- what parse_options keeps --------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "flag"), [
    ({}, None),
    ({"llm.EnableRemoteCacheAccessible": "1"}, True),
    ({"llm.EnableRemoteCacheAccessible": "0"}, False),
    ({"llm.LocalCommRes": ""}, True),
    ({"llm.LocalCommRes": "", "llm.EnableRemoteCacheAccessible": "0"}, False),
])
def test_remote_accessible_keeps_its_unset_state(options: dict[str, str], flag: bool | None) -> None:
    assert parse_options(options, knobs()).enable_remote_cache_accessible is flag


def test_remote_accessible_from_config() -> None:
    cfg = LLMConfig()
    assert parse_options(cfg.generate_options(), knobs()).enable_remote_cache_accessible is None
    cfg.enable_remote_cache_accessible = False
    assert parse_options(cfg.generate_options(), knobs()).enable_remote_cache_accessible is False


def test_local_comm_res_presence() -> None:
    assert parse_options({}, knobs()).has_local_comm_res is False
    assert parse_options({"llm.LocalCommRes": ""}, knobs()).has_local_comm_res is True


def test_unused_settings_are_gone_but_their_options_still_validated() -> None:
    """EnableSwitchRole and LinkRetryCount are only validated; LinkTotalTime bounds a two-sided link's bring-up."""
    fields = set(Settings.__dataclass_fields__)
    assert not {"enable_switch_role", "link_retry_count"} & fields
    settings = parse_options({"llm.EnableSwitchRole": "1", "llm.LinkTotalTime": "7", "llm.LinkRetryCount": "3"},
                             knobs())
    assert settings.link_total_time_s == 7
    assert parse_options({}, knobs()).link_total_time_s == 0
    for bad in ({"llm.EnableSwitchRole": "yes"}, {"llm.LinkTotalTime": "-1"}, {"llm.LinkRetryCount": "0"}):
        with pytest.raises(LLMException):
            parse_options(bad, knobs())


# -- info and the one place ----------------------------------------------------------------------------
def test_info_lists_every_knob(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from aiodatadist.cli.info import main

    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIODATADIST_COPY_NICE", "5")
    monkeypatch.setenv("AIODATADIST_NET", "bogus")
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in NAMES:
        assert re.search(rf"^  {name}=\S* +\(", out, re.MULTILINE), name
    assert re.search(r"^  AIODATADIST_COPY_NICE=5 +\(env\)", out, re.MULTILINE)
    assert re.search(r"^  AIODATADIST_COPY_SPIN_US=200 +\(default\)", out, re.MULTILINE)
    assert re.search(r"^  AIODATADIST_NET=native +\(default; INVALID 'bogus'.*llm\.Net", out, re.MULTILINE)
    assert re.search(r"^  AIODATADIST_TCP_CONNECTIONS=\d+ +\(default\) \[llm\.TcpConnections\]", out,
                     re.MULTILINE)
    env_knobs_cache_clear()


def test_no_other_module_reads_an_aiodatadist_variable() -> None:
    root = Path(aiodatadist.__file__).parent
    readers = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel == "settings/environment.py":
            continue
        for line in path.read_text().splitlines():
            if re.search(r"(environ|getenv)\b.*(\"AIODATADIST_|ENV_[A-Z]+)", line):
                readers.add(rel)
    assert not readers, readers
    assert env_module.ENV_LIBCUDA == "AIODATADIST_LIBCUDA"


PINNED_TO_ONE_CPU = """
import os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # a serving engine's worker pinned to one core
os.cpu_count = lambda: 16  # on a large host
from aiodatadist.cli import info
from aiodatadist.settings.environment import env_knobs
knobs = env_knobs()
print("knobs", knobs.copy_threads, knobs.tcp_connections, flush=True)
sys.exit(info.main([]))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_default_copy_threads_and_connections_follow_the_allowed_cpus() -> None:
    """The defaults are sized by the CPUs the process may run on, not ``os.cpu_count()``: a worker pinned to one
    core of a 16-CPU host must not get 8 copy threads and 4 connections per TCP link."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", PINNED_TO_ONE_CPU], check=False, capture_output=True, text=True,
                          timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith("AIODATADIST_")})
    assert proc.returncode == 0, proc.stderr
    assert "knobs 2 2\n" in proc.stdout
    assert "with 2 threads" in proc.stdout
    assert "cpus: 1 usable (affinity) of 16" in proc.stdout
    import shutil

    if shutil.which("taskset") is not None:  # the CLI, pinned from outside
        cli = subprocess.run(["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable, "-m",
                              "aiodatadist", "info"], check=False, capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert "cpus: 1 usable (affinity)" in cli.stdout
