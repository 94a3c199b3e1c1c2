"""Resources: 512 simultaneous links, and no descriptor, thread, socket or shared-memory object left behind after
finalize, after many link/unlink cycles, or after a peer crash."""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers.data import fill_pattern

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.link.manager import MAX_LINKS
from aiodatadist.testing import PeerProcess, cluster_info, free_port

S = LLMStatusCode
DESC = CacheDesc(2, (8, 4096), DataType.DT_UINT8, Placement.HOST)


def counts() -> tuple[int, int, int]:
    """(open descriptors, threads, memfd descriptors) of this process.  Idle threads of the event loop's default
    executor (``asyncio.to_thread``) are not ours to end: the loop keeps up to a few until it closes."""
    gc.collect()
    loop_pool = sum(1 for t in threading.enumerate() if t.name.startswith("asyncio_"))
    fds = os.listdir("/proc/self/fd")
    memfds = 0
    for fd in fds:
        try:
            memfds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    return len(fds), len(os.listdir("/proc/self/task")) - loop_pool, memfds


async def settled(baseline: tuple[int, int, int], slack: int = 0, timeout: float = 30.0) -> tuple[int, int, int]:
    """Counts once none is above ``baseline`` (descriptors: plus ``slack``); threads and sockets may take a moment
    to end."""
    deadline = asyncio.get_running_loop().time() + timeout
    now = counts()
    while not _within(now, baseline, slack) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
        now = counts()
    return now


def _within(now: tuple[int, int, int], baseline: tuple[int, int, int], slack: int) -> bool:
    return now[0] <= baseline[0] + slack and now[1] <= baseline[1] and now[2] <= baseline[2]


def server_options(port: int, transport: str = "auto") -> dict[str, str]:
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    cfg.transport = transport
    return dict(cfg.generate_options())


