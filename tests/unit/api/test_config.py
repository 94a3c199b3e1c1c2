"""LLMConfig, as in LLM-DataDist, and the init option parser."""

from __future__ import annotations

import json
from typing import Any

import pytest

from aiodatadist import LLMConfig, LlmConfig, LLMException, LLMStatusCode
from aiodatadist.settings.options import DEFAULT_SYNC_KV_TIMEOUT_MS, parse_options
from aiodatadist.types import Transport

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID
SENTINEL = object()

# Keys that LLM-DataDist's generate_options() emits, in its order.
REFERENCE_KEY_ORDER = [
    "ge.exec.deviceId",
    "ge.session_device_id",
    "llm.SyncKvCacheWaitTime",
    "llm.deployResPath",
    "llm.BufPoolCfg",
    "llm.MemPoolConfig",
    "llm.HostMemPoolConfig",
    "llm.EnableCacheManager",
    "llm.EnableRemoteCacheAccessible",
    "llm.listenIpInfo",
    "llm.LinkTotalTime",
    "llm.LinkRetryCount",
    "llm.RdmaTrafficClass",
    "llm.RdmaServiceLevel",
    "llm.LocalCommRes",
    "llm.TransferBackend",
    "llm.GlobalResourceConfig",
    "llm.ClusterInfo",
    "llm.OutputMaxSize",
    "llm.EnableSwitchRole",
    "llm.MemoryUtilization",
]


# --------------------------------------------------------------------------------------------------------------
# Class basics
# --------------------------------------------------------------------------------------------------------------


def test_alias_is_same_class() -> None:
    assert LlmConfig is LLMConfig


def test_takes_no_arguments() -> None:
    with pytest.raises(TypeError):
        LLMConfig(1)  # type: ignore[call-arg]


def test_gen_options_alias() -> None:
    cfg = LLMConfig()
    cfg.device_id = 0
    assert LLMConfig.gen_options is LLMConfig.generate_options
    opts = cfg.gen_options()
    assert opts is cfg.generate_options()
    assert opts["ge.exec.deviceId"] == "0"
    assert opts["ge.session_device_id"] == "0"


def test_generate_options_returns_same_internal_dict() -> None:
    cfg = LLMConfig()
    first = cfg.generate_options()
    assert isinstance(first, dict)
    assert cfg.options is first
    cfg.device_id = 3
    second = cfg.generate_options()
    assert second is first
    assert first["ge.exec.deviceId"] == "3"


def test_options_empty_before_generate() -> None:
    cfg = LLMConfig()
    cfg.device_id = 1
    assert cfg.options == {}


def test_generate_options_keys_only_added() -> None:
    cfg = LLMConfig()
    cfg.listen_ip_info = "1.2.3.4:26000"
    cfg.enable_switch_role = True
    cfg.generate_options()
    cfg.listen_ip_info = ""
    cfg.enable_switch_role = False
    opts = cfg.generate_options()
    assert opts["llm.listenIpInfo"] == "1.2.3.4:26000"
    assert opts["llm.EnableSwitchRole"] == "1"


def test_generate_options_values_are_strings() -> None:
    cfg = fully_configured()
    opts = cfg.generate_options()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in opts.items())


def test_default_options_emit_no_unset_field() -> None:
    opts = LLMConfig().generate_options()
    # Only mem_utilization is emitted unconditionally by the reference.
    assert set(opts) <= {"llm.MemoryUtilization"}


# --------------------------------------------------------------------------------------------------------------
# Defaults
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prop", "default"),
    [
        ("device_id", None),
        ("sync_kv_timeout", None),
        ("listen_ip_info", ""),
        ("enable_cache_manager", False),
        ("enable_remote_cache_accessible", False),
        ("enable_switch_role", False),
        ("local_comm_res", ""),
        ("link_total_time", 0),
        ("link_retry_count", 1),
        ("mem_pool_cfg", ""),
        ("host_mem_pool_cfg", ""),
        ("ge_options", {}),
        ("transport", Transport.AUTO),
        ("auth_key", None),
        ("options", {}),
    ],
)
def test_default(prop: str, default: Any) -> None:
    value = getattr(LLMConfig(), prop)
    assert value == default
    assert type(value) is type(default)


def test_default_transport_is_auto_string() -> None:
    assert LLMConfig().transport == "auto"


# --------------------------------------------------------------------------------------------------------------
# Accepted values and the options they emit
# --------------------------------------------------------------------------------------------------------------

