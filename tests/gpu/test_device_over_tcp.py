"""DEVICE caches over TCP links: staged through page-locked rings by the native I/O threads (``native/src/stage.c``).

Every conversation of the host-memory TCP plane with a device cache on either side (or both), byte-exact on random
data: pulls and pushes of blocks and caches, by ``BlocksCacheKey``, ``CacheKey`` and id/index, layer ranges; chunks
cut anywhere (spans of 1 byte to 16 MiB, requests smaller than one chunk and many rings long); cancellation, a
stalled and a killed owner, a device fault; the policy that refuses staging.  Once per device runtime (CUDA and
ACL), each on its real device or its emulated runtime (see conftest.py)."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
from helpers.data import fill_pattern, tensor_bytes
from helpers.device_runtimes import FAULT, delay_env, fake_library, fake_symbol, read_device, runtime_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiodatadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    StagingStats,
    TransferWithCacheKeyConfig,
)
from aiodatadist.testing import PeerProcess, cluster_info, free_port, linked_pair

pytestmark = pytest.mark.usefixtures("device_runtime")
S = LLMStatusCode
BLOCKS, BLOCK = 64, 4096 + 16  # not a multiple of 256: unaligned spans too
PLACES = [("DEVICE", "DEVICE"), ("HOST", "DEVICE"), ("DEVICE", "HOST")]
TCP = {"llm.Transport": "tcp"}


def desc(placement: str, blocks: int = BLOCKS, block: int = BLOCK, tensors: int = 4) -> CacheDesc:
    return CacheDesc(tensors, (blocks, block), DataType.DT_UINT8, Placement[placement])


def rows(cache: Cache, blocks: int = BLOCKS) -> list[np.ndarray]:
    """A cache's tensors as they are now (read back from the device), one row per block."""
    return [t.reshape(blocks, -1) for t in tensor_bytes(cache)]


def filled(cache: Cache, seed: int, blocks: int = BLOCKS) -> list[np.ndarray]:
    """Fill ``cache`` with random bytes; its tensors, one row per block."""
    return [t.reshape(blocks, -1) for t in fill_pattern(cache, seed)]


def tcp_config() -> LLMConfig:
    cfg = LLMConfig()
    cfg.transport = "tcp"
    return cfg


@asynccontextmanager
async def peer_prompt(placement: str, env: dict[str, str] | None = None,
                      decoder_options: dict[str, str] | None = None
                      ) -> AsyncIterator[tuple[PeerProcess, LLMDataDist, int]]:
    """A prompt in another process over a TCP link, with a filled blocks cache (``placement``) under
    ``BlocksCacheKey(1, 0)``, and a decoder here linked to it."""
    port = free_port()
    cfg = tcp_config()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    peer = await PeerProcess.start(env=env)
    try:
        await peer.call("init", role="PROMPT", cluster_id=1, options=dict(cfg.generate_options()))
        cid = (await peer.call("allocate", num_tensors=4, shape=[BLOCKS, BLOCK], blocks=True, placement=placement,
                               blocks_key=[1, 0]))["cache_id"]
        await peer.call("fill", cache_id=cid, seed=11)
        async with LLMDataDist(LLMRole.DECODER, 2) as decoder:
            await decoder.init({**TCP, **(decoder_options or {})})
            code, _ = await decoder.link_clusters([cluster_info(1, port)], timeout=10_000)
            assert code == S.LLM_SUCCESS
            yield peer, decoder, cid
        if peer.returncode is None:  # (a test may have killed it)
            await peer.call("finalize")
    finally:
        await peer.close()


def begins(decoder: LLMDataDist) -> int:
    """BEGIN requests ``decoder`` sent cluster 1 so far (each is a control round trip)."""
    return next((m.sent.get("begin", 0) for m in decoder.stats().messages if m.remote_cluster_id == 1), 0)


async def peer_rows(peer: PeerProcess, cid: int, blocks: int = BLOCKS, block: int = BLOCK,
                    tensors: int = 4) -> list[np.ndarray]:
    return [np.frombuffer(bytes.fromhex(await peer.call("read", cache_id=cid, tensor=t, offset=0,
                                                         nbytes=blocks * block)), dtype=np.uint8).reshape(blocks, block)
            for t in range(tensors)]