async def test_512_simultaneous_links_and_nothing_left_after_finalize() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 24 * (MAX_LINKS + 1) + 256
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"needs {need} file descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    try:
        baseline = counts()
        port = free_port()
        server = LLMDataDist(LLMRole.PROMPT, 1)
        await server.init(server_options(port))
        clients = [LLMDataDist(LLMRole.DECODER, 1000 + i) for i in range(MAX_LINKS)]
        for client in clients:
            await client.init({})
        results = await asyncio.gather(*(c.link_clusters([cluster_info(1, port)], timeout=30000) for c in clients))
        assert all(code == S.LLM_SUCCESS for code, _ in results)
        assert len(server.links()) == MAX_LINKS
        # the server can still transfer on every link: pull from a few clients
        src = server.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        fill_pattern(src, 3)
        for client in clients[::64]:
            dst = client.cache_manager.allocate_blocks_cache(DESC)
            await client.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [2])
            assert np.array_equal(dst.tensors[1].reshape(8, -1)[2], src.tensors[1].reshape(8, -1)[1])
        # one link more than the limit is refused by the server
        extra = LLMDataDist(LLMRole.DECODER, 999)
        await extra.init({})
        _, codes = await extra.link_clusters([cluster_info(1, port)], timeout=5000)
        assert codes == [S.LLM_CLUSTER_NUM_EXCEED_LIMIT]
        await extra.finalize()
        await asyncio.gather(*(c.finalize() for c in clients))
        await server.finalize()
        assert _within(await settled(baseline), baseline, 0), baseline
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("transport, cycles", [("shm", 1000), ("tcp", 200)])
async def test_link_unlink_cycles_leave_nothing(transport: str, cycles: int) -> None:
    baseline = counts()
    port = free_port()
    async with LLMDataDist(LLMRole.PROMPT, 1) as server, LLMDataDist(LLMRole.DECODER, 2) as client:
        await server.init(server_options(port, transport))
        await client.init({})
        src = server.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        fill_pattern(src, 4)
        dst = client.cache_manager.allocate_blocks_cache(DESC)
        # One cycle first: ZeroMQ starts its context's I/O and reaper threads with the first socket.
        assert (await client.link_clusters([cluster_info(1, port)], timeout=5000))[0] == S.LLM_SUCCESS
        assert (await client.unlink_clusters([cluster_info(1, port)], timeout=5000))[0] == S.LLM_SUCCESS
        linked = counts()
        for i in range(cycles):
            code, _ = await client.link_clusters([cluster_info(1, port)], timeout=5000)
            assert code == S.LLM_SUCCESS, f"cycle {i}"
            if i % 50 == 0:  # move bytes now and then, so that data connections and mappings are really used
                await client.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [i % 8], [(i + 1) % 8])
            code, _ = await client.unlink_clusters([cluster_info(1, port)], timeout=5000)
            assert code == S.LLM_SUCCESS, f"cycle {i}"
        fds, threads, memfds = await settled(linked, slack=4)
        # A leak per cycle would show as hundreds of descriptors; a few may come and go (a pipe replaced, a peer
        # mapping whose buffer was still exported when the link closed is freed by the next collection).
        assert threads <= linked[1] and memfds <= linked[2] and fds <= linked[0] + 4, (fds, threads, memfds, linked)
        assert server.links() == [] and client.links() == []
    assert _within(await settled(baseline), baseline, 0), baseline


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_crashed_peer_leaves_nothing_behind(transport: str) -> None:
    """SIGKILL the prompt process while linked (after transfers): the decoder drops the link by itself, and
    every descriptor, thread and mapping it held for that peer is gone; it can link to a new process."""
    async with LLMDataDist(LLMRole.DECODER, 52) as dd:
        await dd.init({})
        dst = dd.cache_manager.allocate_blocks_cache(DESC)
        before = None
        for attempt in ("unlink", "crash", "relink"):
            port = free_port()
            peer = await PeerProcess.start()
            try:
                await peer.call("init", role="PROMPT", cluster_id=51, options=server_options(port, transport))
                remote = await peer.call("allocate", blocks=True, num_tensors=2, shape=[8, 4096], blocks_key=[51, 0])
                await peer.call("fill", cache_id=remote["cache_id"], seed=6)
                assert (await dd.link_clusters([cluster_info(51, port)], timeout=5000))[0] == S.LLM_SUCCESS
                for _ in range(2):
                    await dd.cache_manager.pull_blocks(BlocksCacheKey(51, 0), dst, [1, 2], [3, 4])
                if attempt == "unlink":  # a normal first cycle: ZeroMQ's lazily started threads exist from now on
                    await dd.unlink_clusters([cluster_info(51, port)], timeout=5000)
                    before = await settled(counts())
                elif attempt == "crash":
                    peer.kill()
                    deadline = asyncio.get_running_loop().time() + 10
                    while dd.links() and asyncio.get_running_loop().time() < deadline:
                        await asyncio.sleep(0.05)
                    assert dd.links() == [], "the crash was not noticed"
                    assert before is not None
                    fds, threads, memfds = await settled(before, slack=4)
                    assert threads <= before[1] and memfds <= before[2] and fds <= before[0] + 4, (
                        fds, threads, memfds, before)
            finally:
                await peer.close()