# (property, value, getter value (SENTINEL = the value itself), options that must appear, keys that must not)
ACCEPTED: list[tuple[str, Any, Any, dict[str, str], list[str]]] = [
    ("device_id", 0, SENTINEL, {"ge.exec.deviceId": "0", "ge.session_device_id": "0"}, []),
    ("device_id", 7, SENTINEL, {"ge.exec.deviceId": "7", "ge.session_device_id": "7"}, []),
    (
        "device_id",
        2**31 - 1,
        SENTINEL,
        {"ge.exec.deviceId": "2147483647", "ge.session_device_id": "2147483647"},
        [],
    ),
    ("device_id", [0], SENTINEL, {"ge.exec.deviceId": "0", "ge.session_device_id": "0"}, []),
    ("device_id", [1, 2], SENTINEL, {"ge.exec.deviceId": "1;2", "ge.session_device_id": "1"}, []),
    ("device_id", (3, 4, 5), SENTINEL, {"ge.exec.deviceId": "3;4;5", "ge.session_device_id": "3"}, []),
    ("sync_kv_timeout", 1, SENTINEL, {"llm.SyncKvCacheWaitTime": "1"}, []),
    ("sync_kv_timeout", 5000, SENTINEL, {"llm.SyncKvCacheWaitTime": "5000"}, []),
    ("sync_kv_timeout", 2**31 - 1, SENTINEL, {"llm.SyncKvCacheWaitTime": "2147483647"}, []),
    ("sync_kv_timeout", "1", SENTINEL, {"llm.SyncKvCacheWaitTime": "1"}, []),
    ("sync_kv_timeout", "3000", SENTINEL, {"llm.SyncKvCacheWaitTime": "3000"}, []),
    ("listen_ip_info", "1.2.3.4:26000", SENTINEL, {"llm.listenIpInfo": "1.2.3.4:26000"}, []),
    ("listen_ip_info", ":26001", SENTINEL, {"llm.listenIpInfo": ":26001"}, []),
    ("listen_ip_info", "", SENTINEL, {}, ["llm.listenIpInfo"]),
    ("enable_cache_manager", True, SENTINEL, {"llm.EnableCacheManager": "1"}, []),
    ("enable_cache_manager", False, SENTINEL, {"llm.EnableCacheManager": "0"}, []),
    ("enable_remote_cache_accessible", True, SENTINEL, {"llm.EnableRemoteCacheAccessible": "1"}, []),
    ("enable_remote_cache_accessible", False, SENTINEL, {"llm.EnableRemoteCacheAccessible": "0"}, []),
    ("enable_switch_role", True, SENTINEL, {"llm.EnableSwitchRole": "1"}, []),
    ("enable_switch_role", False, SENTINEL, {}, ["llm.EnableSwitchRole"]),
    ("local_comm_res", "", SENTINEL, {"llm.LocalCommRes": ""}, []),
    ("local_comm_res", '{"version": "1.3"}', SENTINEL, {"llm.LocalCommRes": '{"version": "1.3"}'}, []),
    ("link_total_time", 0, SENTINEL, {"llm.LinkTotalTime": "0"}, []),
    ("link_total_time", 1080, SENTINEL, {"llm.LinkTotalTime": "1080"}, []),
    ("link_total_time", 2**32 - 1, SENTINEL, {"llm.LinkTotalTime": "4294967295"}, []),
    ("link_retry_count", 1, SENTINEL, {"llm.LinkRetryCount": "1"}, []),
    ("link_retry_count", 80, SENTINEL, {"llm.LinkRetryCount": "80"}, []),
    ("link_retry_count", 100, SENTINEL, {"llm.LinkRetryCount": "100"}, []),
    ("mem_pool_cfg", '{"memory_size": 1024}', SENTINEL, {"llm.MemPoolConfig": '{"memory_size": 1024}'}, []),
    (
        "mem_pool_cfg",
        '{"memory_size": 1, "page_shift": 10}',
        SENTINEL,
        {"llm.MemPoolConfig": '{"memory_size": 1, "page_shift": 10}'},
        [],
    ),
    (
        "mem_pool_cfg",
        '{"memory_size": 102400, "page_shift": 30}',
        SENTINEL,
        {"llm.MemPoolConfig": '{"memory_size": 102400, "page_shift": 30}'},
        [],
    ),
    ("mem_pool_cfg", "", SENTINEL, {}, ["llm.MemPoolConfig"]),
    (
        "host_mem_pool_cfg",
        '{"memory_size": 4096}',
        SENTINEL,
        {"llm.HostMemPoolConfig": '{"memory_size": 4096}'},
        [],
    ),
    (
        "host_mem_pool_cfg",
        '{"memory_size": 1, "page_shift": 20}',
        SENTINEL,
        {"llm.HostMemPoolConfig": '{"memory_size": 1, "page_shift": 20}'},
        [],
    ),
    ("host_mem_pool_cfg", "", SENTINEL, {}, ["llm.HostMemPoolConfig"]),
    ("ge_options", {}, SENTINEL, {}, []),
    (
        "ge_options",
        {"ge.flowGraphMemMaxSize": "1024", "x": "y"},
        SENTINEL,
        {"ge.flowGraphMemMaxSize": "1024", "x": "y"},
        [],
    ),
    ("transport", Transport.SHM, Transport.SHM, {"llm.Transport": "shm"}, []),
    ("transport", Transport.TCP, Transport.TCP, {"llm.Transport": "tcp"}, []),
    ("transport", Transport.AUTO, Transport.AUTO, {"llm.Transport": "auto"}, []),
    ("transport", "auto", Transport.AUTO, {"llm.Transport": "auto"}, []),
    ("transport", "shm", Transport.SHM, {"llm.Transport": "shm"}, []),
    ("transport", "tcp", Transport.TCP, {"llm.Transport": "tcp"}, []),
    ("auth_key", "s3cret", SENTINEL, {"llm.AuthKey": "s3cret"}, []),
]


