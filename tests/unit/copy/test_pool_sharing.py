"""How the native pool shares a job among its workers and when the event loop polls for its end: a job of a chunk
per worker is woken onto every worker it needs, and it is polled for only where that leaves each of its workers a
CPU (polling takes one)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodatadist.copy import native_pool as native_pool_module
from aiodatadist.copy import spans
from aiodatadist.copy.native_pool import NativeExecutor
from aiodatadist.copy.spans import (
    STREAMING_THRESHOLD,
    _cpu0_caches,
    _level2_cache_bytes,
    measured_streaming_share,
    streaming_share,
)
from aiodatadist.jobs.chunks import SINGLE_CHUNK
from aiodatadist.jobs.completion import _short_waits
from aiodatadist.layout.plans import CacheGeometry, CopyPlan, Spans, b2b_runs, make_plan
from aiodatadist.native import CopySpec, Streaming, native_pool
from aiodatadist.settings.environment import env_knobs_cache_clear

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


def _state(tid: int) -> str:
    """A thread's scheduler state (``/proc/self/task/*/stat``): R running, S asleep..."""
    return Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def _until_asleep(tids: set[int], within: float = 30.0) -> dict[int, int]:
    """Wait until these threads sleep and stay asleep (their run time unchanged for 20 ms); their run times."""
    deadline = time.monotonic() + within
    ran = _run_ns(tids)
    while True:
        await asyncio.sleep(0.02)
        now = _run_ns(tids)
        if now == ran and all(_state(tid) == "S" for tid in tids):
            return now
        assert time.monotonic() < deadline, f"the workers never all slept in {within} s: {now} after {ran}"
        ran = now


async def _until_ran(tids: set[int], since: dict[int, int], within: float = 30.0) -> None:
    """Wait until each of these threads has run since ``since`` (its run times)."""
    deadline = time.monotonic() + within
    while not all(after > since[tid] for tid, after in _run_ns(tids).items()):
        assert time.monotonic() < deadline, \
            f"a worker was never woken in {within} s: {_run_ns(tids)}, asleep at {since}"
        await asyncio.sleep(0.005)


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs Linux's per-thread schedstat")
@pytest.mark.parametrize("chunk", [32 * MIB, 4 * MIB])  # a chunk per worker, and many
async def test_a_job_of_several_chunks_runs_on_every_worker(no_spinning: None, chunk: int) -> None:
    """The submitter wakes every worker such a job needs (the worker that takes its first chunk wakes nobody for
    it: woken from there, a worker was queued behind it on its busy CPU, for milliseconds, and often found
    nothing left).

    With both workers asleep (none spins) and nothing else queued, each worker runs again only if something
    woke it for this job; whether it gets its CPU before the other worker copies everything is the scheduler's
    business (on one busy CPU, often not), so what is asserted is that each runs, without a deadline on when."""
    before = _threads()
    executor = NativeExecutor(2, stream_share=0)  # (no thread of its own measuring the share)
    workers = _threads() - before - {threading.get_native_id()}
    rng = np.random.default_rng(11)
    src = rng.integers(1, 256, 64 * MIB, dtype=np.uint8)
    try:
        assert len(workers) == 2
        for _round in range(2):  # workers fresh from their start, then after a job
            dst = np.zeros_like(src)
            ran = await _until_asleep(workers)
            await asyncio.wait_for(executor.run(contiguous(src, dst, 64), CopySpec(), chunk_bytes=chunk), 30)
            assert np.array_equal(dst, src)
            await _until_ran(workers, ran)
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
            await asyncio.wait_for(asyncio.gather(*(executor.wait(job) for job in jobs)), 30)
            for s, d in zip(srcs, dsts):
                assert np.array_equal(d, s)
        assert _short_waits(asyncio.get_running_loop()).pollers == 0
    finally:
        await asyncio.to_thread(executor.shutdown)
        env_knobs_cache_clear()