@pytest.mark.parametrize(("owner", "mine"), PLACES)
async def test_blocks_move_between_processes_staged(owner: str, mine: str) -> None:
    rng = np.random.default_rng(12)
    async with peer_prompt(owner) as (peer, decoder, cid):
        assert decoder.links()[0]["plane"] == "tcp" and decoder.links()[0]["device_path"] == "device-staged"
        cm = decoder.cache_manager
        dst = cm.allocate_blocks_cache(desc(mine))
        ours = filled(dst, 13)
        theirs = await peer_rows(peer, cid)
        src_b = [int(b) for b in rng.permutation(BLOCKS)[:20]]
        dst_b = [int(b) for b in rng.permutation(BLOCKS)[:20]]
        for _ in range(2):  # the second time on rings that already exist
            await cm.pull_blocks(BlocksCacheKey(1, 0), dst, src_b, dst_b)
        got = rows(dst)
        for t in range(4):
            expect = ours[t].copy()
            expect[dst_b] = theirs[t][src_b]
            assert np.array_equal(got[t], expect)
        # A push of a layer range: tensors 2 and 3 (layer 1 of 2 per layer), blocks dst_b[:3] -> 0, 1, 2.
        await cm.push_blocks(BlocksCacheKey(1, 0), dst, dst_b[:3], [0, 1, 2], src_layer_range=range(1, 2),
                             dst_layer_range=range(1, 2), tensor_num_per_layer=2)
        after = await peer_rows(peer, cid)
        for t in range(4):
            expect = theirs[t].copy()
            if t >= 2:
                expect[[0, 1, 2]] = got[t][dst_b[:3]]
            assert np.array_equal(after[t], expect)
        staged = decoder.links()[0]["staging"]
        pulls = decoder.stats().get(1, "pull")
        assert pulls is not None and pulls.plane == ("tcp/device-staged" if mine == "DEVICE" else "tcp")
        if mine == "DEVICE":
            assert staged is not None and staged["receive"]["bytes"] > 0 and staged["send"]["bytes"] > 0
            assert staged["receive"]["device_failures"] == 0
        else:
            assert staged is None  # a host cache here: only the owner stages


async def test_caches_by_id_and_by_key_move_staged() -> None:
    async with peer_prompt("DEVICE") as (peer, decoder, _):
        cm = decoder.cache_manager
        cid = (await peer.call("allocate", num_tensors=4, shape=[8, 5000], placement="DEVICE",
                               keys=[[1, 77, 0]]))["cache_id"]
        await peer.call("fill", cache_id=cid, seed=14)
        theirs = await peer_rows(peer, cid, 8, 5000)
        dst = cm.allocate_cache(desc("DEVICE", 8, 5000))
        ours = filled(dst, 15, 8)
        await cm.pull_cache(CacheKeyByIdAndIndex(1, cid, 5), dst, 2)  # their batch 5 -> our 2
        await cm.pull_cache(CacheKeyByIdAndIndex(1, cid, 1), dst, 3, src_layer_range=range(1),
                            dst_layer_range=range(1))  # layer 0: tensors 0 and 1
        await cm.pull_cache(CacheKey(1, 77, 0), dst, 6)  # by key: the owner lets the key go
        got = rows(dst, 8)
        for t in range(4):
            expect = ours[t].copy()
            expect[2] = theirs[t][5]
            if t < 2:
                expect[3] = theirs[t][1]
            expect[6] = theirs[t][0]
            assert np.array_equal(got[t], expect)
        with pytest.raises(LLMException) as info:
            await cm.pull_cache(CacheKey(1, 77, 0), dst, 6)
        assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
        await cm.push_cache(CacheKeyByIdAndIndex(1, cid, 7), dst, 3)  # our batch 3 -> their 7
        after = await peer_rows(peer, cid, 8, 5000)
        assert all(np.array_equal(after[t][7], got[t][3]) for t in range(4))
        assert all(np.array_equal(after[t][:7], theirs[t][:7]) for t in range(4))


