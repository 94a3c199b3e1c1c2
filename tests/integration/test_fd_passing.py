"""Same-host peers that may not open each other's ``/proc/<pid>/fd`` nor use ``process_vm_*`` (another user):
the owner hands its cache segments over its abstract Unix socket (``SCM_RIGHTS``) to admitted peers only.

The requester runs with ``AIODATADIST_SAME_HOST=fds`` (its only allowed mechanism), as a process under another
user would be left with; ``test_a_peer_under_another_user_uses_the_fast_plane`` runs one as ``nobody`` when the
tests run as root."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection

import numpy as np
import pytest
from helpers.data import fill_pattern, pattern
from helpers.internals import registry_of

from aiodatadist import BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMRole, LLMStatusCode, Placement
from aiodatadist.testing import PeerProcess, free_port
from aiodatadist.transport.fd_passing import PROBE, SEGMENT, request_fd

S = LLMStatusCode
OWNER, PEER = 81, 82
DESC = CacheDesc(4, (16, 4096), DataType.DT_UINT8, Placement.HOST)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[LLMDataDist, PeerProcess]]:
    """This process owns caches and listens; a peer process restricted to ``fds`` links to it."""
    port = free_port()
    peer = await PeerProcess.start(env={"AIODATADIST_SAME_HOST": "fds"})
    try:
        async with LLMDataDist(LLMRole.PROMPT, OWNER) as dd:
            await dd.init({"llm.listenIpInfo": f"127.0.0.1:{port}"})
            dd.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(OWNER, 0))  # announced at link time
            await peer.call("init", role="DECODER", cluster_id=PEER, options={})
            assert (await peer.call("link", cluster_id=OWNER, port=port))[0] == S.LLM_SUCCESS
            yield dd, peer
    finally:
        await peer.close()


async def test_segments_are_handed_over_and_the_fast_plane_works(pair: tuple[LLMDataDist, PeerProcess]) -> None:
    dd, peer = pair
    link = (await peer.call("links"))[0]
    assert (link["plane"], link["peer"]) == ("shm", "same host (fds)")
    cm = dd.cache_manager
    first = registry_of(cm).by_id(1).handle
    assert first is not None
    data = fill_pattern(first, 5)
    later = cm.allocate_blocks_cache(DESC, BlocksCacheKey(OWNER, 1))  # created after the link: handed over on use
    later_data = fill_pattern(later, 6)
    mine = await peer.call("allocate", blocks=True, num_tensors=4, shape=[16, 4096])
    for model, want in ((0, data), (1, later_data)):
        await peer.call("transfer", op="pull_blocks", cache_id=mine["cache_id"],
                        key={"type": "blocks", "cluster_id": OWNER, "model_id": model},
                        src_blocks=[3, 7], dst_blocks=[0, 1])
        for t in range(4):
            got = bytes.fromhex(await peer.call("read", cache_id=mine["cache_id"], tensor=t, offset=0,
                                                nbytes=2 * 4096))
            rows = want[t].reshape(16, 4096)
            assert got == rows[[3, 7]].tobytes(), f"model {model} tensor {t}"
    await peer.call("fill", cache_id=mine["cache_id"], seed=9)  # and a push into the owner's segment
    await peer.call("transfer", op="push_blocks", cache_id=mine["cache_id"],
                    key={"type": "blocks", "cluster_id": OWNER, "model_id": 1}, src_blocks=[2], dst_blocks=[15])
    for t, tensor in enumerate(later.tensors):
        assert np.array_equal(tensor.view(np.uint8).reshape(16, 4096)[15],
                              pattern(9, t, 16 * 4096).reshape(16, 4096)[2])


async def test_the_socket_hands_nothing_to_strangers(pair: tuple[LLMDataDist, PeerProcess]) -> None:
    """Without a link's token, or for memory that is not a remote-accessible cache segment, nothing is handed
    over; the probe is handed over read-only."""
    dd, _ = pair
    links = dd._links_or_raise()
    name = links._probe.fds
    assert name is not None
    entry = registry_of(dd.cache_manager).by_id(1)
    shared = entry.shared_segment
    assert shared is not None
    identity = shared.identity
    with pytest.raises(OSError):
        await asyncio.to_thread(request_fd, name, SEGMENT, os.urandom(16), identity.inode, identity.device)
    grant = next(iter(links._fd_socket._grants))
    with pytest.raises(OSError):  # a granted peer, but memory that is no cache of this instance
        await asyncio.to_thread(request_fd, name, SEGMENT, grant, identity.inode + 1, identity.device)
    fd = await asyncio.to_thread(request_fd, name, SEGMENT, grant, identity.inode, identity.device)
    os.close(fd)
    probe = await asyncio.to_thread(request_fd, name, PROBE)
    try:
        flags = os.stat(f"/proc/self/fd/{probe}")  # (it exists)
        assert flags is not None
        with pytest.raises(OSError):
            os.write(probe, b"x")  # read-only
    finally:
        os.close(probe)
    await asyncio.sleep(0)


def _pull_as_nobody(port: int, out: Connection) -> None:
    """In a forked child: become ``nobody``, link to the owner and pull (stdlib modules are imported first, the
    interpreter's directory may not be readable by that user)."""
    import concurrent.futures.thread  # noqa: F401 - asyncio.to_thread's executor, imported lazily otherwise

    from aiodatadist.testing import cluster_info

    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)

    async def run() -> tuple[str, str, bytes]:
        async with LLMDataDist(LLMRole.DECODER, PEER) as dd:
            await dd.init({})
            code, _ = await dd.link_clusters([cluster_info(OWNER, port)], timeout=5000)
            assert code == S.LLM_SUCCESS, code
            cache = dd.cache_manager.allocate_blocks_cache(DESC)
            await dd.cache_manager.pull_blocks(BlocksCacheKey(OWNER, 0), cache, [3, 7], [0, 1])
            link = dd.links()[0]
            return link["plane"], link["peer"], cache.tensors[2].view(np.uint8).reshape(16, 4096)[:2].tobytes()

    try:
        out.send(("ok", asyncio.run(run())))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.send(("error", repr(exc)))


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a peer as another user (nobody)")
async def test_a_peer_under_another_user_uses_the_fast_plane() -> None:
    """A real second user: ``/proc/<pid>/fd`` and ``process_vm_readv`` are refused to it (no ptrace rights over
    a root process), so only the handed-over segments put it on the same-host plane."""
    port = free_port()
    async with LLMDataDist(LLMRole.PROMPT, OWNER) as dd:
        await dd.init({"llm.listenIpInfo": f"127.0.0.1:{port}"})
        cache = dd.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(OWNER, 0))
        data = fill_pattern(cache, 4)
        ctx = multiprocessing.get_context("forkserver")  # a clean process: no inherited threads or loops
        reader, writer = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_pull_as_nobody, args=(port, writer))
        child.start()
        try:
            ready = await asyncio.to_thread(reader.poll, 60)
            assert ready, "the child reported nothing"
            status, value = reader.recv()
        finally:
            await asyncio.to_thread(child.join, 10)
        if status == "error" and "Permission denied" in value:
            pytest.skip(f"the child cannot run as nobody here: {value}")
        assert status == "ok", value
        plane, peer, got = value
        assert (plane, peer) == ("shm", "same host (fds)")
        assert got == data[2].reshape(16, 4096)[[3, 7]].tobytes()
