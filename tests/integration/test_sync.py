"""The blocking API (``aiodatadist.sync``) with real parts: many threads at once, byte-exact, between two sync
instances of this process and against a peer process; timeouts, interrupts, the futures form, finalize from
another thread, the wrong-loop error of the asyncio API, and interpreter exit in subprocesses with a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from helpers.data import fill_rows, pattern, row_views
from helpers.ids import new_cluster_id

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMException,
    LLMRole,
    LLMStatusCode,
    LLMTimeoutError,
    Placement,
    sync,
)
from aiodatadist import LLMDataDist as AsyncLLMDataDist
from aiodatadist.sync import runner as _loop_thread
from aiodatadist.testing import PeerProcess, cluster_info, free_port

THREADS = 16
TENSORS, BLOCKS, BLOCK = 8, 256, 4 << 10  # 8 MiB per cache
PER_THREAD = BLOCKS // 2 // THREADS  # each thread pulls into 8 blocks of the lower half, pushes 8 of the upper
ROUNDS = 4
BIG_TENSORS, BIG_BLOCKS, BIG_BLOCK = 16, 256, 32 << 10  # 128 MiB: a transfer that takes tens of ms over TCP
POISON = 0xA5


def _desc() -> CacheDesc:
    return CacheDesc(TENSORS, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.HOST)


def _big_desc() -> CacheDesc:
    return CacheDesc(BIG_TENSORS, (BIG_BLOCKS, BIG_BLOCK), DataType.DT_UINT8, Placement.HOST)


@contextmanager
def sync_pair(*, transport: str | None = None, sync_kv_timeout: int = 10000
              ) -> Iterator[tuple[sync.LLMDataDist, sync.LLMDataDist]]:
    """A listening sync prompt and a sync decoder linked to it, in this process; finalized on exit."""
    port = free_port()
    prompt = sync.LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    decoder = sync.LLMDataDist(LLMRole.DECODER, new_cluster_id())
    server = LLMConfig()
    server.listen_ip_info = f"127.0.0.1:{port}"
    server.sync_kv_timeout = sync_kv_timeout
    client = LLMConfig()
    client.sync_kv_timeout = sync_kv_timeout
    if transport is not None:  # the slower plane, so that an interrupt lands in the middle of a transfer
        server.transport = transport
        server.net = client.net = "python"
        server.tcp_connections = client.tcp_connections = 1
    with prompt, decoder:
        prompt.init(server.generate_options())
        decoder.init(client.generate_options())
        code, _ = decoder.link_clusters([cluster_info(prompt.cluster_id, port)], timeout=5000)
        assert code == LLMStatusCode.LLM_SUCCESS
        yield prompt, decoder


class SyncPeer:
    """A :class:`PeerProcess` (an asyncio instance in a child process) driven from a synchronous test."""

    def __init__(self) -> None:
        self._runner = asyncio.Runner()
        self.peer = self._runner.run(self._start())

    @staticmethod
    async def _start() -> PeerProcess:
        return await PeerProcess.start()  # (an Opening: awaitable, but not a coroutine that Runner.run takes)

    def call(self, cmd: str, **args: Any) -> Any:
        return self._runner.run(self.peer.call(cmd, **args))

    def close(self) -> None:
        try:
            self._runner.run(self.peer.close())
        finally:
            self._runner.close()


@pytest.fixture
def peer() -> Iterator[SyncPeer]:
    p = SyncPeer()
    try:
        yield p
    finally:
        p.close()


def _run_threads(target: Callable[[int], None], n: int = THREADS) -> None:
    """Run ``target(i)`` in ``n`` threads released together; re-raise the first failure."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread is still blocked"
    if errors:
        raise errors[0]


def _plans(seed: int) -> list[list[tuple[list[int], list[int]]]]:
    """Per thread, per round: (pull sources in the lower half, their destinations) - a fresh permutation each."""
    rng = random.Random(seed)
    out = []
    for i in range(THREADS):
        mine = list(range(i * PER_THREAD, (i + 1) * PER_THREAD))
        rounds = []
        for _ in range(ROUNDS):
            src = mine[:]
            rng.shuffle(src)
            rounds.append((src, mine))
        out.append(rounds)
    return out


