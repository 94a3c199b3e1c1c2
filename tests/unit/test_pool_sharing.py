"""How the native pool shares a job among its workers and when the event loop polls for its end: a job of a chunk
per worker is woken onto every worker it needs, and it is polled for only where that leaves each of its workers a
CPU (polling takes one)."""

from __future__ import annotations

import asyncio
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodatadist._env_knobs import env_knobs_cache_clear
from aiodatadist.copy import spans
from aiodatadist.copy.completion import _short_waits
from aiodatadist.copy.native_pool import NativeExecutor
from aiodatadist.copy.spans import (
    SINGLE_CHUNK,
    STREAMING_THRESHOLD,
    _cpu0_caches,
    _level2_cache_bytes,
    measured_streaming_share,
    streaming_share,
)
from aiodatadist.layout import CacheGeometry, CopyPlan, Spans, b2b_runs, make_plan
from aiodatadist.native import CopySpec, Streaming, native_pool

pytestmark = pytest.mark.skipif(native_pool() is None, reason="the native helper is not built")

MIB = 1 << 20


@pytest.fixture
def no_spinning(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Idle workers sleep at once (none spins for new work): every job starts with wake-ups."""
    monkeypatch.setenv("AIODATADIST_COPY_SPIN_US", "0")
    monkeypatch.setenv("AIODATADIST_POLL_US", "300")
    env_knobs_cache_clear()
    yield
    env_knobs_cache_clear()


def contiguous(src: np.ndarray, dst: np.ndarray, pieces: int) -> Spans:
    """``src`` onto ``dst`` as ``pieces`` spans."""
    step = src.nbytes // pieces
    offsets = np.arange(pieces, dtype=np.uint64) * np.uint64(step)
    return Spans(np.uint64(src.ctypes.data) + offsets, np.uint64(dst.ctypes.data) + offsets,
                 np.full(pieces, step, dtype=np.uint64))


@pytest.mark.parametrize(("workers", "cpus", "nbytes", "chunks", "polled"), [
    (2, 2, 256 << 10, 1, True),        # one worker: the loop polls on the other CPU
    (2, 2, SINGLE_CHUNK, 1, True),
    (2, 2, 2 * MIB, 2, False),         # both workers, one per CPU: the loop sleeps
    (2, 4, 2 * MIB, 2, True),          # a CPU left over for the polling loop
    (1, 2, 2 * MIB, 1, True),
    (4, 4, 2 * MIB, 4, False),
    (4, 8, 2 * MIB, 4, True),
    (2, 2, 64 * MIB, 4, False),        # too long to be polled for anywhere
    (2, 8, 64 * MIB, 4, False),
])
def test_a_job_is_polled_for_only_where_each_of_its_workers_keeps_a_cpu(
        no_spinning: None, workers: int, cpus: int, nbytes: int, chunks: int, polled: bool) -> None:
    executor = NativeExecutor(workers)
    try:
        executor.cpus = cpus
        chunk, polls = executor._sizing(nbytes, None)
        assert (-(-nbytes // chunk), polls) == (chunks, polled)
        assert executor._sizing(nbytes, nbytes)[1] == (nbytes <= 300e-6 * 8e9)  # one chunk: polled if short
    finally:
        executor.shutdown()


def _run_ns(tids: set[int]) -> dict[int, int]:
    """Nanoseconds each of these threads of this process has run (``/proc/self/task/*/schedstat``)."""
    return {tid: int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) for tid in tids}


def _threads() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/task")}


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs Linux's per-thread schedstat")
@pytest.mark.parametrize("chunk", [32 * MIB, 4 * MIB])  # a chunk per worker, and many
async def test_a_job_of_several_chunks_runs_on_every_worker(no_spinning: None, chunk: int) -> None:
    """The submitter wakes every worker such a job needs (the worker that takes its first chunk wakes nobody for
    it: woken from there, a worker was queued behind it on its busy CPU, for milliseconds, and often found
    nothing left)."""
    before = _threads()
    executor = NativeExecutor(2)
    workers = _threads() - before - {threading.get_native_id()}
    rng = np.random.default_rng(11)
    src = rng.integers(1, 256, 64 * MIB, dtype=np.uint8)
    try:
        assert len(workers) == 2
        shared = []
        for attempt in range(3):  # each worker's share takes milliseconds; a busy machine may still delay one
            dst = np.zeros_like(src)
            await asyncio.sleep(0.05)  # both workers asleep
            ran = _run_ns(workers)
            await executor.run(contiguous(src, dst, 64), CopySpec(), chunk_bytes=chunk)
            assert np.array_equal(dst, src)
            shared.append(sum(after > ran[tid] for tid, after in _run_ns(workers).items()))
            if shared[-1] == 2:
                break
        assert 2 in shared, shared
    finally:
        await asyncio.to_thread(executor.shutdown)


@pytest.mark.parametrize("spin_us", ["0", "200"])
async def test_jobs_of_any_number_of_chunks_land_with_workers_asleep_or_spinning(
        monkeypatch: pytest.MonkeyPatch, spin_us: str) -> None:
    monkeypatch.setenv("AIODATADIST_COPY_SPIN_US", spin_us)
    env_knobs_cache_clear()
    executor = NativeExecutor(3)
    rng = np.random.default_rng(12)
    try:
        for round_ in range(6):
            sizes = [(chunks, int(rng.integers(1, 4)) * (256 << 10)) for chunks in (1, 2, 3, 4, 7)]
            srcs = [rng.integers(1, 256, chunks * size, dtype=np.uint8) for chunks, size in sizes]
            dsts = [np.zeros_like(s) for s in srcs]
            if round_ % 2:
                await asyncio.sleep(0.01)  # every worker asleep (or spinning) before the next jobs
            jobs = [executor.start(contiguous(s, d, chunks), CopySpec(), chunk_bytes=size)
                    for (chunks, size), s, d in zip(sizes, srcs, dsts)]
            await asyncio.wait_for(asyncio.gather(*(executor.wait(job) for job in jobs)), 10)
            for s, d in zip(srcs, dsts):
                assert np.array_equal(d, s)
        assert _short_waits(asyncio.get_running_loop()).pollers == 0
    finally:
        await asyncio.to_thread(executor.shutdown)
        env_knobs_cache_clear()


async def test_local_copies_stream_once_the_jobs_queued_together_reach_the_limit() -> None:
    """A copy small enough to stay in the CPU caches streams (non-temporal stores) while other jobs queued with it
    add up to :data:`STREAMING_THRESHOLD`: together they cannot stay cached."""
    lib = native_pool()
    assert lib is not None
    executor = NativeExecutor(2)
    rng = np.random.default_rng(13)
    big = max(STREAMING_THRESHOLD, 64 * MIB)
    big_src = rng.integers(1, 256, big, dtype=np.uint8)
    src = rng.integers(1, 256, (3, 1 * MIB), dtype=np.uint8)
    big_dst, dst = np.zeros_like(big_src), np.zeros_like(src)
    cached = CopySpec()  # streaming not asked for
    try:
        alone = executor.start(contiguous(src[0], dst[0], 16), cached)
        assert lib.adt_job_streams(alone.handle) == 0  # (read before the loop could reap it)
        await executor.wait(alone)
        busy = executor.start(contiguous(big_src, big_dst, 64), cached, chunk_bytes=big)  # milliseconds of copy
        assert lib.adt_job_streams(busy.handle) == 1  # as big as the limit by itself
        beside = executor.start(contiguous(src[1], dst[1], 16), cached)
        assert lib.adt_job_streams(beside.handle) == 1
        await asyncio.gather(executor.wait(busy), executor.wait(beside))
        assert np.array_equal(big_dst, big_src)
        stopped = executor.start(contiguous(big_src, big_dst, 64), cached, chunk_bytes=big)
        executor.cancel(stopped)  # a stopped job leaves the count too
        await executor.wait(stopped)
        assert stopped.stopped.is_set()
        after = executor.start(contiguous(src[2], dst[2], 16), cached)
        assert lib.adt_job_streams(after.handle) == 0  # the others are done: nothing queued with it
        await executor.wait(after)
        assert np.array_equal(dst, src)
    finally:
        await asyncio.to_thread(executor.shutdown)


def _blocks_plan(tensors: int, block: int) -> CopyPlan:
    """Block 0 of each of ``tensors`` tensors of two blocks onto block 1."""
    geometry = CacheGeometry(tensors, 2 * block, 2, True)
    return make_plan(np.arange(tensors), np.arange(tensors), b2b_runs([0], [1], geometry, geometry))


@pytest.mark.parametrize("share", [0, MIB])
@pytest.mark.parametrize("by_plan", [False, True])
async def test_a_local_job_streams_once_a_workers_share_is_too_big_for_its_cache(share: int, by_plan: bool) -> None:
    """Where this machine's streaming stores beat its caches (``stream_share`` > 0), a local job whose chunks reach
    the share streams and a smaller one does not; with no share (0), neither does.  Both land byte-exact, queued
    as span lists or as plans (transfers)."""
    lib = native_pool()
    assert lib is not None
    executor = NativeExecutor(2, stream_share=share)
    rng = np.random.default_rng(17)
    tensors, block = 64, 32 << 10  # 2 MiB a job: 1 MiB a worker
    caches = rng.integers(1, 256, (2, tensors, 2, block), dtype=np.uint8)
    expected = caches.copy()
    expected[:, :, 1] = expected[:, :, 0]

    def start(cache: np.ndarray, chunk: int | None) -> Any:
        if by_plan:
            addrs = np.array([cache[t].ctypes.data for t in range(tensors)], dtype=np.uint64)
            return executor.start_plan(_blocks_plan(tensors, block), addrs, addrs, CopySpec(), chunk_bytes=chunk)
        return executor.start(_block_spans(cache), CopySpec(), chunk_bytes=chunk)

    try:
        big = start(caches[0], None)
        # (read before the loop could reap it) a span at a time: its source is likely in the shared cache
        assert lib.adt_job_streams(big.handle) == (Streaming.ALONE if share else Streaming.PLAIN)
        small = start(caches[1], share // 2 or MIB // 2)
        assert lib.adt_job_streams(small.handle) == 0
        await asyncio.gather(executor.wait(big), executor.wait(small))
        assert np.array_equal(caches, expected)
    finally:
        await asyncio.to_thread(executor.shutdown)


def _block_spans(cache: np.ndarray) -> Spans:
    """Block 0 of each tensor of ``cache`` (tensors x 2 blocks x bytes) onto its block 1, a span each."""
    tensors, _, block = cache.shape
    starts = np.uint64(cache.ctypes.data) + np.arange(tensors, dtype=np.uint64) * np.uint64(2 * block)
    return Spans(starts, starts + np.uint64(block), np.full(tensors, block, dtype=np.uint64))


def test_the_share_from_which_copies_stream_is_half_the_level2_cache_or_none() -> None:
    """Measured once per process: half the level-2 cache where streaming stores copy that much faster than the
    caches, else 0; the measurement itself answers 0 or 1 (-1 only without memory)."""
    lib = native_pool()
    assert lib is not None
    share = streaming_share()
    assert share in (0, _level2_cache_bytes() // 2)
    assert streaming_share() == share  # (once)
    assert measured_streaming_share() == share
    assert lib.adt_streaming_beats_cache(256 << 10) in (0, 1)
    assert lib.adt_streaming_beats_cache(0) == 0


def test_a_level2_cache_too_big_for_a_core_is_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond :data:`~aiodatadist.copy.spans.PROBE_MAX` the level-2 cache is not a core's own: no measurement
    (which would copy eight times its size), no streaming share."""

    class NoProbe:
        def adt_streaming_beats_cache(self, nbytes: int) -> int:
            raise AssertionError(f"measured {nbytes} bytes")

    monkeypatch.setattr(spans, "_share", None)
    monkeypatch.setattr(spans, "native_pool", NoProbe)
    monkeypatch.setattr(spans, "_level2_cache_bytes", lambda: 2 * spans.PROBE_MAX)
    assert streaming_share() == 0


async def test_an_executor_measures_the_share_on_a_thread_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first executor of a process copies with plain stores until the share is measured (off the event loop,
    whose thread never waits for it); later ones start with the measured share."""
    monkeypatch.setattr(spans, "_share", None)
    loop_thread = threading.get_ident()
    measuring: list[int] = []
    real = spans._level2_cache_bytes

    def level2() -> int:
        measuring.append(threading.get_ident())
        return real()

    monkeypatch.setattr(spans, "_level2_cache_bytes", level2)
    first = NativeExecutor(2)
    try:
        for _ in range(500):
            measured = measured_streaming_share()
            if measured is not None and first.stream_share == measured:
                break
            await asyncio.sleep(0.01)
        assert measured is not None and first.stream_share == measured
        assert measured in (0, real() // 2)
        assert measuring and loop_thread not in measuring
        second = NativeExecutor(2)
        assert second.stream_share == measured
        await asyncio.to_thread(second.shutdown)
    finally:
        await asyncio.to_thread(first.shutdown)


def _fake_cache(root: Path, index: int, level: str, kind: str, size: str) -> None:
    entry = root / f"index{index}"
    entry.mkdir()
    (entry / "level").write_text(level + "\n")
    (entry / "type").write_text(kind + "\n")
    (entry / "size").write_text(size + "\n")


def test_cpu_caches_are_read_by_level_without_the_instruction_cache(tmp_path: Path) -> None:
    _fake_cache(tmp_path, 0, "1", "Data", "48K")
    _fake_cache(tmp_path, 1, "1", "Instruction", "64K")
    _fake_cache(tmp_path, 2, "2", "Unified", "2048K")
    _fake_cache(tmp_path, 3, "3", "Unified", "491520K")
    _fake_cache(tmp_path, 4, "x", "Unified", "1M")  # unreadable entries are skipped
    (tmp_path / "index5").mkdir()  # an entry without a type: a data or unified cache
    (tmp_path / "index5" / "level").write_text("4\n")
    (tmp_path / "index5" / "size").write_text("64M\n")
    (tmp_path / "uevent").write_text("")
    assert _cpu0_caches(str(tmp_path)) == {1: 48 << 10, 2: 2 * MIB, 3: 480 * MIB, 4: 64 * MIB}
    assert _cpu0_caches(str(tmp_path / "missing")) == {}


def test_a_child_forked_while_the_share_is_measured_measures_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement holds a lock for milliseconds: a process forked meanwhile must not inherit it held (its
    own measurement would wait forever)."""
    monkeypatch.setattr(spans, "_share", None)
    with spans._share_lock, warnings.catch_warnings():  # as a measuring thread holds it
        warnings.simplefilter("ignore", DeprecationWarning)  # (forking a process with threads, Python 3.12+)
        pid = os.fork()
        if pid == 0:  # the child: measure, or be killed by the parent
            try:
                os._exit(0 if streaming_share() in (0, spans._level2_cache_bytes() // 2) else 1)
            finally:
                os._exit(2)
    for _ in range(1000):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        threading.Event().wait(0.01)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's measurement waited for its parent's lock")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
