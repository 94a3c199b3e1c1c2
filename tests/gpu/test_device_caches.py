"""DEVICE caches end to end: allocation and registration, local copies and swaps, pulls and pushes between
processes through IPC, host<->device transfers, cancellation.  Byte-exact on random data.

Once per device runtime (CUDA and ACL, see conftest.py), each on its real device or, where there is none, on its
emulated runtime: the same assertions, smaller sizes for the cancellation test."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
from helpers.data import fill_pattern, tensor_bytes
from helpers.device_runtimes import delay_env, fill_device, read_device
from helpers.internals import device_of

from aiodatadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.copy.device import IPC
from aiodatadist.testing import PeerProcess, cluster_info, free_port, linked_pair

pytestmark = pytest.mark.usefixtures("device_runtime")
S = LLMStatusCode
BLOCKS, BLOCK = 64, 4096 + 16  # deliberately not a multiple of 256: unaligned spans too
DEV = CacheDesc(4, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.DEVICE)
HOST = CacheDesc(4, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.HOST)


def blocks_of(data: list[np.ndarray]) -> list[np.ndarray]:
    return [d.reshape(BLOCKS, BLOCK) for d in data]


async def test_allocate_fill_and_read_back() -> None:
    async with linked_pair() as (prompt, _):
        cm = prompt.cache_manager
        cache = cm.allocate_blocks_cache(DEV, BlocksCacheKey(1, 0))
        data = fill_pattern(cache, 1)
        assert all(np.array_equal(a, b) for a, b in zip(data, tensor_bytes(cache)))
        assert all(a % 256 == 0 for a in cache.tensor_addrs)
        with pytest.raises(LLMException) as info:
            cache.tensors  # noqa: B018 - device tensors are not numpy arrays
        assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
        cm.deallocate_blocks_cache(cache)
        assert cache.tensor_addrs == []


async def test_copy_blocks_and_copy_cache_on_the_device() -> None:
    async with linked_pair() as (prompt, _):
        cm = prompt.cache_manager
        cache = cm.allocate_blocks_cache(DEV)
        data = blocks_of(fill_pattern(cache, 2))
        await cm.copy_blocks(cache, {3: [10, 11], 7: [0]})
        got = blocks_of(tensor_bytes(cache))
        for t in range(4):
            expect = data[t].copy()
            expect[[10, 11]] = data[t][3]
            expect[0] = data[t][7]
            assert np.array_equal(got[t], expect)
        a = cm.allocate_cache(CacheDesc(2, (4, 1000), DataType.DT_FLOAT16, Placement.DEVICE))
        b = cm.allocate_cache(CacheDesc(2, (4, 1000), DataType.DT_FLOAT16, Placement.DEVICE))
        src = fill_pattern(a, 3)
        fill_pattern(b, 4)
        await cm.copy_cache(b, a, dst_batch_index=1, src_batch_index=2)
        out = tensor_bytes(b)
        for t in range(2):
            assert np.array_equal(out[t].reshape(4, -1)[1], src[t].reshape(4, -1)[2])


@pytest.mark.parametrize("cpu", ["allocated", "create_cpu_cache"])
async def test_swap_blocks_between_host_and_device(cpu: str) -> None:
    async with linked_pair() as (prompt, _):
        cm = prompt.cache_manager
        dev = cm.allocate_blocks_cache(DEV)
        keep: list[np.ndarray] = []
        if cpu == "allocated":
            host = cm.allocate_blocks_cache(HOST)
        else:
            keep = [np.zeros(HOST.size, dtype=np.uint8) for _ in range(4)]
            host = Cache.create_cpu_cache(HOST, [int(k.ctypes.data) for k in keep])
        host_data = blocks_of(fill_pattern(host, 5))
        dev_data = blocks_of(fill_pattern(dev, 6))
        await cm.swap_blocks(host, dev, {1: 2, 5: 60, 63: 0})  # host -> device
        got = blocks_of(tensor_bytes(dev))
        for t in range(4):
            expect = dev_data[t].copy()
            expect[[2, 60, 0]] = host_data[t][[1, 5, 63]]
            assert np.array_equal(got[t], expect)
        await cm.swap_blocks(dev, host, {2: 9, 3: 10})  # device -> host
        back = blocks_of(tensor_bytes(host))
        for t in range(4):
            assert np.array_equal(back[t][9], host_data[t][1]) and np.array_equal(back[t][10], dev_data[t][3])
            assert np.array_equal(back[t][11], host_data[t][11])


async def test_concurrent_swaps_share_page_locked_host_memory() -> None:
    """Two instances and several concurrent swaps over the same caller-owned host memory: CUDA refuses to
    page-lock a page twice, so the registration is shared (process-wide, counted) and released by the last."""
    keep = [np.random.default_rng(t).integers(1, 256, HOST.size, dtype=np.uint8) for t in range(4)]
    async with linked_pair() as (prompt, decoder):
        handles = [Cache.create_cpu_cache(HOST, [int(k.ctypes.data) for k in keep]) for _ in range(2)]
        caches = [prompt.cache_manager.allocate_blocks_cache(DEV), decoder.cache_manager.allocate_blocks_cache(DEV)]
        swaps = [(cm, handles[i % 2], caches[i % 2], {i: 63 - i})
                 for i, cm in enumerate([prompt.cache_manager, decoder.cache_manager] * 3)]
        await asyncio.gather(*(cm.swap_blocks(h, c, m) for cm, h, c, m in swaps))
        for i, (_, _, cache, _) in enumerate(swaps):
            got = blocks_of(tensor_bytes(cache))
            assert all(np.array_equal(got[t][63 - i], keep[t].reshape(BLOCKS, BLOCK)[i]) for t in range(4))
        from aiodatadist.copy.device import PINNED
        assert PINNED._ranges == {}  # each swap let go of its pin


async def test_register_device_memory_the_caller_owns() -> None:
    async with linked_pair() as (prompt, decoder):
        runtime = device_of(prompt.cache_manager).runtime
        ptrs = [runtime.alloc(DEV.size) for _ in range(4)]
        try:
            cache = prompt.cache_manager.register_blocks_cache(DEV, ptrs, BlocksCacheKey(1, 0))
            data = blocks_of(fill_pattern(cache, 7))
            dst = decoder.cache_manager.allocate_blocks_cache(DEV)
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [4, 5], [0, 1])
            got = blocks_of(tensor_bytes(dst))
            assert all(np.array_equal(got[t][:2], data[t][4:6]) for t in range(4))
            prompt.cache_manager.unregister_cache(cache.cache_id)
            host = np.zeros(DEV.size, dtype=np.uint8)
            with pytest.raises(LLMException) as info:  # host memory is not device memory
                prompt.cache_manager.register_blocks_cache(DEV, [int(host.ctypes.data)] * 4)
            assert info.value.status_code == S.LLM_PARAM_INVALID
            with pytest.raises(LLMException) as info:  # a tensor running past its allocation
                prompt.cache_manager.register_blocks_cache(DEV, [ptrs[0] + 64] * 4)
            assert info.value.status_code == S.LLM_PARAM_INVALID
        finally:
            for p in ptrs:
                runtime.free(p)


@pytest.mark.parametrize(("owner", "mine"), [("DEVICE", "DEVICE"), ("HOST", "DEVICE"), ("DEVICE", "HOST")])
async def test_same_process_pull_and_push(owner: str, mine: str) -> None:
    async with linked_pair() as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(DEV if owner == "DEVICE" else HOST, BlocksCacheKey(1, 0))
        dst = decoder.cache_manager.allocate_blocks_cache(DEV if mine == "DEVICE" else HOST)
        theirs = blocks_of(fill_pattern(src, 8))
        ours = blocks_of(fill_pattern(dst, 9))
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1, 2, 3, 40], [7, 8, 9, 0])
        got = blocks_of(tensor_bytes(dst))
        for t in range(4):
            expect = ours[t].copy()
            expect[[7, 8, 9, 0]] = theirs[t][[1, 2, 3, 40]]
            assert np.array_equal(got[t], expect)
        await decoder.cache_manager.push_blocks(BlocksCacheKey(1, 0), dst, [11, 12], [50, 51],
                                                src_layer_range=range(1, 2), dst_layer_range=range(1, 2),
                                                tensor_num_per_layer=2)
        after = blocks_of(tensor_bytes(src))
        for t in range(4):
            if t in (2, 3):
                assert np.array_equal(after[t][[50, 51]], ours[t][[11, 12]])
            else:
                assert np.array_equal(after[t][[50, 51]], theirs[t][[50, 51]])


@asynccontextmanager
async def peer_prompt(placement: str) -> AsyncIterator[tuple[PeerProcess, LLMDataDist, int]]:
    """A prompt in another process with a filled blocks cache (``placement``), linked from a decoder here."""
    port = free_port()
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    peer = await PeerProcess.start()
    try:
        await peer.call("init", role="PROMPT", cluster_id=1, options=dict(cfg.generate_options()))
        cid = (await peer.call("allocate", num_tensors=4, shape=[BLOCKS, BLOCK], blocks=True, placement=placement,
                               blocks_key=[1, 0]))["cache_id"]
        await peer.call("fill", cache_id=cid, seed=11)
        async with LLMDataDist(LLMRole.DECODER, 2) as decoder:
            await decoder.init({})
            code, _ = await decoder.link_clusters([cluster_info(1, port)], timeout=10_000)
            assert code == S.LLM_SUCCESS
            yield peer, decoder, cid
        await peer.call("finalize")
    finally:
        await peer.close()


async def peer_blocks(peer: PeerProcess, cid: int) -> list[np.ndarray]:
    return [np.frombuffer(bytes.fromhex(await peer.call("read", cache_id=cid, tensor=t, offset=0,
                                                         nbytes=BLOCKS * BLOCK)), dtype=np.uint8).reshape(BLOCKS, BLOCK)
            for t in range(4)]


@pytest.mark.parametrize(("owner", "mine"), [("DEVICE", "DEVICE"), ("HOST", "DEVICE"), ("DEVICE", "HOST")])
async def test_cross_process_pull_and_push(owner: str, mine: str) -> None:
    rng = np.random.default_rng(12)
    async with peer_prompt(owner) as (peer, decoder, cid):
        cm = decoder.cache_manager
        dst = cm.allocate_blocks_cache(DEV if mine == "DEVICE" else HOST)
        ours = blocks_of(fill_pattern(dst, 13))
        theirs = await peer_blocks(peer, cid)
        src_b = [int(b) for b in rng.permutation(BLOCKS)[:20]]
        dst_b = [int(b) for b in rng.permutation(BLOCKS)[:20]]
        for _ in range(2):  # the second time the IPC handles are already open
            await cm.pull_blocks(BlocksCacheKey(1, 0), dst, src_b, dst_b)
        got = blocks_of(tensor_bytes(dst))
        for t in range(4):
            expect = ours[t].copy()
            expect[dst_b] = theirs[t][src_b]
            assert np.array_equal(got[t], expect)
        await cm.push_blocks(BlocksCacheKey(1, 0), dst, [dst_b[0]], [0])
        after = await peer_blocks(peer, cid)
        assert all(np.array_equal(after[t][0], theirs[t][src_b[0]]) for t in range(4))
        assert all(np.array_equal(after[t][1:], theirs[t][1:]) for t in range(4))
        if owner == "DEVICE":
            assert IPC._open  # opened once, shared by the process
        code, _ = await decoder.unlink_clusters([cluster_info(1, 1)], timeout=3000)
        assert code == S.LLM_SUCCESS
        assert not IPC._open  # closed with the link


async def test_a_freed_peer_allocation_is_closed_here_while_linked() -> None:
    """The owner frees a device cache: the requester closes its IPC mapping at once, not at unlink (the mapping
    would keep the freed device memory alive)."""
    async with peer_prompt("DEVICE") as (peer, decoder, cid):
        dst = decoder.cache_manager.allocate_blocks_cache(DEV)
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [1])
        assert len(IPC._open) == 1
        await peer.call("release", cache_id=cid)
        for _ in range(100):
            if not IPC._open:
                break
            await asyncio.sleep(0.02)
        assert not IPC._open
        assert len(decoder.links()) == 1  # still linked
        with pytest.raises(LLMException) as info:
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [1])
        assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


async def test_cross_process_pull_cache_by_id() -> None:
    async with peer_prompt("DEVICE") as (peer, decoder, _):
        cid = (await peer.call("allocate", num_tensors=4, shape=[BLOCKS, BLOCK], placement="DEVICE"))["cache_id"]
        await peer.call("fill", cache_id=cid, seed=14)
        whole = CacheDesc(4, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.DEVICE)
        dst = decoder.cache_manager.allocate_cache(whole)
        ours = blocks_of(fill_pattern(dst, 15))
        await decoder.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, cid, 5), dst, 2)  # their slot 5 -> our 2
        theirs = await peer_blocks(peer, cid)
        got = blocks_of(tensor_bytes(dst))
        for t in range(4):
            expect = ours[t].copy()
            expect[2] = theirs[t][5]
            assert np.array_equal(got[t], expect)


async def test_a_cancelled_device_pull_writes_nothing_after_it_returns(device_runtime: str, runtime_mode: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A device copy cannot be stopped: a cancelled pull returns only once it finished, never before."""
    if runtime_mode == "real":
        big = CacheDesc(8, (512, 1 << 20), DataType.DT_UINT8, Placement.DEVICE)  # 4 GiB each side
    else:
        big = CacheDesc(2, (512, 1 << 20), DataType.DT_UINT8, Placement.DEVICE)  # 1 GiB each side
        monkeypatch.setenv(delay_env(device_runtime), "30000")  # every stream operation starts 30 ms late
    async with linked_pair() as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(big, BlocksCacheKey(1, 0))
        dst = decoder.cache_manager.allocate_blocks_cache(big)
        runtime = device_of(prompt.cache_manager).runtime
        for a in src.tensor_addrs:
            fill_device(runtime, a, 0x5A, big.size)
        for a in dst.tensor_addrs:
            fill_device(runtime, a, 0x00, big.size)
        blocks = list(range(512))
        for deadline in (0.0001, 0.0005, 0.002):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(deadline):
                    await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks)
            snapshot = [read_device(runtime, a + (511 << 20), 1 << 20) for a in dst.tensor_addrs]
            await asyncio.sleep(0.05)
            for a, before in zip(dst.tensor_addrs, snapshot):
                assert np.array_equal(read_device(runtime, a + (511 << 20), 1 << 20), before)  # nothing landed after
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [1])  # still usable
        assert (tensor_bytes(dst)[0].reshape(512, -1)[1] == 0x5A).all()