@pytest.mark.parametrize(("blocks", "block", "picked"), [
    (40000, 1, 30000),  # 1-byte spans: more descriptors than one launch takes
    (6, (16 << 20) + 3, 3),  # 16 MiB spans: each cut across chunks, unaligned
    (64, 1000, 1),  # smaller than one chunk
    (512, 65536, 400),  # many rings long (25 MiB a tensor), 64 KiB spans
])
async def test_chunks_are_cut_anywhere(blocks: int, block: int, picked: int) -> None:
    rng = np.random.default_rng(blocks)
    async with linked_pair(config=tcp_config()) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2), BlocksCacheKey(1, 0))
        dst = decoder.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2))
        theirs, ours = filled(src, 3, blocks), filled(dst, 4, blocks)
        src_b = [int(b) for b in rng.permutation(blocks)[:picked]]
        dst_b = [int(b) for b in rng.permutation(blocks)[:picked]]
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, src_b, dst_b)
        got = rows(dst, blocks)
        for t in range(2):
            expect = ours[t].copy()
            expect[dst_b] = theirs[t][src_b]
            assert np.array_equal(got[t], expect)
        await decoder.cache_manager.push_blocks(BlocksCacheKey(1, 0), dst, dst_b, src_b[::-1])
        after = rows(src, blocks)
        for t in range(2):
            assert np.array_equal(after[t][src_b[::-1]], got[t][dst_b])


async def test_concurrent_staged_transfers_interleave_on_the_connections_byte_exact() -> None:
    """Several pulls and pushes at once, device and host destinations mixed: their frames interleave on the data
    connections, so a receiver's scatter of one job's frame overlaps the next frame of another job, or a host
    frame; every call lands its own bytes and nothing else."""
    blocks, block = 96, 65536 + 8
    async with linked_pair(config=tcp_config()) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2), BlocksCacheKey(1, 0))
        dev = decoder.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2))
        host = decoder.cache_manager.allocate_blocks_cache(desc("HOST", blocks, block, 2))
        theirs, ours_dev, ours_host = filled(src, 61, blocks), filled(dev, 62, blocks), filled(host, 63, blocks)
        cm = decoder.cache_manager
        parts = [list(range(i, blocks, 4)) for i in range(4)]  # four disjoint sets of destination blocks
        # The push reads host blocks no pull writes, into owner blocks no pull reads.
        pushed_from, pushed_to = parts[0][:16], parts[3][8:]
        await asyncio.gather(
            cm.pull_blocks(BlocksCacheKey(1, 0), dev, parts[0][::-1], parts[0]),
            cm.pull_blocks(BlocksCacheKey(1, 0), dev, parts[1], parts[1]),
            cm.pull_blocks(BlocksCacheKey(1, 0), host, parts[2], parts[2]),
            cm.pull_blocks(BlocksCacheKey(1, 0), dev, parts[3][:8], parts[3][:8]),
            cm.push_blocks(BlocksCacheKey(1, 0), host, pushed_from, pushed_to))
        got_dev, got_host, after = rows(dev, blocks), rows(host, blocks), rows(src, blocks)
        for t in range(2):
            want_dev = ours_dev[t].copy()
            want_dev[parts[0]] = theirs[t][parts[0][::-1]]
            want_dev[parts[1]] = theirs[t][parts[1]]
            want_dev[parts[3][:8]] = theirs[t][parts[3][:8]]
            assert np.array_equal(got_dev[t], want_dev)
            want_host = ours_host[t].copy()
            want_host[parts[2]] = theirs[t][parts[2]]
            assert np.array_equal(got_host[t], want_host)
            assert np.array_equal(after[t][pushed_to], ours_host[t][pushed_from])


def unsynced_rows(dd: LLMDataDist, cache: Cache, blocks: int) -> list[np.ndarray]:
    """:func:`rows` read without synchronising the device first (a synchronous copy does not wait for the copy
    streams): what the memory holds now, even while copies are held."""
    runtime = runtime_of(dd)
    return [read_device(runtime, addr, cache.cache_desc.size).reshape(blocks, -1) for addr in cache.tensor_addrs]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block=st.integers(1, 300_000), data=st.data(), delay_us=st.sampled_from([0, 50, 400]))
