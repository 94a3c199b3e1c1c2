"""The two-sided link (``link`` / ``query_register_mem_status`` / ``unlink``) between real instances on
127.0.0.1: the states while it comes up, a peer that never does (``FAILED`` within ``llm.LinkTotalTime``), the
argument checks, and a pull over the link once it is ``OK``."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
import pytest
from helpers.data import blocks, fill_pattern
from helpers.ids import new_cluster_id

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
)
from aiodatadist.testing import free_port

DESC = CacheDesc(4, (8, 2048), DataType.DT_UINT8, Placement.HOST)


def rank_table(*devices: dict[str, Any], **overrides: Any) -> str:
    table = {"version": "1.2", "server_count": "1", "status": "completed",
             "server_list": [{"server_id": "127.0.0.1", "device": list(devices)}]}
    table.update(overrides)
    return json.dumps(table)


def device(rank: int, port: int | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"device_id": str(rank), "device_ip": "127.0.0.1", "rank_id": str(rank)}
    if port is not None:
        entry["device_port"] = port
    return entry


async def instance(role: LLMRole, port: int | None = None, link_total_time: int | None = None) -> LLMDataDist:
    dd = LLMDataDist(role, new_cluster_id())
    config = LLMConfig()
    if port is not None:
        config.listen_ip_info = f"127.0.0.1:{port}"
    if link_total_time is not None:
        config.link_total_time = link_total_time
    await dd.init(config.generate_options())
    return dd


async def wait_status(dd: LLMDataDist, comm_id: int, seconds: float = 10.0) -> RegisterMemStatus:
    deadline = time.monotonic() + seconds
    while (status := dd.query_register_mem_status(comm_id)) == RegisterMemStatus.PREPARING:
        assert time.monotonic() < deadline, "still PREPARING"
        await asyncio.sleep(0.02)
    return status


async def test_both_sides_come_up_ok_then_pull_and_unlink() -> None:
    port = free_port()
    prompt = await instance(LLMRole.PROMPT, port)
    decoder = await instance(LLMRole.DECODER)
    try:
        ranks = {prompt.cluster_id: 0, decoder.cluster_id: 1}
        table = rank_table(device(0, port), device(1))
        src = prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(prompt.cluster_id, 0))
        fill_pattern(src, 111)
        dst = decoder.cache_manager.allocate_blocks_cache(DESC)
        p_comm = prompt.link("pd_comm", ranks, table)
        d_comm = decoder.link("pd_comm", ranks, table)
        assert prompt.query_register_mem_status(p_comm) in (RegisterMemStatus.PREPARING, RegisterMemStatus.OK)
        assert await wait_status(decoder, d_comm) == RegisterMemStatus.OK
        assert await wait_status(prompt, p_comm) == RegisterMemStatus.OK
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(prompt.cluster_id, 0), dst, [3, 6], [0, 1])
        assert all(np.array_equal(a, b) for a, b in zip(blocks(src, [3, 6]), blocks(dst, [0, 1])))

        await decoder.unlink(d_comm)
        with pytest.raises(LLMException) as info:
            decoder.query_register_mem_status(d_comm)  # forgotten
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        deadline = time.monotonic() + 10  # the prompt drops its end once it hears of the unlink
        while prompt.links() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert prompt.links() == [] and decoder.links() == []
        with pytest.raises(LLMException) as info:
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(prompt.cluster_id, 0), dst, [3], [0])
        assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        await prompt.unlink(p_comm)  # its peer is gone already: nothing left to do
    finally:
        await decoder.finalize()
        await prompt.finalize()


@pytest.mark.parametrize("side", ["linking", "accepting"])
async def test_a_peer_that_never_comes_up_fails_within_link_total_time(side: str) -> None:
    """The linking side (higher rank) finds nobody listening; the accepting side (lower rank) never sees its peer:
    both report FAILED once llm.LinkTotalTime (1 s) is over, and stay usable."""
    port = free_port()
    absent = new_cluster_id()
    if side == "linking":
        dd = await instance(LLMRole.DECODER, link_total_time=1)
        ranks, table = {absent: 0, dd.cluster_id: 1}, rank_table(device(0, port), device(1))
    else:
        dd = await instance(LLMRole.PROMPT, port, link_total_time=1)
        ranks, table = {dd.cluster_id: 0, absent: 1}, rank_table(device(0, port), device(1))
    try:
        started = time.monotonic()
        comm = dd.link("pd_comm", ranks, table)
        assert dd.query_register_mem_status(comm) == RegisterMemStatus.PREPARING
        assert await wait_status(dd, comm) == RegisterMemStatus.FAILED
        assert 0.9 < time.monotonic() - started < 10  # its 1 s (late on a loaded machine), not a hang
        await dd.unlink(comm)
        assert dd.links() == []
    finally:
        await dd.finalize()


async def test_arguments_are_checked() -> None:
    dd = await instance(LLMRole.PROMPT, free_port())
    try:
        me, other = dd.cluster_id, new_cluster_id()
        good = rank_table(device(0), device(1, 7000))
        for args, error in [
            ((1, {me: 0, other: 1}, good), TypeError),
            (("c", [(me, 0)], good), TypeError),
            (("c", {me: 0, other: 1}, {"x": 1}), TypeError),
        ]:
            with pytest.raises(error):
                dd.link(*args)  # type: ignore[arg-type]
        bad = [
            ("", {me: 0, other: 1}, good),
            ("x" * 128, {me: 0, other: 1}, good),
            ("c", {me: 0}, good),
            ("c", {me: 1, other: 0}, good),  # ranks not ascending
            ("c", {other: 0, new_cluster_id(): 1}, good),  # this cluster is not a member
            ("c", {me: 0, other: 1}, "{not json"),
            ("c", {me: 0, other: 1}, rank_table(device(0), device(1), status="pending")),
            ("c", {me: 0, other: 1}, rank_table(device(0), device(1), version="2.0")),
            ("c", {me: 0, other: 2}, good),  # rank 2 not in the table
            ("c", {me: 0, other: 1}, rank_table(device(0), device(0))),  # rank 0 twice
        ]
        for comm_name, ranks, table in bad:
            with pytest.raises(LLMException) as info:
                dd.link(comm_name, ranks, table)
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, (comm_name, ranks, table)
        with pytest.raises(LLMException):
            dd.query_register_mem_status(12345)
        with pytest.raises(TypeError):
            dd.query_register_mem_status("1")  # type: ignore[arg-type]
        assert dd.links() == []
    finally:
        await dd.finalize()


async def test_check_link_status_and_remap_registered_memory() -> None:
    """check_link_status pings a linked peer (LLM_NOT_YET_LINK when not linked); remap_registered_memory is
    checked as the reference does, then refused with LLM_FEATURE_NOT_ENABLED."""
    from aiodatadist import MemInfo, Memtype
    from aiodatadist.testing import linked_pair

    async with linked_pair(prompt_id=new_cluster_id(), decoder_id=new_cluster_id()) as (prompt, decoder):
        await decoder.check_link_status(prompt.cluster_id)
        await prompt.check_link_status(decoder.cluster_id)
        with pytest.raises(LLMException) as info:
            await decoder.check_link_status(new_cluster_id())
        assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        with pytest.raises(TypeError):
            await decoder.check_link_status("1")  # type: ignore[arg-type]
        cm = decoder.cache_manager
        with pytest.raises(LLMException) as info:
            cm.remap_registered_memory([MemInfo(Memtype.MEM_TYPE_DEVICE, 0x1000, 4096)])
        assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        for bad in (MemInfo(Memtype.MEM_TYPE_HOST, 0x1000, 4096), MemInfo(Memtype.MEM_TYPE_DEVICE, 0, 4096),
                    MemInfo(Memtype.MEM_TYPE_DEVICE, 0x1000, 0)):
            with pytest.raises(LLMException) as info:
                cm.remap_registered_memory(bad)
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(TypeError):
            cm.remap_registered_memory([object()])  # type: ignore[list-item]
