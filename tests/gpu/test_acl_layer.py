"""The ACL device runtime (``aiodatadist/acl``) against the emulated ``libascendcl.so``: batched bus copies and
their fallbacks, host memory that cannot be page-locked, stream faults and the jobs queued behind them,
cancellation, per-thread device binding, runtime selection, and registration rules on CANN 8.

These need the emulator's hooks (``fake_hold``, ``fake_fault``, the counters): only the "acl" runtime on its
emulated library; skipped elsewhere.  Every check is byte-exact on pattern data (never 0); nothing is timed."""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from helpers.data import fill_pattern, tensor_bytes
from helpers.device_runtimes import FAULT, fake_library, read_device, runtime_of

from aiodatadist import (
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import local_prompt

pytestmark = pytest.mark.usefixtures("device_runtime")
S = LLMStatusCode
BLOCKS, BLOCK = 64, 4096 + 16  # not a multiple of 256: unaligned spans too
DEV = CacheDesc(4, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.DEVICE)
HOST = CacheDesc(4, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.HOST)
SCATTERED = {i: BLOCKS - 1 - i for i in range(32)}  # 32 blocks reversed: no two spans merge
ACL_ERROR_RT_CONTEXT_NULL = 107002


@pytest.fixture(autouse=True)
def _emulated_acl_only(device_runtime: str, runtime_mode: str) -> Iterator[None]:
    if device_runtime != "acl" or runtime_mode != "emulated":
        pytest.skip("needs the emulated ACL runtime's hooks (tests/helpers/fake_libascendcl.c)")
    yield


def blocks_of(data: list[np.ndarray]) -> list[np.ndarray]:
    return [d.reshape(BLOCKS, BLOCK) for d in data]


def counter(dd: LLMDataDist, name: str) -> int:
    return ctypes.c_int.in_dll(fake_library(runtime_of(dd)), name).value


def counters(dd: LLMDataDist) -> dict[str, int]:
    return {name: counter(dd, name) for name in ("fake_sync_copies", "fake_async_copies", "fake_batches")}


def grown(dd: LLMDataDist, before: dict[str, int]) -> dict[str, int]:
    return {name: value - before[name] for name, value in counters(dd).items()}


def hold_of(dd: LLMDataDist) -> ctypes.c_int:
    return ctypes.c_int.in_dll(fake_library(runtime_of(dd)), "fake_hold")


async def until(condition: Callable[[], bool], what: str, tries: int = 5000) -> None:
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


async def swap_both_ways(cm: Any, dd: LLMDataDist, seed: int) -> tuple[dict[str, int], dict[str, int]]:
    """Swap 32 scattered blocks host -> device, then device -> host, checking both byte-exact; returns the
    counters' growth of each swap."""
    dev, host = cm.allocate_blocks_cache(DEV), cm.allocate_blocks_cache(HOST)
    host_data, dev_data = blocks_of(fill_pattern(host, seed)), blocks_of(fill_pattern(dev, seed + 1))
    before = counters(dd)
    await cm.swap_blocks(host, dev, SCATTERED)
    h2d = grown(dd, before)
    got = blocks_of(tensor_bytes(dev))
    for t in range(4):
        expect = dev_data[t].copy()
        expect[list(SCATTERED.values())] = host_data[t][list(SCATTERED)]
        assert np.array_equal(got[t], expect)
    back = {BLOCKS - 1 - i: i + 32 for i in range(16)}  # device blocks 63..48 -> host blocks 32..47
    before = counters(dd)
    await cm.swap_blocks(dev, host, back)
    d2h = grown(dd, before)
    out = blocks_of(tensor_bytes(host))
    for t in range(4):
        expect = host_data[t].copy()
        expect[list(back.values())] = got[t][list(back)]
        assert np.array_equal(out[t], expect)
    return h2d, d2h


# -- a: batches over the bus, none on the device ---------------------------------------------------------------
async def test_bus_swaps_go_as_batches_and_device_copies_do_not() -> None:
    async with local_prompt() as dd:
        cm = dd.cache_manager
        cache = cm.allocate_blocks_cache(DEV)
        data = blocks_of(fill_pattern(cache, 1))
        before = counters(dd)
        await cm.copy_blocks(cache, {3: [10, 11, 40], 7: [0], 20: [21]})
        d2d = grown(dd, before)
        got = blocks_of(tensor_bytes(cache))
        for t in range(4):
            expect = data[t].copy()
            expect[[10, 11, 40]] = data[t][3]
            expect[0] = data[t][7]
            expect[21] = data[t][20]
            assert np.array_equal(got[t], expect)
        assert d2d["fake_batches"] == 0, d2d  # device to device: one aclrtMemcpyAsync per span
        assert d2d["fake_async_copies"] >= 5, d2d
        h2d, d2h = await swap_both_ways(cm, dd, 2)
        for grew in (h2d, d2h):  # 128 resp. 64 spans, each direction in batches (one copy task per batch)
            assert grew["fake_batches"] >= 1, grew
            assert grew["fake_async_copies"] == grew["fake_batches"], grew
            assert grew["fake_sync_copies"] == 0, grew  # page-locked: nothing ran in the caller


# -- b: a runtime without batches ---------------------------------------------------------------------------
async def test_swaps_fall_back_to_spans_without_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ACL_NO_BATCH", "1")
    async with local_prompt() as dd:  # a fresh instance: a fresh native table (it remembers a refusal)
        h2d, d2h = await swap_both_ways(dd.cache_manager, dd, 3)
        for grew, spans in ((h2d, 4 * len(SCATTERED)), (d2h, 4 * 16)):
            assert grew["fake_batches"] == 0, grew
            assert grew["fake_async_copies"] >= spans, grew  # span by span


# -- c: host memory that cannot be page-locked --------------------------------------------------------------
async def test_pageable_host_memory_copies_synchronously_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ACL_NO_HOST_REGISTER_V2", "1")
    async with local_prompt() as dd:  # fresh: its executor has no copy kinds remembered
        cm = dd.cache_manager
        h2d, d2h = await swap_both_ways(cm, dd, 4)
        for grew in (h2d, d2h):
            assert grew["fake_sync_copies"] >= 1, grew  # ACL copied inside the call (pageable memory)
        # The loop keeps running while such a copy waits for its stream: a device copy held by fake_hold is
        # queued first, so the pageable swap (issued from a worker thread) waits behind it; a ticker on the loop
        # lets go of the hold.  Were the swap issued on the loop, the ticker could never run: the watchdog would.
        dev, host, other = cm.allocate_blocks_cache(DEV), cm.allocate_blocks_cache(HOST), cm.allocate_blocks_cache(DEV)
        host_data = blocks_of(fill_pattern(host, 5))
        other_data = blocks_of(fill_pattern(other, 6))
        fill_pattern(dev, 7)
        executor = runtime_of(dd).executor
        hold = hold_of(dd)
        watchdog_released = threading.Event()

        def watchdog() -> None:
            if hold.value:
                watchdog_released.set()
                hold.value = 0

        timer = threading.Timer(10.0, watchdog)
        hold.value = 1
        timer.start()
        try:
            held = asyncio.ensure_future(cm.copy_blocks(other, {1: [2]}))
            await until(lambda: len(executor._inflight) == 1, "the held device copy is queued")
            swap = asyncio.ensure_future(cm.swap_blocks(host, dev, SCATTERED))
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                await until(lambda: len(executor._inflight) == 2, "the pageable swap is in flight")
                for _ in range(20):
                    await asyncio.sleep(0)
                    ticks += 1
                assert not swap.done()  # still waiting behind the held copy
                hold.value = 0

            await asyncio.gather(held, swap, ticker())
        finally:
            timer.cancel()
            hold.value = 0
        assert not watchdog_released.is_set() and ticks == 20
        got = blocks_of(tensor_bytes(dev))
        moved = blocks_of(tensor_bytes(other))
        for t in range(4):
            assert np.array_equal(got[t][list(SCATTERED.values())], host_data[t][list(SCATTERED)])
            assert np.array_equal(moved[t][2], other_data[t][1])


# -- d: a fault on the executor's stream ------------------------------------------------------------------------
async def test_a_stream_fault_fails_the_copy_and_the_stream_is_reused() -> None:
    async with local_prompt() as dd:
        cm = dd.cache_manager
        cache = cm.allocate_blocks_cache(DEV)
        data = blocks_of(fill_pattern(cache, 8))
        lib = fake_library(runtime_of(dd))
        lib.fake_fault(FAULT["acl"])
        try:
            with pytest.raises(LLMException) as info:
                await cm.copy_blocks(cache, {1: [2]})
        finally:
            lib.fake_reset()
        assert info.value.status_code == S.LLM_DEVICE_MEM_ERROR
        assert "507053" in str(info.value)
        assert all(np.array_equal(a, b) for a, b in zip(blocks_of(tensor_bytes(cache)), data))  # nothing landed
        await cm.copy_blocks(cache, {1: [2], 5: [6, 7]})  # the same executor, its stream aborted and reused
        got = blocks_of(tensor_bytes(cache))
        for t in range(4):
            expect = data[t].copy()
            expect[2] = data[t][1]
            expect[[6, 7]] = data[t][5]
            assert np.array_equal(got[t], expect)


# -- e: jobs queued behind a failing one ------------------------------------------------------------------------
async def test_jobs_queued_behind_a_failed_one_fail_and_land_nothing() -> None:
    async with local_prompt() as dd:
        cm = dd.cache_manager
        cache = cm.allocate_blocks_cache(DEV)
        data = blocks_of(fill_pattern(cache, 9))
        runtime = runtime_of(dd)
        lib, hold = fake_library(runtime), hold_of(dd)
        hold.value = 1
        try:
            first = asyncio.ensure_future(cm.copy_blocks(cache, {1: [2, 3]}))
            second = asyncio.ensure_future(cm.copy_blocks(cache, {10: [11], 12: [13]}))
            await until(lambda: len(runtime.executor._inflight) == 2, "both copies are queued")
            lib.fake_fault(FAULT["acl"])
            hold.value = 0
            results = await asyncio.gather(first, second, return_exceptions=True)
        finally:
            hold.value = 0
            lib.fake_reset()
        for result in results:
            assert isinstance(result, LLMException), results
            assert result.status_code == S.LLM_DEVICE_MEM_ERROR, result
        after = blocks_of(tensor_bytes(cache))
        assert all(np.array_equal(a, b) for a, b in zip(after, data))  # nothing of either landed
        await cm.copy_blocks(cache, {10: [11]})
        got = blocks_of(tensor_bytes(cache))
        for t in range(4):
            expect = data[t].copy()
            expect[11] = data[t][10]
            assert np.array_equal(got[t], expect)


# -- f: a cancelled copy ---------------------------------------------------------------------------------------
async def test_a_cancelled_copy_returns_only_once_the_npu_is_done() -> None:
    async with local_prompt() as dd:
        cm = dd.cache_manager
        cache = cm.allocate_blocks_cache(DEV)
        runtime = runtime_of(dd)
        hold = hold_of(dd)
        size = DEV.size
        for deadline in (0.0005, 0.01):
            data = blocks_of(fill_pattern(cache, 10))
            hold.value = 1

            async def let_go(after: float) -> None:  # the copy runs only once the caller gave up
                await asyncio.sleep(after)
                hold.value = 0

            release = asyncio.ensure_future(let_go(deadline + 0.2))
            try:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(deadline):
                        await cm.copy_blocks(cache, {0: [1, 2], 30: [31]})
                returned_while_held = hold.value  # the call may return only once the NPU no longer copies for it
                snapshot = [read_device(runtime, a, size) for a in cache.tensor_addrs]  # waits for no stream
            finally:
                await release
                hold.value = 0
            assert returned_while_held == 0
            await asyncio.sleep(0.1)
            assert all(np.array_equal(read_device(runtime, a, size), s) for a, s in zip(cache.tensor_addrs, snapshot))
            for t, s in enumerate(snapshot):  # a queued copy cannot be stopped: it had landed, whole, on return
                expect = data[t].copy()
                expect[[1, 2]] = data[t][0]
                expect[31] = data[t][30]
                assert np.array_equal(s.reshape(BLOCKS, BLOCK), expect)


# -- g: threads --------------------------------------------------------------------------------------------------
def in_fresh_thread(fn: Callable[[], Any]) -> Any:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    if "error" in out:
        raise out["error"]
    return out["value"]


async def test_a_fresh_thread_is_bound_to_the_device_first() -> None:
    async with local_prompt() as dd:
        runtime = runtime_of(dd)
        before = counter(dd, "fake_set_device_calls")
        data = np.random.default_rng(11).integers(1, 256, 4096, dtype=np.uint8)

        def use_the_runtime() -> tuple[int, np.ndarray]:
            ptr = runtime.alloc(4096)
            runtime.copy_to_device(ptr, data.ctypes.data, data.nbytes)
            back = np.zeros(4096, dtype=np.uint8)
            runtime.copy_to_host(back.ctypes.data, ptr, back.nbytes)
            return ptr, back

        ptr, back = in_fresh_thread(use_the_runtime)
        try:
            assert np.array_equal(back, data)
            assert counter(dd, "fake_set_device_calls") >= before + 1
        finally:
            runtime.free(ptr)
        lib = fake_library(runtime)

        def raw_malloc() -> int:  # no aclrtSetDevice on this thread: the emulator refuses, as ACL does
            p = ctypes.c_void_p()
            return int(lib.aclrtMalloc(ctypes.byref(p), 64, 0))

        assert in_fresh_thread(raw_malloc) == ACL_ERROR_RT_CONTEXT_NULL


# -- h: choosing the runtime -----------------------------------------------------------------------------------
def run_info(**env: str) -> str:
    done = subprocess.run([sys.executable, "-m", "aiodatadist", "info"], capture_output=True, text=True, timeout=60,
                          check=False, env={**os.environ, **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_info_reports_acl_and_auto_chooses_it_without_cuda() -> None:
    from aiodatadist.acl import library as acl
    from aiodatadist.cuda import driver
    from aiodatadist.settings.environment import ENV_DEVICE_RUNTIME

    fake = os.environ[acl.ENV_LIBASCENDCL]
    out = run_info(**{ENV_DEVICE_RUNTIME: "acl", acl.ENV_LIBASCENDCL: fake})
    lines = [line for line in out.splitlines() if "ACL" in line and "verified on an emulated runtime only" in line]
    assert lines, out
    out = run_info(**{ENV_DEVICE_RUNTIME: "auto", acl.ENV_LIBASCENDCL: fake,
                      driver.ENV_LIBCUDA: "/nonexistent/libcuda.so.1"})
    lines = [line for line in out.splitlines() if line.startswith("Device runtime")]
    assert len(lines) == 1 and "ACL (chosen)" in lines[0] and "verified on an emulated runtime only" in lines[0], out


async def test_without_either_runtime_a_device_cache_names_both(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodatadist.acl import library as acl
    from aiodatadist.cuda import driver
    from aiodatadist.settings.environment import ENV_DEVICE_RUNTIME

    monkeypatch.setenv(ENV_DEVICE_RUNTIME, "auto")
    monkeypatch.setenv(driver.ENV_LIBCUDA, "/nonexistent/libcuda.so.1")
    monkeypatch.setenv(acl.ENV_LIBASCENDCL, "/nonexistent/libascendcl.so")
    monkeypatch.setattr(driver, "_driver", None)
    monkeypatch.setattr(acl, "_library", None)
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({})
        with pytest.raises(LLMException) as info:
            dd.cache_manager.allocate_blocks_cache(DEV)
        assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
        assert "CUDA" in str(info.value) and "ACL" in str(info.value), str(info.value)
        host = dd.cache_manager.allocate_blocks_cache(HOST)  # host caches are unaffected
        dd.cache_manager.deallocate_blocks_cache(host)


# -- i: registration on CANN 8 (no aclrtMemGetAddressRange) ---------------------------------------------------------
CANN8_SCRIPT = textwrap.dedent("""
    import asyncio, ctypes
    import numpy as np
    from aiodatadist import CacheDesc, DataType, LLMException, LLMStatusCode, Placement
    from aiodatadist.testing import fill_pattern, local_prompt, tensor_bytes

    HUGE = 2 << 20
    BLOCKS, BLOCK = 16, 4096 + 16
    DESC = CacheDesc(2, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.DEVICE)

    async def main():
        async with local_prompt() as dd:
            cm = dd.cache_manager
            runtime = cm._device().runtime
            library = runtime.device.library
            assert runtime.name == "acl" and library.version[:2] == (1, 16), library.version_string
            runtime.bind_thread()
            segment = ctypes.c_void_p()
            library.call("aclrtMalloc", ctypes.byref(segment), 3 * HUGE, 0)  # not through the runtime
            base = segment.value
            assert base % HUGE == 0
            addrs = [base + HUGE + t * (1 << 17) for t in range(2)]  # inside, at a 2 MiB-aligned offset
            cache = cm.register_blocks_cache(DESC, addrs)
            assert base + HUGE in runtime.device._exports  # found by the 2 MiB rounding, exported to prove it
            data = [d.reshape(BLOCKS, BLOCK) for d in fill_pattern(cache, 31)]
            await cm.copy_blocks(cache, {0: [5, 6], 9: [1]})
            got = [d.reshape(BLOCKS, BLOCK) for d in tensor_bytes(cache)]
            for t in range(2):
                expect = data[t].copy()
                expect[[5, 6]] = data[t][0]
                expect[1] = data[t][9]
                assert np.array_equal(got[t], expect), t
            cm.unregister_cache(cache.cache_id)
            host = np.ones(DESC.size * 2, dtype=np.uint8)
            try:
                cm.register_blocks_cache(DESC, [int(host.ctypes.data), int(host.ctypes.data) + DESC.size])
            except LLMException as exc:
                assert exc.status_code == LLMStatusCode.LLM_PARAM_INVALID, exc
            else:
                raise AssertionError("host memory registered as device memory")
        print("CANN8 OK")

    asyncio.run(main())
""")


def test_registration_rules_on_cann_8() -> None:
    done = subprocess.run([sys.executable, "-c", CANN8_SCRIPT], capture_output=True, text=True, timeout=60,
                          check=False, env={**os.environ, "FAKE_ACL_VERSION": "8"})
    assert done.returncode == 0 and "CANN8 OK" in done.stdout, done.stdout + done.stderr