def test_no_slot_is_reused_while_its_copy_runs(device_runtime: str, runtime_mode: str, monkeypatch: pytest.MonkeyPatch, block: int,
                                               data: st.DataObject, delay_us: int) -> None:
    """Property: whatever the span sizes and however late the device runs each copy, every byte lands where it
    belongs (a slot overwritten while its gather or scatter still ran would corrupt a chunk)."""
    if runtime_mode != "emulated":
        pytest.skip("delays are the emulated runtime's")
    monkeypatch.setenv(delay_env(device_runtime), str(delay_us))
    blocks = max(2, min(200, (24 << 20) // block))
    picked = data.draw(st.lists(st.integers(0, blocks - 1), min_size=1, max_size=blocks, unique=True))
    targets = data.draw(st.permutations(range(blocks)))[:len(picked)]

    async def run() -> None:
        async with linked_pair(config=tcp_config()) as (prompt, decoder):
            src = prompt.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2), BlocksCacheKey(1, 0))
            dst = decoder.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2))
            theirs, ours = filled(src, block, blocks), filled(dst, 1, blocks)
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, picked, list(targets))
            got = rows(dst, blocks)
            for t in range(2):
                expect = ours[t].copy()
                expect[list(targets)] = theirs[t][picked]
                assert np.array_equal(got[t], expect)

    asyncio.run(run())


async def test_a_cancelled_staged_pull_writes_nothing_after_it_returns(runtime_mode: str) -> None:
    """Held copies (the emulated GPU's gate, or a large pull on a real one): a pull cut short by its timeout at
    several points returns, and from then on its destination does not change, however long the held copies take;
    the link then pulls byte-exact."""
    blocks, block = 64, 1 << 20
    async with linked_pair(config=tcp_config()) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2), BlocksCacheKey(1, 0))
        dst = decoder.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2))
        theirs = filled(src, 5, blocks)
        hold = fake_symbol(prompt, "fake_hold") if runtime_mode == "emulated" else None
        everything = list(range(blocks))
        for deadline in (0.0005, 0.005, 0.05):
            fill_pattern(dst, 6)
            release = None
            if hold is not None:
                hold.value = 1

                async def let_go(after: float) -> None:  # the copies run only once the pull gave up
                    await asyncio.sleep(after)
                    hold.value = 0

                release = asyncio.ensure_future(let_go(deadline + 0.2))
            try:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(deadline):
                        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, everything, everything)
                snapshot = unsynced_rows(decoder, dst, blocks)  # returned: no copy of this pull may still write
            finally:
                if release is not None:
                    await release
            await asyncio.sleep(0.1)  # whatever was held runs now: none of it may be this pull's
            assert all(np.array_equal(a, b) for a, b in zip(unsynced_rows(decoder, dst, blocks), snapshot))
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, everything, everything[::-1])
        got = rows(dst, blocks)
        assert all(np.array_equal(got[t][::-1], theirs[t]) for t in range(2))


@pytest.mark.parametrize("resolved", [False, True], ids=["through-the-owner", "one-sided"])
async def test_a_device_fault_fails_the_call_and_the_link_stays_usable(device_runtime: str, runtime_mode: str,
                                                                       resolved: bool) -> None:
    """A sticky fault on the owner's device while it gathers (the pull through its control plane, or one-sided
    from its I/O threads once the key is resolved): LLM_DEVICE_MEM_ERROR, host caches still move, and once the
    fault is gone the same pull lands byte-exact on the same link."""
    if runtime_mode != "emulated":
        pytest.skip("a fault on a real device cannot be made on purpose (on a GPU it ends the process's context)")
    async with linked_pair(config=tcp_config()) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(desc("DEVICE"), BlocksCacheKey(1, 0))
        host = prompt.cache_manager.allocate_blocks_cache(desc("HOST"), BlocksCacheKey(1, 1))
        dst = decoder.cache_manager.allocate_blocks_cache(desc("DEVICE"))
        host_dst = decoder.cache_manager.allocate_blocks_cache(desc("HOST"))
        theirs = filled(src, 7)
        host_rows = filled(host, 8)
        if resolved:
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
        before = begins(decoder)
        lib = fake_library(runtime_of(prompt))
        lib.fake_fault(FAULT[device_runtime])
        try:
            with pytest.raises(LLMException) as info:
                async with asyncio.timeout(10):
                    await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1, 2], [3, 4])
            assert info.value.status_code == S.LLM_DEVICE_MEM_ERROR
            assert "device" in str(info.value)
            assert (begins(decoder) == before) is resolved  # one-sided: the owner's I/O threads failed it
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 1), host_dst, [5], [6])  # host memory moves
            assert all(np.array_equal(rows(host_dst)[t][6], host_rows[t][5]) for t in range(4))
        finally:
            lib.fake_reset()
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1, 2], [3, 4])
        assert all(np.array_equal(rows(dst)[t][[3, 4]], theirs[t][[1, 2]]) for t in range(4))
        assert len(decoder.links()) == 1


