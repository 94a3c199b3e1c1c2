"""The GPU benchmark hooks of ``aiodatadist.testing.probes`` (what ``bench --device`` reads): timed GPU copies
of an instance, and the copy kernel alone over a descriptor table.  On a real GPU or the emulated one."""

from __future__ import annotations

import time

import numpy as np
from helpers.data import fill_pattern, tensor_bytes

from aiodatadist import CacheDesc, DataType, LLMDataDist, LLMRole, Placement
from aiodatadist.testing import probes

DEV = CacheDesc(2, (16, 4096), DataType.DT_UINT8, Placement.DEVICE)


async def test_gpu_copy_times_gives_each_copy_its_timestamps() -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({})
        cm = dd.cache_manager
        cache = cm.allocate_blocks_cache(DEV)
        data = [d.reshape(16, 4096) for d in fill_pattern(cache, 3)]
        with probes.gpu_copy_times(dd) as latest:
            start = time.perf_counter()
            await cm.copy_blocks(cache, {1: [2], 5: [9]})
            end = time.perf_counter()
            times = latest()
        assert times is not None
        assert start <= times.launch_at <= times.enqueued_at <= end
        assert times.seen_at == 0.0 or times.enqueued_at <= times.seen_at <= end
        got = [d.reshape(16, 4096) for d in tensor_bytes(cache)]
        assert all(np.array_equal(g[[2, 9]], d[[1, 5]]) for g, d in zip(got, data))


async def test_time_copy_kernel_copies_the_table_and_times_each_launch() -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({})
        device = probes.gpu(0)
        span, spans = 4096, 8
        src, dst = device.alloc(2 * spans * span), device.alloc(2 * spans * span)
        try:
            device.memset(src, 7, 2 * spans * span)
            device.memset(dst, 0, 2 * spans * span)
            offsets = np.arange(spans, dtype=np.uint64) * np.uint64(2 * span)  # every other span
            table = np.concatenate((np.uint64(src) + offsets, np.uint64(dst) + offsets,
                                    np.full(spans, span, dtype=np.uint64)))
            seconds = probes.time_copy_kernel(dd, table, spans, span, spans * span, block=128, grid=4, runs=3)
            assert len(seconds) == 3 and all(s >= 0 for s in seconds)
            out = np.zeros(2 * spans * span, dtype=np.uint8)
            device.copy_dtoh(out.ctypes.data, dst, out.nbytes)
            rows = out.reshape(2 * spans, span)
            assert (rows[0::2] == 7).all() and not rows[1::2].any()
        finally:
            device.synchronize()
            device.free(src)
            device.free(dst)

