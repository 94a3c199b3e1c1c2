"""A TCP link's data connections get the congestion control ``AIODATADIST_TCP_CONGESTION`` asks for, on both
sides, and ``links()`` says which (real sockets on 127.0.0.1, two instances in this process)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
from helpers.data import fill_pattern

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import cluster_info, free_port
from aiodatadist.transport.tcp.congestion import UNPACED

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="no TCP_CONGESTION on this platform")
DESC = CacheDesc(2, (4, 4096), DataType.DT_UINT8, Placement.HOST)
ENV = "AIODATADIST_TCP_CONGESTION"


def _options(transport: str, port: int | None = None) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.transport = transport
    if port is not None:
        cfg.listen_ip_info = f"127.0.0.1:{port}"
    return dict(cfg.generate_options())


@asynccontextmanager
async def linked(transport: str = "tcp") -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    port = free_port()
    async with LLMDataDist(LLMRole.PROMPT, 1) as server, LLMDataDist(LLMRole.DECODER, 2) as client:
        await server.init(_options(transport, port))
        await client.init(_options(transport))
        code, codes = await client.link_clusters([cluster_info(1, port)], timeout=5000)
        assert (code, codes) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
        yield server, client


async def _pull_is_byte_exact(server: LLMDataDist, client: LLMDataDist) -> None:
    src = server.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
    data = fill_pattern(src, 9)
    dst = client.cache_manager.allocate_blocks_cache(DESC)
    await client.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1, 2], [3, 0])
    for t in range(2):
        got = dst.tensors[t].view(np.uint8).reshape(4, -1)
        assert np.array_equal(got[[3, 0]], data[t].reshape(4, -1)[[1, 2]])


def _system_default() -> str:
    return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()


@pytest.mark.parametrize("net", ["native", "python"])
async def test_a_name_is_used_by_both_sides_data_connections(net: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "reno")  # open to every process
    monkeypatch.setenv("AIODATADIST_NET", net)
    async with linked() as (server, client):
        for dd in (server, client):
            link = dd.links()[0]
            assert (link["plane"], link["data_congestion"]) == ("tcp", "reno"), link
        await _pull_is_byte_exact(server, client)


async def test_auto_takes_a_pacing_default_off_connections_to_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    default = _system_default()
    async with linked() as (server, client):
        for dd in (server, client):
            got = dd.links()[0]["data_congestion"]
            if default.startswith("bbr"):
                assert got in UNPACED
            else:
                assert got == default
        await _pull_is_byte_exact(server, client)


async def test_system_keeps_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "system")
    async with linked() as (server, client):
        assert [dd.links()[0]["data_congestion"] for dd in (server, client)] == [_system_default()] * 2


async def test_other_planes_have_none() -> None:
    async with linked("shm") as (_, client):
        link = client.links()[0]
        assert (link["plane"], link["data_connections"], link["data_congestion"]) == ("shm", 0, None)