@pytest.mark.parametrize(("prop", "value", "getter", "emitted", "absent"), ACCEPTED)
def test_accepted(prop: str, value: Any, getter: Any, emitted: dict[str, str], absent: list[str]) -> None:
    cfg = LLMConfig()
    setattr(cfg, prop, value)
    expected = value if getter is SENTINEL else getter
    assert getattr(cfg, prop) == expected
    opts = cfg.generate_options()
    for key, item in emitted.items():
        assert opts[key] == item
    for key in absent:
        assert key not in opts
    # Nothing else from the reference's key set sneaks in.
    reference_keys = {k for k in opts if k in REFERENCE_KEY_ORDER and k != "llm.MemoryUtilization"}
    assert reference_keys == {k for k in emitted if k in REFERENCE_KEY_ORDER}


@pytest.mark.parametrize(
    ("prop", "key"),
    [
        ("device_id", "ge.exec.deviceId"),
        ("sync_kv_timeout", "llm.SyncKvCacheWaitTime"),
        ("enable_cache_manager", "llm.EnableCacheManager"),
        ("enable_remote_cache_accessible", "llm.EnableRemoteCacheAccessible"),
        ("local_comm_res", "llm.LocalCommRes"),
        ("link_total_time", "llm.LinkTotalTime"),
        ("link_retry_count", "llm.LinkRetryCount"),
        ("transport", "llm.Transport"),
        ("auth_key", "llm.AuthKey"),
        ("listen_ip_info", "llm.listenIpInfo"),
        ("enable_switch_role", "llm.EnableSwitchRole"),
        ("mem_pool_cfg", "llm.MemPoolConfig"),
        ("host_mem_pool_cfg", "llm.HostMemPoolConfig"),
    ],
)
def test_key_absent_when_unset(prop: str, key: str) -> None:
    assert key not in LLMConfig().generate_options()


def test_device_id_list_getter_keeps_object() -> None:
    cfg = LLMConfig()
    ids = [1, 2]
    cfg.device_id = ids
    assert cfg.device_id == [1, 2]


def test_device_id_reassigned() -> None:
    cfg = LLMConfig()
    cfg.device_id = 1
    cfg.generate_options()
    cfg.device_id = [2, 3]
    opts = cfg.generate_options()
    assert opts["ge.exec.deviceId"] == "2;3"
    assert opts["ge.session_device_id"] == "2"


def test_ge_options_merged_first_and_overridden() -> None:
    cfg = LLMConfig()
    cfg.ge_options = {
        "custom.first": "a",
        "ge.exec.deviceId": "9",
        "ge.session_device_id": "9",
        "llm.SyncKvCacheWaitTime": "7",
        "llm.listenIpInfo": "9.9.9.9:9",
    }
    cfg.device_id = 1
    cfg.listen_ip_info = "1.2.3.4:26000"
    opts = cfg.generate_options()
    assert opts["custom.first"] == "a"
    assert opts["ge.exec.deviceId"] == "1"
    assert opts["ge.session_device_id"] == "1"
    assert opts["llm.listenIpInfo"] == "1.2.3.4:26000"
    # Not overridden because sync_kv_timeout was never set.
    assert opts["llm.SyncKvCacheWaitTime"] == "7"
    assert next(iter(opts)) == "custom.first"


def test_ge_options_overridden_by_every_field() -> None:
    cfg = fully_configured()
    cfg.ge_options = {k: "ge-value" for k in REFERENCE_KEY_ORDER}
    opts = cfg.generate_options()
    for key in (
        "ge.exec.deviceId",
        "llm.SyncKvCacheWaitTime",
        "llm.EnableCacheManager",
        "llm.listenIpInfo",
        "llm.LinkTotalTime",
        "llm.LinkRetryCount",
        "llm.LocalCommRes",
        "llm.EnableSwitchRole",
        "llm.MemPoolConfig",
        "llm.HostMemPoolConfig",
        "llm.EnableRemoteCacheAccessible",
    ):
        assert opts[key] != "ge-value", key


def test_ge_options_setter_copies() -> None:
    cfg = LLMConfig()
    src = {"a": "b"}
    cfg.ge_options = src
    src["c"] = "d"
    assert cfg.ge_options == {"a": "b"}


def fully_configured() -> LLMConfig:
    cfg = LLMConfig()
    cfg.ge_options = {"ge.custom": "1"}
    cfg.device_id = 2
    cfg.sync_kv_timeout = 2500
    cfg.mem_pool_cfg = '{"memory_size": 1048576}'
    cfg.host_mem_pool_cfg = '{"memory_size": 2097152, "page_shift": 12}'
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.listen_ip_info = "127.0.0.1:26000"
    cfg.link_total_time = 30
    cfg.link_retry_count = 5
    cfg.local_comm_res = ""
    cfg.enable_switch_role = True
    cfg.transport = "tcp"
    cfg.auth_key = "k"
    return cfg


