"""The event loop polls short native copy jobs for a while after queueing them; a poll that runs out of time
(the worker had no CPU, or the job was slower than expected) leaves the next jobs unpolled, more each time, so
a busy machine does not pay for polling that does not help.  Every job still completes through its announcement."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from aiodatadist.copy import native_pool
from aiodatadist.copy.native_pool import NativeExecutor
from aiodatadist.layout import Spans
from aiodatadist.native import CopySpec, native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="the native helper is not built")


def _spans(src: np.ndarray, dst: np.ndarray) -> Spans:
    return Spans(np.array([src.ctypes.data], dtype=np.uint64), np.array([dst.ctypes.data], dtype=np.uint64),
                 np.array([src.nbytes], dtype=np.uint64))


def test_a_poll_that_runs_out_of_time_leaves_the_next_jobs_unpolled() -> None:
    rng = np.random.default_rng(5)
    big_src, big_dst = rng.integers(1, 256, 64 << 20, dtype=np.uint8), np.zeros(64 << 20, dtype=np.uint8)
    src, dst = rng.integers(1, 256, 4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    executor = NativeExecutor(workers=1)

    async def main() -> None:
        copier = CopySpec(pid=os.getpid())
        busy = executor.start(_spans(big_src, big_dst), copier, chunk_bytes=64 << 20)  # the only worker: busy
        small = executor.start(_spans(src, dst), copier)  # queued behind it: cannot end before busy
        executor._watch(small, until=0.0)  # a poll past its time, its job not done
        assert (executor._poll_backoff, executor._poll_skip) == (1, 1)
        executor._watch(small, until=0.0)
        assert (executor._poll_backoff, executor._poll_skip) == (2, 2)
        unpolled = executor.start(_spans(src, dst), copier)
        assert executor._poll_skip == 1  # this one went unpolled
        await asyncio.gather(executor.wait(busy), executor.wait(small), executor.wait(unpolled))
        assert np.array_equal(dst, src) and np.array_equal(big_dst[-4096:], big_src[-4096:])
        dst[:] = 0
        executor._poll_skip = 0
        polled = executor.start(_spans(src, dst), copier)
        await executor.wait(polled)
        executor._watch(polled, until=0.0)  # a poll that finds its job done ends the backoff
        assert executor._poll_backoff == 0 and np.array_equal(dst, src)

    try:
        asyncio.run(main())
    finally:
        executor.shutdown()


def test_the_backoff_is_bounded() -> None:
    executor = NativeExecutor(workers=1)
    try:
        executor._poll_backoff = native_pool.MAX_POLL_SKIP

        async def main() -> None:
            rng = np.random.default_rng(6)
            big_src, big_dst = rng.integers(1, 256, 64 << 20, dtype=np.uint8), np.zeros(64 << 20, dtype=np.uint8)
            src, dst = rng.integers(1, 256, 64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
            busy = executor.start(_spans(big_src, big_dst), CopySpec(), chunk_bytes=64 << 20)
            small = executor.start(_spans(src, dst), CopySpec())
            executor._watch(small, until=0.0)
            assert executor._poll_backoff == native_pool.MAX_POLL_SKIP
            await asyncio.gather(executor.wait(busy), executor.wait(small))
            assert np.array_equal(dst, src)

        asyncio.run(main())
    finally:
        executor.shutdown()