async def test_the_event_loop_keeps_running_during_device_copies() -> None:
    """Awaiting a GPU copy never blocks the loop: a ticker keeps ticking through 20 large copies."""
    big = CacheDesc(4, (64, 1 << 20), DataType.DT_UINT8, Placement.DEVICE)
    async with linked_pair() as (prompt, _):
        cm = prompt.cache_manager
        a, b = cm.allocate_blocks_cache(big), cm.allocate_blocks_cache(big)
        gaps: list[float] = []

        async def ticker(stop: asyncio.Event) -> None:
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        stop = asyncio.Event()
        task = asyncio.create_task(ticker(stop))
        mapping: dict[int, int] = {i: 63 - i for i in range(32)}
        for _ in range(20):
            await cm.swap_blocks(a, b, mapping)
        stop.set()
        await task
        # A loop blocked by each copy would tick once per copy, each gap a whole copy long: most gaps would be long.
        # One long gap is only the machine's scheduler (a loaded 2-vCPU machine gave 174 ms once).
        assert gaps and sorted(gaps)[len(gaps) // 2] < 0.05, sorted(gaps)[-5:]


def test_bench_device_runs_and_checks_its_bytes(device_runtime: str, tmp_path: Path) -> None:
    """``bench --device`` end to end (its own byte checks included); on the emulated GPU the figures mean
    nothing, only that every workload runs.  (A test of the benchmarks distribution kept here, beside the GPU
    fixtures it runs on.)  On ACL: the NPU bench (``aiodatadist_benchmarks.bench.npu``) instead."""
    if device_runtime == "acl":
        pytest.importorskip("aiodatadist_benchmarks", reason="the benchmarks are not installed")
        done = subprocess.run([sys.executable, "-m", "aiodatadist_benchmarks.bench.npu", "--repeat", "1", "--quick"],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        rows = [line for line in done.stdout.splitlines() if "x aclrtMemcpy" in line]
        assert len(rows) == 6 and "FAILED" not in done.stdout, done.stdout
        return
    pytest.importorskip("aiodatadist_benchmarks",
                    reason="the benchmarks are not installed (pip install -e ./benchmarks)")
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "aiodatadist", "bench", "--device", "--repeat", "1", "--quiet",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["results"]
    phases = ["host before the launch", "driver calls to enqueue", "launch to end seen", "GPU end to end seen",
              "end seen to return"]
    assert [r["name"] for r in rows] == [
        "d2d pull", "d2d pull, 2 calls in flight", "d2d pull 2 MiB", *(f"2 MiB: {p}" for p in phases),
        "d2d pull 2 MiB, new blocks",
        *(f"new blocks: {p}" for p in phases), "d2d push",
        *(row for label in ("d2d pull", "d2d push") for row in (f"{label}: kernel alone", *(f"{label}: {p}" for p in phases))),
        "swap h2d", "swap d2h", "host->dev pull",
        "kernel 256 x 8/SM", "kernel 256 x 4/SM", "kernel 256 x 2/SM", "kernel 128 x 16/SM", "kernel 128 x 8/SM",
        "kernel 64 x 32/SM", "kernel 64 x 16/SM"]
    assert [r for r in rows if "gbps" in r and not (r["gbps"] > 0 and r["ratio"] > 0)] == []
    for at in (2, 8):
        latency = rows[at]
        assert latency["runs"] >= 200 and 0 < latency["p50_us"] <= latency["p99_us"]
        for phase in rows[at + 1:at + 6]:  # every call's copy completed through its polled event: all have phases
            assert phase["runs"] == latency["runs"] and 0 < phase["p50_us"] <= phase["p99_us"]
    for at in (15, 21):  # the 256 MiB rows again, timed: the kernel's own rate, then every call's phases
        assert rows[at]["gbps"] > 0
        assert all(phase["runs"] == 5 and 0 < phase["p50_us"] <= phase["p99_us"] for phase in rows[at + 1:at + 6])


async def test_a_requester_without_its_device_runtime_gets_a_clear_error_and_keeps_its_link(
        device_runtime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only decoder pulling a prompt's device cache: LLM_FEATURE_NOT_ENABLED saying why, and the link
    still moves host caches."""
    from aiodatadist.acl import library as acl
    from aiodatadist.cuda import driver

    port = free_port()
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    peer = await PeerProcess.start()
    try:
        await peer.call("init", role="PROMPT", cluster_id=1, options=dict(cfg.generate_options()))
        await peer.call("allocate", num_tensors=4, shape=[BLOCKS, BLOCK], blocks=True, placement="DEVICE",
                        blocks_key=[1, 0])
        host_cid = (await peer.call("allocate", num_tensors=4, shape=[BLOCKS, BLOCK], blocks=True,
                                    placement="HOST", blocks_key=[1, 1]))["cache_id"]
        await peer.call("fill", cache_id=host_cid, seed=21)
        # this process: no device runtime at all
        monkeypatch.setenv(driver.ENV_LIBCUDA, "/nonexistent/libcuda.so.1")
        monkeypatch.setenv(acl.ENV_LIBASCENDCL, "/nonexistent/libascendcl.so")
        monkeypatch.setattr(driver, "_driver", None)
        monkeypatch.setattr(acl, "_library", None)
        library = "libcuda" if device_runtime == "cuda" else "libascendcl"
        async with LLMDataDist(LLMRole.DECODER, 2) as decoder:
            await decoder.init({})
            code, _ = await decoder.link_clusters([cluster_info(1, port)], timeout=10_000)
            assert code == S.LLM_SUCCESS
            dst = decoder.cache_manager.allocate_blocks_cache(HOST)
            for _ in range(2):
                with pytest.raises(LLMException) as info:
                    await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
                assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
                assert library in str(info.value)
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 1), dst, [3], [4])
            theirs = await peer_blocks(peer, host_cid)
            assert all(np.array_equal(blocks_of(tensor_bytes(dst))[t][4], theirs[t][3]) for t in range(4))
            await peer.call("release", cache_id=host_cid)  # its FREED is handled without CUDA too
            await asyncio.sleep(0.1)
            assert len(decoder.links()) == 1
        await peer.call("finalize")
    finally:
        await peer.close()