def test_generate_options_full() -> None:
    opts = fully_configured().generate_options()
    expected = {
        "ge.custom": "1",
        "ge.exec.deviceId": "2",
        "ge.session_device_id": "2",
        "llm.SyncKvCacheWaitTime": "2500",
        "llm.MemPoolConfig": '{"memory_size": 1048576}',
        "llm.HostMemPoolConfig": '{"memory_size": 2097152, "page_shift": 12}',
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.listenIpInfo": "127.0.0.1:26000",
        "llm.LinkTotalTime": "30",
        "llm.LinkRetryCount": "5",
        "llm.LocalCommRes": "",
        "llm.EnableSwitchRole": "1",
        "llm.Transport": "tcp",
        "llm.AuthKey": "k",
    }
    for key, value in expected.items():
        assert opts[key] == value, key
    assert set(opts) - set(expected) <= {"llm.MemoryUtilization"}


def test_generate_options_order_follows_the_reference() -> None:
    opts = fully_configured().generate_options()
    keys = list(opts)
    assert keys[0] == "ge.custom"  # ge_options first
    present = [k for k in keys if k in REFERENCE_KEY_ORDER]
    assert present == sorted(present, key=REFERENCE_KEY_ORDER.index)


# --------------------------------------------------------------------------------------------------------------
# Refused values
# --------------------------------------------------------------------------------------------------------------

REFUSED: list[tuple[str, Any, type[Exception]]] = [
    ("device_id", "0", TypeError),
    ("device_id", 1.0, TypeError),
    ("device_id", None, TypeError),
    ("device_id", {0}, TypeError),
    ("device_id", [1, "2"], TypeError),
    ("device_id", [1, None], TypeError),
    ("device_id", -1, LLMException),
    ("device_id", [1, -1], LLMException),
    ("device_id", [], LLMException),
    ("device_id", (), LLMException),
    ("device_id", 2**31, ValueError),
    ("device_id", [0, 2**31], ValueError),
    ("sync_kv_timeout", 0, LLMException),
    ("sync_kv_timeout", -1, LLMException),
    ("sync_kv_timeout", "0", LLMException),
    ("sync_kv_timeout", "-1", LLMException),
    ("sync_kv_timeout", "abc", LLMException),
    ("sync_kv_timeout", "", LLMException),
    ("sync_kv_timeout", "1.5", LLMException),
    ("sync_kv_timeout", " 10", LLMException),
    ("sync_kv_timeout", 2**31, ValueError),
    ("sync_kv_timeout", "2147483648", ValueError),
    ("sync_kv_timeout", 1.5, TypeError),
    ("sync_kv_timeout", None, TypeError),
    ("sync_kv_timeout", b"10", TypeError),
    ("listen_ip_info", 26000, TypeError),
    ("listen_ip_info", None, TypeError),
    ("listen_ip_info", ("1.2.3.4", 26000), TypeError),
    ("enable_cache_manager", 1, TypeError),
    ("enable_cache_manager", "1", TypeError),
    ("enable_cache_manager", None, TypeError),
    ("enable_remote_cache_accessible", 0, TypeError),
    ("enable_remote_cache_accessible", "True", TypeError),
    ("enable_switch_role", 1, TypeError),
    ("enable_switch_role", None, TypeError),
    ("local_comm_res", 1, TypeError),
    ("local_comm_res", None, TypeError),
    ("local_comm_res", {"version": "1.3"}, TypeError),
    ("link_total_time", -1, ValueError),
    ("link_total_time", 2**32, ValueError),
    ("link_total_time", "5", TypeError),
    ("link_total_time", 1.0, TypeError),
    ("link_retry_count", 0, LLMException),
    ("link_retry_count", 101, LLMException),
    ("link_retry_count", -1, ValueError),
    ("link_retry_count", "3", TypeError),
    ("link_retry_count", 3.0, TypeError),
    ("mem_pool_cfg", {"memory_size": 1}, TypeError),
    ("mem_pool_cfg", None, TypeError),
    ("host_mem_pool_cfg", 1, TypeError),
    ("ge_options", [("a", "b")], TypeError),
    ("ge_options", None, TypeError),
    ("ge_options", "a=b", TypeError),
    ("ge_options", {"a": 1}, TypeError),
    ("ge_options", {"a": None}, TypeError),
    ("ge_options", {1: "a"}, TypeError),
    ("transport", "udp", ValueError),
    ("transport", "", ValueError),
    ("transport", "TCP", ValueError),
    ("transport", 1, TypeError),
    ("transport", None, TypeError),
    ("auth_key", "", LLMException),
    ("auth_key", 1, TypeError),
    ("auth_key", None, TypeError),
    ("auth_key", b"key", TypeError),
]


@pytest.mark.parametrize(("prop", "value", "exc"), REFUSED)
def test_refused(prop: str, value: Any, exc: type[Exception]) -> None:
    cfg = LLMConfig()
    before = getattr(cfg, prop)
    with pytest.raises(exc) as info:
        setattr(cfg, prop, value)
    if exc is LLMException:
        assert info.value.status_code is PARAM_INVALID
    else:
        assert not isinstance(info.value, LLMException)
    assert getattr(cfg, prop) == before
    assert set(cfg.generate_options()) <= {"llm.MemoryUtilization"}


def test_refused_keeps_previous_value() -> None:
    cfg = LLMConfig()
    cfg.link_retry_count = 7
    with pytest.raises(LLMException):
        cfg.link_retry_count = 0
    assert cfg.link_retry_count == 7
    assert cfg.generate_options()["llm.LinkRetryCount"] == "7"