def _snapshot(cache: Any) -> list[bytes]:
    return [hashlib.sha256(t.tobytes()).digest() for t in cache.tensors]


def _assert_no_late_writes(cache: Any) -> None:
    first = _snapshot(cache)
    time.sleep(0.2)
    assert _snapshot(cache) == first, "bytes landed in the destination after the call returned"


# -- many threads at once ------------------------------------------------------------------------------------
def test_16_threads_pull_and_push_between_two_sync_instances() -> None:
    with sync_pair() as (prompt, decoder):
        key = BlocksCacheKey(prompt.cluster_id, 0)
        remote = prompt.cache_manager.allocate_blocks_cache(_desc(), key)
        local = decoder.cache_manager.allocate_blocks_cache(_desc())
        remote_data, local_data = fill_rows(remote, 101), fill_rows(local, 202)
        plans = _plans(7)
        half = BLOCKS // 2

        def work(i: int) -> None:
            cm = decoder.cache_manager  # the property, from every thread
            for src, dst in plans[i]:
                cm.pull_blocks(key, local, src, dst)  # remote lower half -> local lower half
                cm.push_blocks(key, local, [half + b for b in src], [half + b for b in dst])  # upper halves

        _run_threads(work)
        local_rows, remote_rows = row_views(local), row_views(remote)
        for t in range(TENSORS):
            for rounds in plans:
                src, dst = rounds[-1]
                assert np.array_equal(local_rows[t][dst], remote_data[t][src]), f"pull, tensor {t}"
                assert np.array_equal(remote_rows[t][[half + b for b in dst]],
                                      local_data[t][[half + b for b in src]]), f"push, tensor {t}"
        stats = decoder.stats().get(prompt.cluster_id, "pull")
        assert stats is not None and stats.succeeded == THREADS * ROUNDS


def test_16_threads_pull_and_push_against_a_peer_process(peer: SyncPeer) -> None:
    port, prompt_id = free_port(), new_cluster_id()
    peer.call("init", role="PROMPT", cluster_id=prompt_id,
              options={"llm.listenIpInfo": f"127.0.0.1:{port}", "llm.SyncKvCacheWaitTime": "10000"})
    remote = peer.call("allocate", blocks=True, num_tensors=TENSORS, shape=[BLOCKS, BLOCK],
                       blocks_key=[prompt_id, 0])["cache_id"]
    peer.call("fill", cache_id=remote, seed=5)
    key = BlocksCacheKey(prompt_id, 0)
    half = BLOCKS // 2
    plans = _plans(11)
    cfg = LLMConfig()
    cfg.sync_kv_timeout = 10000
    with sync.LLMDataDist(LLMRole.DECODER, new_cluster_id()) as decoder:
        decoder.init(cfg.generate_options())
        code, _ = decoder.link_clusters([cluster_info(prompt_id, port)], timeout=5000)
        assert code == LLMStatusCode.LLM_SUCCESS
        local = decoder.cache_manager.allocate_blocks_cache(_desc())
        local_data = fill_rows(local, 6)

        def work(i: int) -> None:
            for src, dst in plans[i]:
                decoder.cache_manager.pull_blocks(key, local, src, dst)
                decoder.cache_manager.push_blocks(key, local, [half + b for b in src], [half + b for b in dst])

        _run_threads(work)
        local_rows = row_views(local)
        for t in range(TENSORS):
            remote_before = pattern(5, t, BLOCKS * BLOCK).reshape(BLOCKS, BLOCK)
            expected_remote = remote_before.copy()
            for rounds in plans:
                src, dst = rounds[-1]
                assert np.array_equal(local_rows[t][dst], remote_before[src]), f"pull, tensor {t}"
                expected_remote[[half + b for b in dst]] = local_data[t][[half + b for b in src]]
            digests = peer.call("block_digests", cache_id=remote, tensor=t, block_bytes=BLOCK)
            assert digests == [hashlib.sha256(row.tobytes()).hexdigest() for row in expected_remote], \
                f"push, tensor {t}"