def peer_mappings(owner_cluster: int) -> int:
    """Mappings in this process of an owner's cache segments (memfds named after its cluster id)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if f"memfd:aiodatadist-{owner_cluster} " in line)


async def _until_unmapped(owner_cluster: int, within: float = 10.0) -> None:
    """Wait until this process maps at most two of the owner's cache segments (the owner tells it what it freed:
    the unmapping follows its messages, a moment after the frees)."""
    deadline = asyncio.get_running_loop().time() + within
    while (mapped := peer_mappings(owner_cluster)) > 2:
        assert asyncio.get_running_loop().time() < deadline, f"{mapped} mappings of freed caches after {within} s"
        await asyncio.sleep(0.01)


async def test_caches_the_owner_frees_are_unmapped_by_the_requester() -> None:
    """A serving prompt allocates a cache per request and frees it once the decoder pulled it: the decoder's
    mappings of freed caches go too (they kept the freed pages alive until unlink), also when the pull was
    one-sided (no lease on the owner) and the cache is freed while that pull runs."""
    from aiodatadist import CacheKey
    from aiodatadist.testing import linked_pair

    per_request = CacheDesc(2, (1, 4 << 20), DataType.DT_UINT8, Placement.HOST)
    async with linked_pair() as (prompt, decoder):
        dst = decoder.cache_manager.allocate_cache(per_request)
        for i in range(60):
            src = prompt.cache_manager.allocate_cache(per_request, [CacheKey(1, i)])
            data = fill_pattern(src, i)
            await decoder.cache_manager.pull_cache(CacheKey(1, i), dst, 0)
            assert np.array_equal(dst.tensors[1].reshape(-1), data[1])
            prompt.cache_manager.deallocate_cache(src)
        await _until_unmapped(1)  # not 60

        big = CacheDesc(4, (64, 1 << 20), DataType.DT_UINT8, Placement.HOST)  # 256 MiB
        src = prompt.cache_manager.allocate_blocks_cache(big, BlocksCacheKey(1, 7))
        data = fill_pattern(src, 99)
        out = decoder.cache_manager.allocate_blocks_cache(big)
        blocks = list(range(64))
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 7), out, [0], [0])  # resolved: now one-sided
        for _ in range(3):
            pull = asyncio.create_task(decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 7), out, blocks, blocks))
            await asyncio.sleep(0.002)
            prompt.cache_manager.deallocate_blocks_cache(src)  # freed at once: nothing of the owner holds it
            try:
                await pull
                assert all(np.array_equal(a.reshape(-1), b) for a, b in zip(out.tensors, data))
            except Exception as exc:  # noqa: BLE001 - NOT_EXIST is the other allowed outcome
                assert getattr(exc, "status_code", None) == S.LLM_KV_CACHE_NOT_EXIST, exc
            src = prompt.cache_manager.allocate_blocks_cache(big, BlocksCacheKey(1, 7))
            data = fill_pattern(src, 99)
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 7), out, [0], [0])
        prompt.cache_manager.deallocate_blocks_cache(src)
        await _until_unmapped(1)


DROPPED_WITHOUT_FINALIZE = """
import asyncio, gc, sys
from aiodatadist import LLMConfig, LLMDataDist, LLMRole, LLMStatusCode
from aiodatadist.testing import cluster_info, free_port

dropped, transport = sys.argv[1], sys.argv[2]

async def main():
    port = free_port()
    server_cfg = LLMConfig()
    server_cfg.listen_ip_info = f"127.0.0.1:{port}"
    server_cfg.transport = transport
    client_cfg = LLMConfig()
    client_cfg.transport = transport
    server = LLMDataDist(LLMRole.PROMPT, 1)
    await server.init(dict(server_cfg.generate_options()))
    client = LLMDataDist(LLMRole.DECODER, 2)
    await client.init(dict(client_cfg.generate_options()))
    code, _ = await client.link_clusters([cluster_info(1, port)], timeout=5000)
    assert code == LLMStatusCode.LLM_SUCCESS, code
    return {"server": server, "client": client}

instances = asyncio.run(main())  # the loop is gone; neither instance was finalized
kept = instances.pop("server" if dropped == "client" else "client")
del instances
gc.collect()  # the dropped instance goes here
print("collected", flush=True)
"""


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("dropped", ["client", "server"])
def test_a_linked_instance_dropped_without_finalize_does_not_hang_the_process(dropped: str, transport: str) -> None:
    """Garbage-collecting a linked instance that was never finalized must not hang in the ZeroMQ context's
    ``term()`` (the collector clears pyzmq's weak references to the still open sockets): its sockets are closed
    with linger 0, the context is terminated off the finalizer, a warning says so, and the process exits."""
    try:
        proc = subprocess.run([sys.executable, "-c", DROPPED_WITHOUT_FINALIZE, dropped, transport],
                              check=False, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process hung after dropping the {dropped} ({transport}): {exc.stdout!r} {exc.stderr!r}")
    assert proc.returncode == 0, proc.stderr
    assert "collected" in proc.stdout
    assert "was not finalized" in proc.stderr, proc.stderr