POOL_BAD = [
    "not json",
    "",  # placeholder replaced below: empty is accepted
    "[]",
    "1024",
    '"memory_size"',
    "{}",
    '{"memory_size": 0}',
    '{"memory_size": -1}',
    '{"memory_size": "1024"}',
    '{"memory_size": true}',
    '{"memory_size": 1.5}',
    '{"memory_size": null}',
    '{"page_shift": 16}',
    '{"memory_size": 1024, "page_shift": 9}',
    '{"memory_size": 1024, "page_shift": 31}',
    '{"memory_size": 1024, "page_shift": "16"}',
    '{"memory_size": 1024, "page_shift": 16.0}',
    '{"memory_size": 1024, "page_shift": false}',
]
POOL_BAD.remove("")


@pytest.mark.parametrize("value", POOL_BAD)
def test_pool_cfg_json_refused(value: str) -> None:
    cfg = LLMConfig()
    for prop in ("mem_pool_cfg", "host_mem_pool_cfg"):
        with pytest.raises(LLMException) as info:
            setattr(cfg, prop, value)
        assert info.value.status_code is PARAM_INVALID
        assert getattr(cfg, prop) == ""


@pytest.mark.parametrize("prop", ["mem_pool_cfg", "host_mem_pool_cfg"])
@pytest.mark.parametrize("page_shift", [10, 16, 30])
def test_pool_cfg_page_shift_accepted(prop: str, page_shift: int) -> None:
    cfg = LLMConfig()
    value = json.dumps({"memory_size": 1 << 20, "page_shift": page_shift})
    setattr(cfg, prop, value)
    assert getattr(cfg, prop) == value


# --------------------------------------------------------------------------------------------------------------
# Compatibility fields of the reference: accepted, emitted, otherwise unused
# --------------------------------------------------------------------------------------------------------------

def test_rdma_traffic_class() -> None:
    cfg = LLMConfig()
    assert cfg.rdma_traffic_class is None
    cfg.rdma_traffic_class = 132
    assert cfg.generate_options()["llm.RdmaTrafficClass"] == "132"
    with pytest.raises(ValueError):
        cfg.rdma_traffic_class = 2**32
    with pytest.raises(TypeError):
        cfg.rdma_traffic_class = "132"


def test_rdma_service_level() -> None:
    cfg = LLMConfig()
    assert cfg.rdma_service_level is None
    cfg.rdma_service_level = 4
    assert cfg.generate_options()["llm.RdmaServiceLevel"] == "4"
    with pytest.raises(ValueError):
        cfg.rdma_service_level = -1


def test_transfer_backend() -> None:
    cfg = LLMConfig()
    assert cfg.transfer_backend == ""
    assert "llm.TransferBackend" not in cfg.generate_options()
    cfg.transfer_backend = "hixl"
    assert cfg.generate_options()["llm.TransferBackend"] == "hixl"
    with pytest.raises(TypeError):
        cfg.transfer_backend = 1


def test_global_resource_config() -> None:
    cfg = LLMConfig()
    assert cfg.global_resource_config == ""
    value = '{"comm_resource_config.listen_port": 26666}'
    cfg.global_resource_config = value
    assert cfg.generate_options()["llm.GlobalResourceConfig"] == value
    with pytest.raises(TypeError):
        cfg.global_resource_config = {}


def test_buf_pool_cfg() -> None:
    cfg = LLMConfig()
    assert cfg.buf_pool_cfg == ""
    assert "llm.BufPoolCfg" not in cfg.generate_options()
    value = '{"buf_cfg": [{"total_size": 2097152, "blk_size": 256, "max_buf_size": 8192}]}'
    cfg.buf_pool_cfg = value
    assert cfg.generate_options()["llm.BufPoolCfg"] == value
    with pytest.raises(TypeError):
        cfg.buf_pool_cfg = 1


def test_mem_utilization() -> None:
    cfg = LLMConfig()
    assert cfg.mem_utilization == 0.95
    assert cfg.generate_options()["llm.MemoryUtilization"] == "0.95"
    cfg.mem_utilization = 0.5
    assert cfg.generate_options()["llm.MemoryUtilization"] == "0.5"


def test_deploy_res_path() -> None:
    cfg = LLMConfig()
    assert cfg.deploy_res_path == ""
    assert "llm.deployResPath" not in cfg.generate_options()
    cfg.deploy_res_path = "/tmp/res"
    assert cfg.generate_options()["llm.deployResPath"] == "/tmp/res"


def test_cluster_info_field() -> None:
    cfg = LLMConfig()
    assert cfg.cluster_info == ""
    cfg.cluster_info = json.dumps({"cluster_id": 1})
    assert "llm.ClusterInfo" in cfg.generate_options()


def test_output_max_size() -> None:
    cfg = LLMConfig()
    assert cfg.output_max_size is None
    cfg.output_max_size = 1024
    assert cfg.generate_options()["llm.OutputMaxSize"] == "1024"


# --------------------------------------------------------------------------------------------------------------
# parse_options (what LLMDataDist.init does with the dict)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [None, [], [("a", "b")], "ge.exec.deviceId=0", 0, LLMConfig()])
def test_parse_options_not_a_dict(options: Any) -> None:
    with pytest.raises(TypeError):
        parse_options(options)