# -- timeouts and interrupts ---------------------------------------------------------------------------------
def test_a_transfer_that_times_out_leaves_both_sides_usable(peer: SyncPeer) -> None:
    port, prompt_id = free_port(), new_cluster_id()
    peer.call("init", role="PROMPT", cluster_id=prompt_id, options={"llm.listenIpInfo": f"127.0.0.1:{port}"})
    remote = peer.call("allocate", blocks=True, num_tensors=TENSORS, shape=[BLOCKS, BLOCK],
                       blocks_key=[prompt_id, 0])["cache_id"]
    peer.call("fill", cache_id=remote, seed=9)
    key = BlocksCacheKey(prompt_id, 0)
    cfg = LLMConfig()
    cfg.sync_kv_timeout = 300
    with sync.LLMDataDist(LLMRole.DECODER, new_cluster_id()) as decoder:
        decoder.init(cfg.generate_options())
        assert decoder.link_clusters([cluster_info(prompt_id, port)], timeout=5000)[0] == LLMStatusCode.LLM_SUCCESS
        local = decoder.cache_manager.allocate_blocks_cache(_desc())
        local_data = fill_rows(local, 10)
        os.kill(peer.peer.pid, signal.SIGSTOP)  # the owner does not answer at all
        try:
            start = time.monotonic()
            with pytest.raises(LLMTimeoutError) as info:
                decoder.cache_manager.pull_blocks(key, local, [1, 2], [1, 2])
            assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT
            assert time.monotonic() - start < 5.0  # its 300 ms (late on a loaded machine), not a hang
            future = decoder.cache_manager.submit.push_blocks(key, local, [3], [3])
            assert isinstance(future.exception(timeout=30), LLMTimeoutError)
        finally:
            os.kill(peer.peer.pid, signal.SIGCONT)
        # both sides still work: this side pulls and pushes, the peer answers and holds the pushed bytes
        decoder.cache_manager.pull_blocks(key, local, [5, 6], [6, 5])
        remote_rows = pattern(9, 0, BLOCKS * BLOCK).reshape(BLOCKS, BLOCK)
        assert np.array_equal(row_views(local)[0][[6, 5]], remote_rows[[5, 6]])
        decoder.cache_manager.push_blocks(key, local, [7], [8])
        digests = peer.call("block_digests", cache_id=remote, tensor=3, block_bytes=BLOCK)
        assert digests[8] == hashlib.sha256(local_data[3][7].tobytes()).hexdigest()
        assert decoder.stats().get(prompt_id, "pull").failures.get("LLM_TIMEOUT") == 1  # type: ignore[union-attr]


def _interrupt_when_landing(tensor: np.ndarray, delay: float) -> None:
    """SIGINT the main thread ``delay`` seconds after the first byte of ``tensor`` changed (within 5 s)."""
    deadline = time.monotonic() + 5
    sample = tensor.reshape(-1)[::4096]  # a byte per page: cheap to poll
    while (sample == POISON).all() and time.monotonic() < deadline:
        time.sleep(0.0002)
    time.sleep(delay)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]


