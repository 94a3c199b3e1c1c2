"""The engine adapters' options without any engine: the ``LLMConfig`` both adapters build for an engine worker's
instance (``integrations._config``), the transports they accept, and the vLLM connector's
``kv_connector_extra_config`` (the SGLang backend's environment: ``tests/sglang/test_sglang_backend_units.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aiodatadist.config import OptionKey
from aiodatadist.integrations._config import (
    CLUSTER_ID_BITS,
    TRANSPORTS,
    check_transport,
    llm_config,
    random_cluster_id,
)
from aiodatadist.integrations.sglang.options import BackendOptions
from aiodatadist.integrations.vllm import ConnectorOptions
from aiodatadist.sync import LLMDataDist as SyncLLMDataDist
from aiodatadist.types import LLMRole, Transport


def test_the_config_carries_every_option_given() -> None:
    options = llm_config(transport="tcp", auth_key="k", transfer_timeout_ms=1234, device_index=3,
                         listen=("10.0.0.1", 7000)).generate_options()
    assert options[OptionKey.TRANSPORT] == "tcp"
    assert options[OptionKey.AUTH_KEY] == "k"
    assert options[OptionKey.SYNC_KV_TIMEOUT] == "1234"
    assert options[OptionKey.DEVICE_ID] == options[OptionKey.SESSION_DEVICE_ID] == "3"
    assert options[OptionKey.LISTEN_IP_INFO] == "10.0.0.1:7000"


def test_options_left_unset_stay_out_of_the_config() -> None:
    """An empty key is no key, no device is host memory, no address is an instance that does not listen."""
    options = llm_config(transport="auto", auth_key="", transfer_timeout_ms=30000).generate_options()
    assert options[OptionKey.TRANSPORT] == "auto" and options[OptionKey.SYNC_KV_TIMEOUT] == "30000"
    for unset in (OptionKey.AUTH_KEY, OptionKey.DEVICE_ID, OptionKey.LISTEN_IP_INFO):
        assert unset not in options


def test_the_transports_are_those_of_llm_transport_and_no_other() -> None:
    assert TRANSPORTS == tuple(t.value for t in Transport)
    for transport in TRANSPORTS:
        check_transport(transport, "the option")
    with pytest.raises(ValueError, match="^the option must be one of auto, shm, tcp, nixl, got 'rdma'$"):
        check_transport("rdma", "the option")


def test_both_adapters_refuse_an_unknown_transport_naming_their_own_option() -> None:
    with pytest.raises(ValueError, match="^AiodatadistConnector: transport must be one of"):
        ConnectorOptions.from_extra_config({"transport": "rdma"})
    with pytest.raises(ValueError, match="^AIODATADIST_SGLANG_TRANSPORT must be one of"):
        BackendOptions.from_environ({"AIODATADIST_SGLANG_TRANSPORT": "rdma"})


def test_cluster_ids_are_random_and_never_zero() -> None:
    ids = {random_cluster_id() for _ in range(64)}
    assert len(ids) == 64 and all(1 <= i <= 2**CLUSTER_ID_BITS for i in ids)


def test_an_instance_starts_listening_where_the_config_says() -> None:
    """The config initializes an instance as the adapters start theirs: port 0 listens on a free port."""
    dd = SyncLLMDataDist(LLMRole.PROMPT, random_cluster_id())
    dd.init(llm_config(transport="tcp", auth_key="k", transfer_timeout_ms=1000,
                       listen=("127.0.0.1", 0)).generate_options())
    try:
        address = dd.listen_address
        assert address is not None and address[0] == "127.0.0.1" and address[1] > 0
    finally:
        dd.finalize()


def test_the_options_import_no_engine_and_no_io() -> None:
    """Option parsing runs in every engine process (SGLang's plugin at start-up): it loads neither an engine, nor
    torch, nor the library's I/O."""
    code = ("import sys, aiodatadist.integrations.sglang, aiodatadist.integrations.vllm.options\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'sglang')"
            " or m.startswith(('aiodatadist.sync', 'aiodatadist.native', 'aiodatadist.datadist')))\n"
            "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# -- the vLLM connector's kv_connector_extra_config ------------------------------------------------------------

def test_connector_options_are_parsed_and_checked() -> None:
    assert ConnectorOptions.from_extra_config(None) == ConnectorOptions()
    options = ConnectorOptions.from_extra_config({"port_base": "7000", "transport": "tcp", "lease_seconds": 5})
    assert (options.port_base, options.transport, options.lease_seconds) == (7000, "tcp", 5.0)
    assert ConnectorOptions().share_kv and not ConnectorOptions.from_extra_config({"share_kv": "false"}).share_kv
    with pytest.raises(ValueError, match="share_kv must be bool"):
        ConnectorOptions.from_extra_config({"share_kv": "sometimes"})
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys \\['listen_port'\\]"):
        ConnectorOptions.from_extra_config({"listen_port": 1})
    with pytest.raises(ValueError, match="transport"):
        ConnectorOptions.from_extra_config({"transport": "rdma"})
    with pytest.raises(ValueError, match="port_base must be int"):
        ConnectorOptions.from_extra_config({"port_base": "x"})
    with pytest.raises(ValueError, match="out of range"):
        ConnectorOptions.from_extra_config({"port_base": 70000})