@pytest.mark.parametrize(
    "options",
    [
        {"ge.exec.deviceId": 0},
        {"llm.SyncKvCacheWaitTime": 1000},
        {"llm.EnableCacheManager": True},
        {"x": None},
        {1: "a"},
        {"llm.listenIpInfo": ("1.2.3.4", 26000)},
    ],
)
def test_parse_options_non_str(options: dict[Any, Any]) -> None:
    with pytest.raises(TypeError):
        parse_options(options)


def test_parse_options_defaults() -> None:
    s = parse_options({})
    assert s.sync_kv_timeout_ms == 1000
    assert DEFAULT_SYNC_KV_TIMEOUT_MS == 1000
    assert s.transport is Transport.AUTO
    assert s.listen is None
    assert s.enable_remote_cache_accessible is None
    assert s.auth_key is None


def test_parse_options_defaults_match_config_getters() -> None:
    cfg = LLMConfig()
    s = parse_options({"llm.EnableCacheManager": "1"})
    assert s.transport is cfg.transport


@pytest.mark.parametrize(
    "listen",
    [
        "1.2.3.4",
        "a:b:c",
        "1.2.3.4:",
        "1.2.3.4:abc",
        "1.2.3.4:70000",
        "[::1]:26000",
        "::1:80",
        "1.2.3.4:-1",
        "1.2.3.4:26000;5.6.7.8:26000",
    ],
)
def test_parse_options_bad_listen_ip_info(listen: str) -> None:
    with pytest.raises(LLMException) as info:
        parse_options({"llm.EnableCacheManager": "1", "llm.listenIpInfo": listen})
    assert info.value.status_code is PARAM_INVALID


@pytest.mark.parametrize(
    ("listen", "ip", "port"),
    [
        ("1.2.3.4:26000", "1.2.3.4", 26000),
        ("127.0.0.1:0", "127.0.0.1", 0),
        ("10.0.0.1:65535", "10.0.0.1", 65535),
    ],
)
def test_parse_options_listen_ip_info(listen: str, ip: str, port: int) -> None:
    s = parse_options({"llm.EnableCacheManager": "1", "llm.listenIpInfo": listen})
    assert s.listen == (ip, port)


def test_parse_options_listen_without_ip() -> None:
    s = parse_options({"llm.listenIpInfo": ":26001"})
    assert s.listen is not None
    assert s.listen[1] == 26001
    assert isinstance(s.listen[0], str)


def test_parse_options_empty_listen_is_client() -> None:
    assert parse_options({"llm.listenIpInfo": ""}).listen is None


def test_parse_options_kv_cache_manager_mode_not_enabled() -> None:
    with pytest.raises(LLMException) as info:
        parse_options({"llm.EnableCacheManager": "0"})
    assert info.value.status_code is LLMStatusCode.LLM_FEATURE_NOT_ENABLED


def test_parse_options_local_comm_res_without_cache_manager() -> None:
    with pytest.raises(LLMException) as info:
        parse_options({"llm.LocalCommRes": "", "llm.EnableCacheManager": "0"})
    assert info.value.status_code is not LLMStatusCode.LLM_SUCCESS


def test_parse_options_local_comm_res_defaults_flags_on_a_copy() -> None:
    options = {"llm.LocalCommRes": ""}
    s = parse_options(options)
    assert options == {"llm.LocalCommRes": ""}  # the caller's dict is not modified
    assert s.raw["llm.EnableCacheManager"] == "1"
    assert s.raw["llm.EnableRemoteCacheAccessible"] == "1"
    assert s.enable_remote_cache_accessible is True


@pytest.mark.parametrize(("value", "ms"), [("1", 1), ("500", 500), ("120000", 120000)])
def test_parse_options_sync_timeout(value: str, ms: int) -> None:
    assert parse_options({"llm.SyncKvCacheWaitTime": value}).sync_kv_timeout_ms == ms


@pytest.mark.parametrize("value", ["0", "-1", "abc", "", "1.5"])
def test_parse_options_bad_sync_timeout(value: str) -> None:
    with pytest.raises(LLMException) as info:
        parse_options({"llm.SyncKvCacheWaitTime": value})
    assert info.value.status_code is PARAM_INVALID


@pytest.mark.parametrize(
    ("value", "transport"), [("auto", Transport.AUTO), ("shm", Transport.SHM), ("tcp", Transport.TCP)]
)
def test_parse_options_transport(value: str, transport: Transport) -> None:
    assert parse_options({"llm.Transport": value}).transport is transport


@pytest.mark.parametrize("value", ["udp", "", "TCP"])
def test_parse_options_bad_transport(value: str) -> None:
    with pytest.raises(LLMException) as info:
        parse_options({"llm.Transport": value})
    assert info.value.status_code is PARAM_INVALID


@pytest.mark.parametrize(("value", "device"), [("0", 0), ("3", 3), ("1;2", 1)])
def test_parse_options_device_id(value: str, device: int) -> None:
    assert parse_options({"ge.exec.deviceId": value}).device_id == device


@pytest.mark.parametrize("value", ["x", "", "-1", ";1"])
def test_parse_options_bad_device_id(value: str) -> None:
    with pytest.raises(LLMException) as info:
        parse_options({"ge.exec.deviceId": value})
    assert info.value.status_code is PARAM_INVALID