def test_keyboard_interrupt_cancels_the_transfer_and_returns_after_it() -> None:
    """SIGINT in the main thread during a blocking pull: the call raises KeyboardInterrupt only once the
    transfer was cancelled (nothing lands afterwards), and the instance keeps working."""
    assert threading.current_thread() is threading.main_thread()
    with sync_pair(transport="tcp", sync_kv_timeout=30000) as (prompt, decoder):
        key = BlocksCacheKey(prompt.cluster_id, 0)
        remote = prompt.cache_manager.allocate_blocks_cache(_big_desc(), key)
        local = decoder.cache_manager.allocate_blocks_cache(_big_desc())
        remote_data = fill_rows(remote, 3)
        everything, reversed_ = list(range(BIG_BLOCKS)), list(range(BIG_BLOCKS))[::-1]
        interrupted = 0
        for attempt in range(20):  # until an interrupt landed mid-transfer (at least 5 tries; a loaded machine
            if attempt >= 5 and interrupted:  # may let every transfer win the race a few times)
                break
            delay = (0.0, 0.002, 0.005)[attempt % 3]
            for t in local.tensors:
                t[...] = POISON
            returned = False
            # Interrupt once the bytes are flowing (then ``delay`` later): a fixed timer may fire only after a
            # short transfer ended on a loaded machine.
            timer = threading.Thread(target=_interrupt_when_landing, args=(local.tensors[0], delay))
            try:
                timer.start()
                decoder.cache_manager.pull_blocks(key, local, everything, reversed_)
                returned = True
                timer.join()  # a signal sent just after the call returned lands here (however late its thread ran)
                time.sleep(0.05)  # (or just after the join)
            except KeyboardInterrupt:
                if not returned:
                    interrupted += 1
            finally:
                timer.join()
            if returned:  # the transfer won the race: then it is complete
                assert all(np.array_equal(r[reversed_], d) for r, d in zip(row_views(local), remote_data))
            _assert_no_late_writes(local)
        if not interrupted:
            # Seen only in some full-suite runs (never alone): every pull finished before its SIGINT was handled.
            pytest.skip("no interrupt landed during a transfer in 20 tries (timing); nothing was asserted")
        failures = decoder.stats().get(prompt.cluster_id, "pull").failures  # type: ignore[union-attr]
        assert failures.get("CANCELLED", 0) >= 1, failures  # the coroutine itself was cancelled
        decoder.cache_manager.pull_blocks(key, local, [1, 2], [3, 4])
        assert all(np.array_equal(r[[3, 4]], d[[1, 2]]) for r, d in zip(row_views(local), remote_data))


# -- the futures form ----------------------------------------------------------------------------------------
def test_futures_result_and_exception_collected_on_another_thread() -> None:
    with sync_pair() as (prompt, decoder):
        key = BlocksCacheKey(prompt.cluster_id, 0)
        remote = prompt.cache_manager.allocate_blocks_cache(_desc(), key)
        local = decoder.cache_manager.allocate_blocks_cache(_desc())
        remote_data = fill_rows(remote, 4)
        futures = [decoder.cache_manager.submit.pull_blocks(key, local, [i], [BLOCKS - 1 - i]) for i in range(32)]
        bad_value = decoder.cache_manager.submit.pull_blocks(key, local, [1, 2], [3, 3])  # duplicate destination
        bad_type = decoder.cache_manager.submit.push_blocks(key, "not a cache", [1], [1])  # type: ignore[arg-type]
        collected: list[Any] = []
        collector = threading.Thread(target=lambda: collected.extend(
            [f.result(timeout=30) for f in futures]
            + [bad_value.exception(timeout=30), bad_type.exception(timeout=30)]))
        collector.start()
        collector.join(60)
        assert collected[:32] == [None] * 32
        assert isinstance(collected[32], LLMException)
        assert collected[32].status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert isinstance(collected[33], TypeError)
        for i in range(32):
            assert all(np.array_equal(r[BLOCKS - 1 - i], d[i]) for r, d in zip(row_views(local), remote_data))
        assert all(isinstance(f, concurrent.futures.Future) and f.done() for f in futures)


