"""Short TCP transfers are awaited by their waiters polling the native helper's jobs (``NativeConnections.ended``:
``net_done``, an atomic load) instead of sleeping until the job's announcement: the waiter reaps the job itself, and
the announcement read later must neither reap a job twice nor take a new job at the reused address for ended.

Checked between two real processes over TCP on 127.0.0.1: hundreds of short one-sided pulls and pushes in a row,
each byte-exact, polled ones reaped by their waiters; pulls cut short at every point of their wait leave the link
whole and every later pull exact.  In one process: an announcement naming a job that still runs (a reaped job's
address given to a new one) leaves it alone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from helpers.data import fill_rows, pattern, row_views
from helpers.prompt_process import linked_decoder, prompt_process

from aiodatadist import BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMException, Placement
from aiodatadist.native import native_extension
from aiodatadist.settings.environment import env_knobs_cache_clear
from aiodatadist.testing import PeerProcess
from aiodatadist.transport.base import PULL, TransferJob
from aiodatadist.transport.tcp.native_connections import NativeConnections

pytestmark = pytest.mark.skipif(native_extension() is None, reason="needs the native helper")

TENSORS, BLOCKS, BLOCK = 8, 64, 4 << 10
PROMPT, DECODER = 51, 52
SEED = 19


def _desc() -> CacheDesc:
    return CacheDesc(TENSORS, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.HOST)


class Reaped:
    """Counts the jobs their waiters found ended (and so reaped) through ``NativeConnections.ended``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.by_waiter = 0
        original = NativeConnections.ended

        def ended(conns: NativeConnections, job: TransferJob) -> bool:
            done = original(conns, job)
            self.by_waiter += done
            return done

        monkeypatch.setattr(NativeConnections, "ended", ended)


class Linked:
    """A prompt process over TCP with a filled blocks cache (``cache_id``), and this process's decoder (``dd``) with a
    blocks cache of its own (``local``)."""

    def __init__(self, peer: PeerProcess, dd: LLMDataDist, cache_id: int, reaped: Reaped) -> None:
        self.peer, self.dd, self.cache_id, self.reaped = peer, dd, cache_id, reaped
        self.cm, self.key = dd.cache_manager, BlocksCacheKey(PROMPT, 0)
        self.local = self.cm.allocate_blocks_cache(_desc(), BlocksCacheKey(DECODER, 0))


@pytest.fixture
async def linked(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Linked]:
    # Windows of 2 x 100 ms: polled waits outlast them only if the I/O threads got no CPU for that long, however
    # busy the machine is (with the default 300 us, a loaded machine leaves most waits unpolled).
    monkeypatch.setenv("AIODATADIST_POLL_US", "100000")
    env_knobs_cache_clear()
    reaped = Reaped(monkeypatch)
    async with (prompt_process(PROMPT, "tcp", sync_kv_timeout_ms=10000) as (peer, port),
                linked_decoder(DECODER, PROMPT, port, "tcp", sync_kv_timeout_ms=10000) as dd):
        made = await peer.call("allocate", blocks=True, num_tensors=TENSORS, shape=[BLOCKS, BLOCK],
                               blocks_key=[PROMPT, 0])
        await peer.call("fill", cache_id=made["cache_id"], seed=SEED)
        pair = Linked(peer, dd, int(made["cache_id"]), reaped)
        try:
            yield pair
        finally:
            pair.cm.deallocate_blocks_cache(pair.local)
            env_knobs_cache_clear()


def _remote_rows() -> list[np.ndarray[Any, Any]]:
    """The prompt's cache as filled: ``rows[t][b]`` is block ``b`` of tensor ``t``."""
    return [pattern(SEED, t, BLOCKS * BLOCK).reshape(BLOCKS, BLOCK) for t in range(TENSORS)]


async def test_short_one_sided_pulls_in_a_row_each_land_exactly(linked: Linked) -> None:
    views, remote = row_views(linked.local), _remote_rows()
    rng = np.random.default_rng(3)
    for round_ in range(300):
        # A short pull, then at once a longer one: the short job's announcement, read during the longer job's
        # wait, names an address the longer job may have been given (the helper freed the short one).
        count = int(rng.integers(1, 9)) if round_ % 2 else BLOCKS // 2
        src = rng.choice(BLOCKS, count, replace=False).tolist()
        dst = rng.choice(BLOCKS, count, replace=False).tolist()
        for view in views:
            view[dst] = 0
        await linked.cm.pull_blocks(linked.key, linked.local, src, dst)
        for t in range(TENSORS):
            assert np.array_equal(views[t][dst], remote[t][src]), (round_, t)
    assert linked.reaped.by_waiter > 100  # the short ones, by their waiters (not through their announcements)


async def test_short_one_sided_pushes_in_a_row_each_land_exactly(linked: Linked) -> None:
    mine = fill_rows(linked.local, 23)
    rng = np.random.default_rng(4)
    expected = [rows.copy() for rows in _remote_rows()]
    for _ in range(200):
        count = int(rng.integers(1, 9))
        src = rng.choice(BLOCKS, count, replace=False).tolist()
        dst = rng.choice(BLOCKS, count, replace=False).tolist()
        await linked.cm.push_blocks(linked.key, linked.local, src, dst)
        for t in range(TENSORS):
            expected[t][dst] = mine[t][src]
    for t in range(TENSORS):
        got = bytes.fromhex(await linked.peer.call("read", cache_id=linked.cache_id, tensor=t, offset=0,
                                                   nbytes=BLOCKS * BLOCK))
        assert got == expected[t].tobytes(), t
    assert linked.reaped.by_waiter > 100


async def test_pulls_cut_short_while_polled_leave_the_link_whole(linked: Linked) -> None:
    cm, key, local = linked.cm, linked.key, linked.local
    views, remote = row_views(local), _remote_rows()
    blocks = list(range(16))
    await cm.pull_blocks(key, local, blocks, blocks)  # published: the pulls below go one-sided
    for round_ in range(60):
        pull = asyncio.create_task(cm.pull_blocks(key, local, blocks, blocks))
        for _ in range(round_ % 6):
            await asyncio.sleep(0)
        pull.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pull
    for view in views:
        view[:] = 0
    await cm.pull_blocks(key, local, blocks, blocks)
    for t in range(TENSORS):
        assert np.array_equal(views[t][blocks], remote[t][blocks]), t
    assert linked.dd.links()[0]["plane"] == "tcp"  # the same link throughout


async def test_an_announcement_naming_a_running_job_leaves_it_alone() -> None:
    """What a reaped job's late announcement does when the helper has given its address to a job that still runs:
    nothing (the job ends when it ends, and is reaped once)."""
    conns = NativeConnections("polled-waits", asyncio.get_running_loop(), lambda error: None, None)
    try:
        job = conns.receive(PULL, 77)  # no connection and no destination: it runs until stopped
        assert job.handle is not None
        conns._on_finished(job.handle)  # as if a reaped job at this address had just been announced
        assert not job.future.done() and not job.done and conns.running == 1
        assert not conns.ended(job)
        conns.cancel(job)
        await conns.wait_stopped(job)
        assert job.done and job.handle is None and conns.running == 0
    finally:
        await conns.aclose(LLMException("closed by the test"))