async def test_local_copies_stream_once_the_jobs_queued_together_reach_the_limit() -> None:
    """A copy small enough to stay in the CPU caches streams (non-temporal stores) while other jobs queued with it
    add up to :data:`STREAMING_THRESHOLD`: together they cannot stay cached.

    The pool decides at submit, from the bytes of the jobs submitted and not ended then (``queued`` in
    ``native/src/pool.c``), so each expectation here is read from the state at that submit, never from which
    thread finishes first: a job is "queued with" another only while that one is known not to have ended."""
    lib = native_pool()
    assert lib is not None
    executor = NativeExecutor(2, stream_share=0)  # no share: only the jobs queued together decide
    rng = np.random.default_rng(13)
    limit = STREAMING_THRESHOLD  # (this machine's: an eighth of its last-level cache, at least 1 MiB)
    small = limit // 4  # under the limit alone, and beside another small one
    src = rng.integers(1, 256, (3, small), dtype=np.uint8)
    big_src = rng.integers(1, 256, limit, dtype=np.uint8)
    big_dst, dst = np.zeros_like(big_src), np.zeros_like(src)
    cached = CopySpec()  # streaming not asked for
    try:
        alone = executor.start(contiguous(src[0], dst[0], 16), cached)
        assert lib.adt_job_streams(alone.handle) == 0  # (read before the loop could reap it)
        await executor.wait(alone)
        whole = executor.start(contiguous(big_src, big_dst, 64), cached, chunk_bytes=limit)
        assert lib.adt_job_streams(whole.handle) == 1  # as big as the limit by itself
        await executor.wait(whole)  # ended: it leaves the count (see `after`)
        assert np.array_equal(big_dst, big_src)
        # Beside a job that is still queued: `busy` copies one MiB over itself again and again (16 GiB: a
        # second or more on any machine), stopped once `beside` was submitted and `busy` seen not ended.
        loop_buffer = rng.integers(1, 256, MIB, dtype=np.uint8)
        repeats = max(16 << 10, 2 * limit // MIB)
        starts = np.full(repeats, loop_buffer.ctypes.data, dtype=np.uint64)
        forever = Spans(starts, starts.copy(), np.full(repeats, MIB, dtype=np.uint64))
        for _attempt in range(5):
            busy = executor.start(forever, cached)
            beside = executor.start(contiguous(src[1], dst[1], 16), cached)
            beside_streams = lib.adt_job_streams(beside.handle)
            # Not ended after `beside`'s submit, so counted at it (a worker leaves the count as it marks a job
            # done, and `busy` cannot end before its last MiB, or its stop below).
            counted = not busy.ended()
            executor.cancel(busy)  # a stopped job leaves the count too (see `after`)
            await asyncio.wait_for(asyncio.gather(executor.wait(busy), executor.wait(beside)), 30)
            assert busy.stopped.is_set()
            if counted:
                break
        assert counted, "16 GiB of copying ended before the next line ran, five times: the test cannot tell"
        assert beside_streams == 1
        stopped = executor.start(contiguous(big_src, big_dst, 64), cached, chunk_bytes=limit)
        executor.cancel(stopped)  # stopped before (or while) it runs
        await executor.wait(stopped)
        assert stopped.stopped.is_set()
        after = executor.start(contiguous(src[2], dst[2], 16), cached)
        assert lib.adt_job_streams(after.handle) == 0  # the others ended or were stopped: none queued with it
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
async def test_a_local_job_streams_once_a_workers_share_is_too_big_for_its_cache(
        monkeypatch: pytest.MonkeyPatch, share: int, by_plan: bool) -> None:
    """Where this machine's streaming stores beat its caches (``stream_share`` > 0), a local job whose chunks
    reach the share streams and a smaller one does not; with no share (0), neither does.  Both land byte-exact,
    queued as span lists or as plans (transfers), one beside the other.

    The share decides on its own here: the executor is given it (never this machine's level-2 cache), and its
    pool never streams for the jobs queued together (a limit of 0; that rule has a test of its own above).
    With this machine's limit the second job's outcome would depend on whether the first had ended when it was
    submitted (2 + 2 MiB reach a 4 MiB limit, from a 32 MiB last-level cache), and a limit of 1 or 2 MiB (a
    cache of 16 MiB or less) streams both jobs by themselves."""
    monkeypatch.setattr(native_pool_module, "STREAMING_THRESHOLD", 0)  # read as the executor starts its pool
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
        assert executor.chunk_bytes_for(tensors * block) == MIB  # the first job's chunks: one a worker
        big = start(caches[0], None)
        # (read before the loop could reap it) a span at a time: its source is likely in the shared cache
        assert lib.adt_job_streams(big.handle) == (Streaming.ALONE if share else Streaming.PLAIN)
        small = start(caches[1], share // 2 or MIB // 2)  # whether or not `big` has ended
        assert lib.adt_job_streams(small.handle) == Streaming.PLAIN
        await asyncio.wait_for(asyncio.gather(executor.wait(big), executor.wait(small)), 30)
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
        deadline = time.monotonic() + 30  # (about 2 ms of copying, on a thread that may wait for a CPU)
        while True:
            measured = measured_streaming_share()
            if measured is not None and first.stream_share == measured or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        assert measured is not None and first.stream_share == measured, "the share was not measured in 30 s"
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
    deadline = time.monotonic() + 30  # (its measurement copies for milliseconds; a loaded machine may take 10x)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline:
            break
        threading.Event().wait(0.01)
    if not done:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's measurement waited for its parent's lock")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