def test_submit_chains_asyncio_calls_on_the_loop_thread() -> None:
    """``sync.submit`` runs a coroutine on the library's loop thread, where ``dd.aio`` (the wrapped asyncio
    instance) may be used: link then pull in one coroutine, no thread waiting in between; errors reach the future."""
    port = free_port()
    with sync.LLMDataDist(LLMRole.PROMPT, new_cluster_id()) as prompt, \
            sync.LLMDataDist(LLMRole.DECODER, new_cluster_id()) as decoder:
        server = LLMConfig()
        server.listen_ip_info = f"127.0.0.1:{port}"
        prompt.init(server.generate_options())
        decoder.init(LLMConfig().generate_options())
        key = BlocksCacheKey(prompt.cluster_id, 0)
        remote = prompt.cache_manager.allocate_blocks_cache(_desc(), key)
        local = decoder.cache_manager.allocate_blocks_cache(_desc())
        remote_data = fill_rows(remote, 5)
        threads: list[str] = []

        async def link_and_pull() -> int:
            threads.append(threading.current_thread().name)
            code, _ = await decoder.aio.link_clusters([cluster_info(prompt.cluster_id, port)], 5000)
            assert code == LLMStatusCode.LLM_SUCCESS
            await decoder.aio.cache_manager.pull_blocks(key, local, [3, 4], [0, 1])
            return 7

        assert sync.submit(link_and_pull).result(timeout=30) == 7
        assert threads == [sync.THREAD_NAME]
        assert all(np.array_equal(r[[0, 1]], d[[3, 4]]) for r, d in zip(row_views(local), remote_data))

        async def pull_missing() -> None:
            await decoder.aio.cache_manager.pull_blocks(BlocksCacheKey(prompt.cluster_id, 9), local, [0], [0])

        error = sync.submit(pull_missing).exception(timeout=30)
        assert isinstance(error, LLMException) and error.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_future_cancelled_before_it_started_never_runs() -> None:
    with sync_pair() as (prompt, decoder):
        key = BlocksCacheKey(prompt.cluster_id, 0)
        prompt.cache_manager.allocate_blocks_cache(_desc(), key)
        local = decoder.cache_manager.allocate_blocks_cache(_desc())
        fill_rows(local, 1)
        before = _snapshot(local)
        loop_thread = _loop_thread.RUNNER._current
        assert loop_thread is not None
        gate = threading.Event()
        loop_thread.loop.call_soon_threadsafe(gate.wait, 10)  # the loop thread is busy: nothing starts
        try:
            future = decoder.cache_manager.submit.pull_blocks(key, local, [0, 1], [0, 1])
            assert not future.running()
            assert future.cancel()
            assert future.cancelled()
            assert future.cancel_and_wait()
        finally:
            gate.set()
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(timeout=5)
        decoder.links()  # the loop went on
        _assert_no_late_writes(local)
        assert _snapshot(local) == before
        assert decoder.stats().get(prompt.cluster_id, "pull") is None  # the pull never started


def test_future_cancel_and_wait_while_running() -> None:
    with sync_pair(transport="tcp", sync_kv_timeout=30000) as (prompt, decoder):
        key = BlocksCacheKey(prompt.cluster_id, 0)
        remote = prompt.cache_manager.allocate_blocks_cache(_big_desc(), key)
        local = decoder.cache_manager.allocate_blocks_cache(_big_desc())
        remote_data = fill_rows(remote, 8)
        everything, reversed_ = list(range(BIG_BLOCKS)), list(range(BIG_BLOCKS))[::-1]
        cancelled = 0
        for attempt in range(20):  # until a cancel landed mid-transfer (at least 3 tries: a loaded machine may let
            if attempt >= 3 and cancelled:  # every transfer win the race a few times)
                break
            delay = (0.0, 0.002, 0.005)[attempt % 3]
            for t in local.tensors:
                t[...] = POISON
            future = decoder.cache_manager.submit.pull_blocks(key, local, everything, reversed_)
            deadline = time.monotonic() + 5
            while not future.running() and not future.done() and time.monotonic() < deadline:
                time.sleep(0.0005)
            time.sleep(delay)
            assert not future.cancel() or future.cancelled()  # a running call is not cancelled by cancel()
            if future.cancel_and_wait():
                cancelled += 1
                assert future.done()
                with pytest.raises(concurrent.futures.CancelledError):
                    future.result()
            else:  # it had finished: then it is complete
                assert future.result() is None
                assert all(np.array_equal(r[reversed_], d) for r, d in zip(row_views(local), remote_data))
            _assert_no_late_writes(local)
        assert cancelled >= 1
        decoder.cache_manager.pull_blocks(key, local, [9], [9])
        assert all(np.array_equal(r[9], d[9]) for r, d in zip(row_views(local), remote_data))


def test_calling_back_from_a_done_callback_raises_instead_of_deadlocking() -> None:
    with sync_pair() as (prompt, decoder):
        key = BlocksCacheKey(prompt.cluster_id, 0)
        prompt.cache_manager.allocate_blocks_cache(_desc(), key)
        local = decoder.cache_manager.allocate_blocks_cache(_desc())
        seen: list[BaseException] = []
        done = threading.Event()

        def callback(_: concurrent.futures.Future[None]) -> None:
            try:
                decoder.links()
            except BaseException as exc:  # noqa: BLE001 - checked below
                seen.append(exc)
            done.set()

        decoder.cache_manager.submit.pull_blocks(key, local, [0], [0]).add_done_callback(callback)
        assert done.wait(10)
        assert isinstance(seen[0], LLMException) and "own event loop thread" in str(seen[0])