@pytest.mark.parametrize("value", ["1;2", "abc", "", "-5", "1024 "])
def test_parse_options_bad_flow_graph_mem(value: str) -> None:
    with pytest.raises(LLMException) as info:
        parse_options({"ge.flowGraphMemMaxSize": value})
    assert info.value.status_code is PARAM_INVALID


def test_parse_options_flow_graph_mem_digits() -> None:
    assert (
        parse_options({"ge.flowGraphMemMaxSize": "1073741824"}).raw["ge.flowGraphMemMaxSize"] == "1073741824"
    )


@pytest.mark.parametrize(
    "key", ["llm.EnableSwitchRole", "llm.EnableRemoteCacheAccessible", "llm.EnableCacheManager"]
)
@pytest.mark.parametrize("value", ["yes", "true", "2", ""])
def test_parse_options_bad_flag(key: str, value: str) -> None:
    with pytest.raises(LLMException):
        parse_options({key: value})


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("0", False)])
def test_parse_options_switch_role_flag(value: str, expected: bool) -> None:
    parse_options({"llm.EnableSwitchRole": value})  # validated, otherwise unused (no Settings field)


def test_parse_options_round_trip_from_config() -> None:
    cfg = fully_configured()
    s = parse_options(cfg.generate_options())
    assert s.device_id == 2
    assert s.sync_kv_timeout_ms == 2500
    assert s.listen == ("127.0.0.1", 26000)
    assert s.transport is Transport.TCP
    assert s.auth_key == "k"
    assert s.enable_remote_cache_accessible is True
    assert s.raw["ge.custom"] == "1"


def test_parse_options_vllm_ascend_minimal_config() -> None:
    """The configuration vllm-ascend uses must be accepted."""
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.sync_kv_timeout = 20000
    cfg.enable_switch_role = True
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    s = parse_options(cfg.generate_options())
    assert s.sync_kv_timeout_ms == 20000
    assert s.listen is None


# --------------------------------------------------------------------------------------------------------------
# ZeroMQ CURVE on the control plane (llm.CurveSecretKey / llm.CurvePeerKeys; docs/security.md)
# --------------------------------------------------------------------------------------------------------------

# The example keys of the zmq_curve(7) man page (a server pair and a client public key).
CURVE_PUBLIC = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
CURVE_SECRET = "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6"
OTHER_PUBLIC = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"


def test_curve_defaults_are_off() -> None:
    cfg = LLMConfig()
    assert cfg.curve_secret_key is None and cfg.curve_peer_keys is None
    opts = cfg.generate_options()
    assert "llm.CurveSecretKey" not in opts and "llm.CurvePeerKeys" not in opts
    assert parse_options({}).curve is None


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (OTHER_PUBLIC, OTHER_PUBLIC),
        (f"7={OTHER_PUBLIC}", f"7={OTHER_PUBLIC}"),
        (f"7={OTHER_PUBLIC}, {CURVE_PUBLIC}", f"7={OTHER_PUBLIC}, {CURVE_PUBLIC}"),
        ([f"7={OTHER_PUBLIC}", CURVE_PUBLIC], f"7={OTHER_PUBLIC},{CURVE_PUBLIC}"),
        ((OTHER_PUBLIC,), OTHER_PUBLIC),
        ({7: OTHER_PUBLIC, 2**64 - 1: CURVE_PUBLIC}, f"7={OTHER_PUBLIC},{2**64 - 1}={CURVE_PUBLIC}"),
        ({7: OTHER_PUBLIC, 8: OTHER_PUBLIC}, f"7={OTHER_PUBLIC},8={OTHER_PUBLIC}"),  # one key, several ids
    ],
)
def test_curve_options_accepted(value: Any, text: str) -> None:
    cfg = LLMConfig()
    cfg.curve_secret_key = CURVE_SECRET
    cfg.curve_peer_keys = value
    assert cfg.curve_secret_key == CURVE_SECRET and cfg.curve_peer_keys == text
    opts = cfg.generate_options()
    assert opts["llm.CurveSecretKey"] == CURVE_SECRET and opts["llm.CurvePeerKeys"] == text
    curve = parse_options(opts).curve
    assert curve is not None
    assert curve.secret_key == CURVE_SECRET.encode() and curve.public_key == CURVE_PUBLIC.encode()