async def test_a_stalled_owner_gives_a_timeout_and_the_link_recovers() -> None:
    async with peer_prompt("DEVICE") as (peer, decoder, cid):
        cm = decoder.cache_manager
        dst = cm.allocate_blocks_cache(desc("DEVICE"))
        await cm.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])  # the rings exist
        await peer.stop()
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises((TimeoutError, LLMException)):
                async with asyncio.timeout(0.5):
                    await cm.pull_blocks(BlocksCacheKey(1, 0), dst, list(range(BLOCKS)), list(range(BLOCKS)))
            assert loop.time() - started < 5  # within the deadline (plus a loaded machine's slack)
        finally:
            peer.cont()
        await cm.pull_blocks(BlocksCacheKey(1, 0), dst, [3, 4], [5, 6])
        theirs = await peer_rows(peer, cid)
        assert all(np.array_equal(rows(dst)[t][[5, 6]], theirs[t][[3, 4]]) for t in range(4))


async def test_a_killed_owner_fails_the_pull_within_its_deadline(device_runtime: str) -> None:
    # every copy on the owner starts 3 s late: the pull is still running when the owner dies
    async with peer_prompt("DEVICE", env={delay_env(device_runtime): "3000000"},
                           decoder_options={"llm.SyncKvCacheWaitTime": "20000"}) as (peer, decoder, _):
        cm = decoder.cache_manager
        dst = cm.allocate_blocks_cache(desc("DEVICE"))
        pull = asyncio.ensure_future(cm.pull_blocks(BlocksCacheKey(1, 0), dst, list(range(BLOCKS)),
                                                    list(range(BLOCKS))))
        await asyncio.sleep(0.05)
        await peer.kill()
        loop = asyncio.get_running_loop()
        killed = loop.time()
        with pytest.raises(LLMException) as info:
            await pull
        assert loop.time() - killed < 10  # the link's end, not the 20 s deadline
        assert info.value.status_code != S.LLM_SUCCESS


async def test_staging_refused_by_the_requester_or_the_owner() -> None:
    cfg = tcp_config()
    async with linked_pair(config=cfg) as (prompt, decoder):
        prompt.cache_manager.allocate_blocks_cache(desc("DEVICE"), BlocksCacheKey(1, 0))
        host_src = prompt.cache_manager.allocate_blocks_cache(desc("HOST"), BlocksCacheKey(1, 1))
        fill_pattern(host_src, 9)
        async with LLMDataDist(LLMRole.DECODER, 3) as strict:
            await strict.init({**TCP, "llm.DeviceStaging": "0"})
            address = prompt.listen_address
            assert address is not None
            code, _ = await strict.link_clusters([cluster_info(1, address[1])], timeout=5000)
            assert code == S.LLM_SUCCESS
            assert strict.links()[0]["device_path"] == "refused"
            dev = strict.cache_manager.allocate_blocks_cache(desc("DEVICE"))
            host = strict.cache_manager.allocate_blocks_cache(desc("HOST"))
            with pytest.raises(LLMException) as info:
                await strict.cache_manager.pull_blocks(BlocksCacheKey(1, 1), dev, [0], [0])
            assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED and "llm.DeviceStaging" in str(info.value)
            await strict.cache_manager.pull_blocks(BlocksCacheKey(1, 1), host, [2], [3])  # host memory still moves
            assert all(np.array_equal(rows(host)[t][3], rows(host_src)[t][2]) for t in range(4))
    # The owner refuses: its option, its cache.
    port = free_port()
    owner_cfg = tcp_config()
    owner_cfg.listen_ip_info = f"127.0.0.1:{port}"
    async with LLMDataDist(LLMRole.PROMPT, 1) as owner, LLMDataDist(LLMRole.DECODER, 2) as decoder:
        await owner.init({**dict(owner_cfg.generate_options()), "llm.DeviceStaging": "0"})
        await decoder.init(TCP)
        owner.cache_manager.allocate_blocks_cache(desc("DEVICE"), BlocksCacheKey(1, 0))
        code, _ = await decoder.link_clusters([cluster_info(1, port)], timeout=5000)
        assert code == S.LLM_SUCCESS
        dst = decoder.cache_manager.allocate_blocks_cache(desc("HOST"))
        with pytest.raises(LLMException) as info:
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
        assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED


async def test_a_spent_budget_makes_links_share_a_ring_and_wait_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget of five slots, this process holding both ends: the owner's first send ring takes four (two per
    connection), the first receive ring the last one; every later ring shares its instance's ring of that direction
    (one slot, the allowance beyond the budget); concurrent transfers on all of them wait for slots and land
    byte-exact."""
    from aiodatadist.copy import staging

    small = staging.StagingBudget(5 * staging.CHUNK_BYTES)
    monkeypatch.setattr(staging, "_budget", small)
    blocks, block = 32, 256 << 10  # 8 MiB a tensor: several chunks per transfer
    async with linked_pair(config=tcp_config()) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2), BlocksCacheKey(1, 0))
        theirs = filled(src, 21, blocks)
        address = prompt.listen_address
        assert address is not None
        others = [LLMDataDist(LLMRole.DECODER, 10 + i) for i in range(2)]
        try:
            for dd in others:
                await dd.init(TCP)
                assert (await dd.link_clusters([cluster_info(1, address[1])], timeout=5000))[0] == S.LLM_SUCCESS
            everyone = [decoder, *others]
            dsts = [dd.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2)) for dd in everyone]
            order = list(range(blocks))[::-1]
            pulls = [functools.partial(dd.cache_manager.pull_blocks, BlocksCacheKey(1, 0), dst, list(range(blocks)),
                                       order) for dd, dst in zip(everyone, dsts)]
            await pulls[0]()  # the first link's rings: the owner's send ring, then this receive ring
            await asyncio.gather(*(pull() for pull in pulls * 2))  # on the rings they have, or shared ones
            for dst in dsts:
                got = rows(dst, blocks)
                assert all(np.array_equal(got[t][order], theirs[t]) for t in range(2))
            receive = [dd.links()[0]["staging"]["receive"] for dd in everyone]
            send = sorted((link["remote_cluster_id"], link["staging"]["send"]) for link in prompt.links())
            assert [(r["shared"], r["slots"]) for r in receive] == [(False, 1), (True, 1), (True, 1)]
            assert [(r["shared"], r["slots"]) for _, r in send] == [(False, 4), (True, 1), (True, 1)]
            spent = StagingStats(small.total, small.total + 3 * staging.CHUNK_BYTES, rings=2, shared_rings=3,
                                 shared_ring_users=4)
            assert all(dd.stats().staging == spent for dd in (*everyone, prompt))  # the process's, in every stats
        finally:
            for dd in others:
                await dd.finalize()


class _OpenGate(LayerSynchronizer):
    """Every layer ready at once (the layer-wise push goes out layer by layer all the same)."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


async def test_layer_wise_pushes_of_device_caches_are_staged() -> None:
    layers = 4
    async with linked_pair(config=tcp_config()) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(desc("DEVICE", 8, 5000, 2 * layers))
        dst = decoder.cache_manager.allocate_blocks_cache(desc("DEVICE", 8, 5000, 2 * layers), BlocksCacheKey(2, 0))
        mine, theirs = filled(src, 31, 8), filled(dst, 32, 8)
        configs = [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(1, 4), range(3))]
        task = prompt.cache_manager.transfer_cache_async(src, _OpenGate(), configs, [1, 5, 6], [0, 3, 7])
        assert await task == S.LLM_SUCCESS
        got = rows(dst, 8)
        for t in range(2 * layers):
            expect = theirs[t].copy()
            if t < 6:  # destination layers 0-2 (tensors 0-5) from source layers 1-3 (tensors 2-7)
                expect[[0, 3, 7]] = mine[t + 2][[1, 5, 6]]
            assert np.array_equal(got[t], expect)