# -- lifetime --------------------------------------------------------------------------------------------------
def test_finalize_from_another_thread_while_threads_transfer() -> None:
    port = free_port()
    prompt = sync.LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    decoder = sync.LLMDataDist(LLMRole.DECODER, new_cluster_id())
    server = LLMConfig()
    server.listen_ip_info = f"127.0.0.1:{port}"
    prompt.init(server.generate_options())
    decoder.init(LLMConfig().generate_options())
    assert decoder.link_clusters([cluster_info(prompt.cluster_id, port)])[0] == LLMStatusCode.LLM_SUCCESS
    key = BlocksCacheKey(prompt.cluster_id, 0)
    prompt.cache_manager.allocate_blocks_cache(_desc(), key)
    local = decoder.cache_manager.allocate_blocks_cache(_desc())
    cm = decoder.cache_manager
    outcomes: list[BaseException | None] = []

    def transfer(i: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the finalize makes the calls fail
            try:
                cm.pull_blocks(key, local, [i], [i])
            except LLMException as exc:
                outcomes.append(exc)
                return
        outcomes.append(None)

    workers = [threading.Thread(target=transfer, args=(i,)) for i in range(8)]
    for w in workers:
        w.start()
    time.sleep(0.1)
    finalizer = threading.Thread(target=decoder.finalize)
    finalizer.start()
    finalizer.join(30)
    assert not finalizer.is_alive()
    for w in workers:
        w.join(30)
    assert not any(w.is_alive() for w in workers)
    assert not decoder.is_initialized
    assert all(isinstance(o, LLMException) for o in outcomes), outcomes  # every worker saw the finalize
    with pytest.raises(LLMException) as info:
        decoder.links()
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    decoder.finalize()  # a no-op now
    assert sync.loop_thread() is not None  # the prompt still holds it
    other = threading.Thread(target=prompt.finalize)
    other.start()
    other.join(30)
    assert not prompt.is_initialized
    assert sync.loop_thread() is None
    assert not [t for t in threading.enumerate() if t.name == sync.THREAD_NAME]


def test_asyncio_instance_used_from_another_loop_raises_a_clear_error() -> None:
    with asyncio.Runner() as home, asyncio.Runner() as elsewhere:
        port, prompt_id = free_port(), new_cluster_id()
        prompt = AsyncLLMDataDist(LLMRole.PROMPT, prompt_id)
        decoder = AsyncLLMDataDist(LLMRole.DECODER, new_cluster_id())
        server = LLMConfig()
        server.listen_ip_info = f"127.0.0.1:{port}"
        client = LLMConfig()
        client.sync_kv_timeout = 30000  # far above "at once" below, however loaded the machine
        home.run(prompt.init(server.generate_options()))
        home.run(decoder.init(client.generate_options()))
        assert home.run(decoder.link_clusters([cluster_info(prompt_id, port)]))[0] == LLMStatusCode.LLM_SUCCESS
        key = BlocksCacheKey(prompt_id, 0)
        prompt.cache_manager.allocate_blocks_cache(_desc(), key)
        local = decoder.cache_manager.allocate_blocks_cache(_desc())
        calls = [
            lambda: decoder.cache_manager.pull_blocks(key, local, [0], [0]),
            lambda: decoder.cache_manager.push_blocks(key, local, [0], [0]),
            lambda: decoder.cache_manager.copy_blocks(local, {0: [1]}),
            lambda: decoder.link_clusters([cluster_info(prompt_id, port)]),
            lambda: decoder.unlink_clusters([cluster_info(prompt_id, port)]),
            lambda: decoder.switch_role(LLMRole.PROMPT),
            lambda: decoder.init(LLMConfig().generate_options()),
            lambda: decoder.finalize(),
        ]
        for call in calls:
            start = time.monotonic()
            with pytest.raises(LLMException) as info:
                elsewhere.run(call())
            assert time.monotonic() - start < 5.0  # at once, not after sync_kv_timeout (30 s)
            assert not isinstance(info.value, LLMTimeoutError)
            assert info.value.status_code == LLMStatusCode.LLM_FAILED
            assert "initialized on another event loop" in str(info.value)
            assert "aiodatadist.sync" in str(info.value)
        # the instance is intact on its own loop
        home.run(decoder.cache_manager.pull_blocks(key, local, [0], [0]))
        home.run(decoder.finalize())
        home.run(prompt.finalize())
        # once finalized, it may be initialized again on another loop
        elsewhere.run(decoder.init(LLMConfig().generate_options()))
        elsewhere.run(decoder.finalize())


# -- interpreter exit ----------------------------------------------------------------------------------------
_EXIT_PRELUDE = textwrap.dedent("""
    import atexit, logging, sys, threading, time
    _returned = []
    def main_returned():
        _returned.append(time.monotonic())
        print("main returned", flush=True)
    # Registered before the library's exit hooks, so run after them (atexit runs last-in first-out, after
    # threading's hooks): how long the exit took, whatever the interpreter's start and imports cost.
    atexit.register(lambda: _returned and print(f"exit took {time.monotonic() - _returned[0]:.3f} s",
                                                file=sys.stderr, flush=True))
    import numpy as np
    from aiodatadist import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMRole, LLMStatusCode, Placement, sync
    from aiodatadist.testing import cluster_info, fill_pattern, free_port
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    logging.getLogger("aiodatadist.datadist").setLevel(logging.DEBUG)  # "cluster N finalized"

    def pair(prompt_id, decoder_id):
        port = free_port()
        prompt, decoder = sync.LLMDataDist(LLMRole.PROMPT, prompt_id), sync.LLMDataDist(LLMRole.DECODER, decoder_id)
        server = LLMConfig()
        server.listen_ip_info = f"127.0.0.1:{port}"
        prompt.init(server.generate_options())
        decoder.init(LLMConfig().generate_options())
        assert decoder.link_clusters([cluster_info(prompt_id, port)])[0] == LLMStatusCode.LLM_SUCCESS
        desc = CacheDesc(2, (16, 4096), DataType.DT_UINT8, Placement.HOST)
        remote = prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(prompt_id, 0))
        local = decoder.cache_manager.allocate_blocks_cache(desc)
        data = fill_pattern(remote, 1)
        decoder.cache_manager.pull_blocks(BlocksCacheKey(prompt_id, 0), local, [1, 2], [2, 1])
        decoder.cache_manager.push_blocks(BlocksCacheKey(prompt_id, 0), local, [5], [6])
        assert np.array_equal(local.tensors[1][2], data[1].reshape(16, 4096)[1])
        return prompt, decoder
""")


def _run_exit_script(body: str, expect_finalized: list[int]) -> None:
    """Run the prelude and ``body`` (which calls ``main_returned()`` last) in a child interpreter: it exits
    cleanly, its exit hooks finalized what was left, and the exit (from ``main_returned`` on) took well under
    the hooks' own bound (``EXIT_TIMEOUT_S``, 30 s): none of them waited it out."""
    script = _EXIT_PRELUDE + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "main returned" in proc.stdout
    for cluster_id in expect_finalized:  # the exit hook finalized what was left
        assert f"cluster {cluster_id} finalized" in proc.stderr, proc.stderr
    took = re.search(r"exit took ([0-9.]+) s", proc.stderr)
    assert took is not None, proc.stderr
    assert float(took.group(1)) < 20, f"exit took {took.group(1)} s"


def test_interpreter_exit_without_finalize() -> None:
    _run_exit_script("""
        keep = [pair(1, 2), pair(3, 4)]
        extra = sync.LLMDataDist(LLMRole.MIX, 5)   # created, never initialized
        main_returned()
    """, [1, 2, 3, 4])


def test_interpreter_exit_after_the_worker_threads_exited() -> None:
    _run_exit_script("""
        made = []
        def worker(i):
            made.append(pair(10 + 2 * i, 11 + 2 * i))   # instances outlive their thread, never finalized
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for t in threads: t.start()
        for t in threads: t.join()
        assert not any(t.is_alive() for t in threads)
        del made   # dropped too: the library keeps what it must finalize
        main_returned()
    """, [10, 11, 12, 13, 14, 15])