@pytest.mark.parametrize(
    ("prop", "value", "exc"),
    [
        ("curve_secret_key", None, TypeError),
        ("curve_secret_key", b"x" * 40, TypeError),
        ("curve_secret_key", "", LLMException),
        ("curve_secret_key", CURVE_SECRET[:-1], LLMException),
        ("curve_secret_key", CURVE_SECRET + "a", LLMException),
        ("curve_secret_key", CURVE_SECRET[:-1] + ",", LLMException),  # not in the Z85 alphabet
        ("curve_secret_key", "#" * 40, LLMException),  # Z85 characters, but a group exceeds 32 bits
        ("curve_peer_keys", None, TypeError),
        ("curve_peer_keys", 1, TypeError),
        ("curve_peer_keys", [1], TypeError),
        ("curve_peer_keys", {"7": OTHER_PUBLIC}, TypeError),
        ("curve_peer_keys", {7: 1}, TypeError),
        ("curve_peer_keys", {-1: OTHER_PUBLIC}, ValueError),
        ("curve_peer_keys", "", LLMException),
        ("curve_peer_keys", [], LLMException),
        ("curve_peer_keys", f"{OTHER_PUBLIC},", LLMException),
        ("curve_peer_keys", f"x={OTHER_PUBLIC}", LLMException),
        ("curve_peer_keys", f"-1={OTHER_PUBLIC}", LLMException),
        ("curve_peer_keys", f"{2**64}={OTHER_PUBLIC}", LLMException),
        ("curve_peer_keys", f"7:{OTHER_PUBLIC}", LLMException),
        ("curve_peer_keys", f"7={OTHER_PUBLIC[:-1]}", LLMException),
        ("curve_peer_keys", f"7={OTHER_PUBLIC},7={CURVE_PUBLIC}", LLMException),  # one id, two keys
    ],
)
def test_curve_options_refused(prop: str, value: Any, exc: type[Exception]) -> None:
    cfg = LLMConfig()
    with pytest.raises(exc) as info:
        setattr(cfg, prop, value)
    if exc is LLMException:
        assert info.value.status_code is PARAM_INVALID
        assert CURVE_SECRET[:-1] not in str(info.value)  # a secret key is never repeated in a message
    else:
        assert not isinstance(info.value, LLMException)
    assert getattr(cfg, prop) is None
    assert set(cfg.generate_options()) <= {"llm.MemoryUtilization"}


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"llm.CurveSecretKey": CURVE_SECRET}, "needs llm.CurvePeerKeys"),
        ({"llm.CurveSecretKey": CURVE_SECRET, "llm.CurvePeerKeys": ""}, "needs llm.CurvePeerKeys"),
        ({"llm.CurvePeerKeys": OTHER_PUBLIC}, "needs llm.CurveSecretKey"),
        ({"llm.CurveSecretKey": "", "llm.CurvePeerKeys": OTHER_PUBLIC}, "llm.CurveSecretKey must be"),
        ({"llm.CurveSecretKey": CURVE_SECRET[:-1] + ",", "llm.CurvePeerKeys": OTHER_PUBLIC},
         "llm.CurveSecretKey must be"),
        ({"llm.CurveSecretKey": CURVE_SECRET, "llm.CurvePeerKeys": f"{OTHER_PUBLIC};{CURVE_PUBLIC}"},
         "llm.CurvePeerKeys must be"),
        ({"llm.CurveSecretKey": CURVE_SECRET, "llm.CurvePeerKeys": f"1={OTHER_PUBLIC},1={CURVE_PUBLIC}"},
         "two different keys"),
    ],
)
def test_parse_options_bad_curve(options: dict[str, str], needle: str) -> None:
    with pytest.raises(LLMException) as info:
        parse_options(options)
    assert info.value.status_code is PARAM_INVALID
    assert needle in str(info.value)
    assert CURVE_SECRET[:-1] not in str(info.value)


def test_parse_options_curve_needs_libzmq_with_curve(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiodatadist.settings.curve_keys as curve_module

    monkeypatch.setattr(curve_module.zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(LLMException) as info:
        parse_options({"llm.CurveSecretKey": CURVE_SECRET, "llm.CurvePeerKeys": OTHER_PUBLIC})
    assert info.value.status_code is LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert parse_options({}).curve is None  # without the option nothing needs CURVE


def test_curve_keys_choose_the_server_key_and_the_admitted_ids() -> None:
    third = "Z" * 35 + "00000"
    curve = parse_options({"llm.CurveSecretKey": CURVE_SECRET,
                           "llm.CurvePeerKeys": f"1={OTHER_PUBLIC},2={OTHER_PUBLIC},{CURVE_PUBLIC}"}).curve
    assert curve is not None
    assert curve.server_key(1) == OTHER_PUBLIC.encode()  # listed for that id
    assert curve.server_key(9) == CURVE_PUBLIC.encode()  # the only key listed without an id
    assert curve.clusters_of(OTHER_PUBLIC.encode()) == frozenset({1, 2})
    assert curve.clusters_of(CURVE_PUBLIC.encode()) is None  # any id
    assert curve.clusters_of(third.encode()) == frozenset() and not curve.trusts(third.encode())
    assert CURVE_SECRET not in repr(curve)
    ambiguous = parse_options({"llm.CurveSecretKey": CURVE_SECRET,
                               "llm.CurvePeerKeys": f"{OTHER_PUBLIC},{third}"}).curve
    assert ambiguous is not None and ambiguous.server_key(1) is None  # two keys without an id: no guess
    only_bound = parse_options({"llm.CurveSecretKey": CURVE_SECRET, "llm.CurvePeerKeys": f"1={OTHER_PUBLIC}"}).curve
    assert only_bound is not None and only_bound.server_key(2) is None


def test_settings_repr_shows_no_secret() -> None:
    s = parse_options({"llm.CurveSecretKey": CURVE_SECRET, "llm.CurvePeerKeys": OTHER_PUBLIC,
                       "llm.AuthKey": "hunter2"})
    assert CURVE_SECRET not in repr(s) and "hunter2" not in repr(s)