@pytest.mark.parametrize("resolved", [False, True], ids=["through-the-owner", "one-sided"])
async def test_an_owner_releasing_its_cache_mid_pull_fails_it_cleanly(runtime_mode: str, resolved: bool) -> None:
    """The owner deallocates the device cache a pull is reading (its copies held on the emulated GPU; the pull
    through the owner's control plane, or one-sided once the key is resolved): the pull fails or completes,
    never hangs or crashes, nothing lands after it returned, and the link moves the next cache byte-exact."""
    if runtime_mode != "emulated":
        pytest.skip("needs the emulated runtime's gate to hold the owner's copies")
    blocks, block = 16, 1 << 20
    async with linked_pair(config=tcp_config()) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2), BlocksCacheKey(1, 0))
        dst = decoder.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2))
        filled(src, 41, blocks)
        if resolved:
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
        hold = fake_symbol(prompt, "fake_hold")
        hold.value = 1
        everything = list(range(blocks))
        pull = asyncio.ensure_future(decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, everything,
                                                                       everything))
        await asyncio.sleep(0.05)  # the owner's gathers are held: the pull is under way
        let_go = threading.Timer(0.3, lambda: setattr(hold, "value", 0))  # (the release may wait for them)
        let_go.start()
        try:
            prompt.cache_manager.deallocate_blocks_cache(src)
        finally:
            let_go.join()
        outcome = await asyncio.gather(pull, return_exceptions=True)
        assert outcome[0] is None or isinstance(outcome[0], LLMException), outcome
        snapshot = unsynced_rows(decoder, dst, blocks)
        await asyncio.sleep(0.1)
        assert all(np.array_equal(a, b) for a, b in zip(unsynced_rows(decoder, dst, blocks), snapshot))
        again = prompt.cache_manager.allocate_blocks_cache(desc("DEVICE", blocks, block, 2), BlocksCacheKey(1, 1))
        theirs = filled(again, 42, blocks)
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 1), dst, [3, 4], [5, 6])
        got = rows(dst, blocks)
        assert all(np.array_equal(got[t][[5, 6]], theirs[t][[3, 4]]) for t in range(2))


@pytest.mark.parametrize(("owner", "mine"), PLACES)
async def test_device_caches_move_one_sided_once_resolved(owner: str, mine: str) -> None:
    """Once the owner resolved its cache, repeated pulls and pushes go with no control round trip, whichever side
    holds device memory: the owner's I/O threads serve its side (through its own rings for a device cache, set up
    by the first transfer of each direction), this side stages its own.  No BEGIN goes out for the repeated
    calls, the owner counts them as one-sided, and every byte lands."""
    async with linked_pair(config=tcp_config()) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(desc(owner, 64, 65536, 2), BlocksCacheKey(1, 0))
        dst = decoder.cache_manager.allocate_blocks_cache(desc(mine, 64, 65536, 2))
        theirs = filled(src, 51, 64)
        cm = decoder.cache_manager

        def one_sided() -> tuple[int, int]:  # (reads, writes) the owner's I/O threads accepted
            assert prompt._transfers is not None
            _, counts = prompt._transfers.one_sided_served()[2]
            return counts[0], counts[3]

        assert decoder.stats().staging is None and prompt.stats().staging is None  # nothing staged yet
        # The first pull and push resolve the key; the owner's rings of both directions exist after them.
        await cm.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
        await cm.push_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
        for dd, placement in ((decoder, mine), (prompt, owner)):  # the budget, in the stats of those that staged
            budget = dd.stats().staging
            assert (budget is not None) is (placement == "DEVICE")
            assert budget is None or (budget.used_bytes > 0 and budget.budget_bytes > 0)
        before, (reads, writes) = begins(decoder), one_sided()
        await cm.pull_blocks(BlocksCacheKey(1, 0), dst, list(range(0, 64, 2)), list(range(32)))
        got = rows(dst, 64)
        assert all(np.array_equal(got[t][:32], theirs[t][0:64:2]) for t in range(2))
        await cm.push_blocks(BlocksCacheKey(1, 0), dst, [0, 1, 2], [61, 62, 63])
        after = rows(src, 64)
        assert all(np.array_equal(after[t][61:], got[t][:3]) for t in range(2))
        assert all(np.array_equal(after[t][1:61], theirs[t][1:61]) for t in range(2))  # nothing else written
        assert begins(decoder) == before  # neither went through the owner
        assert one_sided() == (reads + 1, writes + 1)
