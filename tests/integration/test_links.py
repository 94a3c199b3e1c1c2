"""Links between two real processes (ZeroMQ on 127.0.0.1, random ports): link_clusters / unlink_clusters /
switch_role, and how transfers fail, and keep working afterwards, at the edges.

One peer process per module runs the remote ``LLMDataDist``; each test re-initializes it with a fresh cluster id
and port, and creates its in-process instances itself.  After every error both ends must still work: a following
valid transfer is byte-exact and the in-process end holds no lease for the link.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
from helpers.world import (
    LocalSide,
    PeerSide,
    Side,
    World,
    assert_bytes,
    assert_changed,
    block_runs,
    blocks_key,
    eventually,
    expect_code,
    expected_after,
    id_key,
    local_instance,
    new_cluster_id,
    req_key,
    slot_runs,
    start_peer,
)

import aiodatadist.link.dial
import aiodatadist.link.manager
from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import PeerError, cluster_info, free_port

pytestmark = pytest.mark.asyncio(loop_scope="module")

S = LLMStatusCode
PARAM_INVALID = S.LLM_PARAM_INVALID
NOT_EXIST = S.LLM_KV_CACHE_NOT_EXIST
NOT_YET_LINK = S.LLM_NOT_YET_LINK
OK = (S.LLM_SUCCESS, [S.LLM_SUCCESS])

MakeLocal = Callable[..., Awaitable[LocalSide]]
MakeWorld = Callable[..., Awaitable[World]]


# -- fixtures ------------------------------------------------------------------------------------------------

@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def peer_process() -> AsyncIterator[PeerSide]:
    peer = await start_peer()
    try:
        yield peer
    finally:
        await peer.proc.close()


@pytest_asyncio.fixture(loop_scope="module")
async def peer(peer_process: PeerSide) -> AsyncIterator[PeerSide]:
    """The peer process with a fresh, listening instance (a new cluster id and port)."""
    await peer_process.reset(listen=True)
    try:
        yield peer_process
    finally:
        await peer_process.call("finalize")


@pytest_asyncio.fixture(loop_scope="module")
async def make_local() -> AsyncIterator[MakeLocal]:
    made: list[LocalSide] = []

    async def make(**kw: Any) -> LocalSide:
        side = await local_instance(**kw)
        made.append(side)
        return side

    try:
        yield make
    finally:
        await asyncio.gather(*(side.finalize() for side in made))


@pytest_asyncio.fixture(loop_scope="module")
async def make_world(peer_process: PeerSide) -> AsyncIterator[MakeWorld]:
    made: list[World] = []

    async def make(**kw: Any) -> World:
        world = await World.create(peer_process, **kw)
        made.append(world)
        return world

    try:
        yield make
    finally:
        for world in made:
            await world.close()


@pytest.fixture(params=["peer-server", "peer-client"])
def topology(request: pytest.FixtureRequest) -> bool:
    """True when the peer is the server (listens) and the in-process instance the client."""
    return request.param == "peer-server"


async def link(client: LocalSide, server: Side, timeout: int = 3000) -> tuple[Any, list[Any]]:
    assert server.port is not None
    return await client.dd.link_clusters([cluster_info(server.cluster_id, server.port)], timeout)


async def check_pull(requester: Side, owner: Side, seed: int = 1) -> None:
    """A fresh pull by id between the two ends is byte-exact."""
    src = await owner.new_cache(2, (2, 64), seed=seed)
    dst = await requester.new_cache(2, (2, 64), seed=seed + 1)
    src_bytes, before = await owner.snapshot(src), await requester.snapshot(dst)
    await requester.transfer("pull_cache", dst, id_key(owner.cluster_id, src.cache_id, 1), batch_index=0)
    exp = expected_after(before, src_bytes, [(0, 0), (1, 1)], slot_runs(1, 64, 0, 64))
    assert_changed(before, exp)
    assert_bytes(await requester.snapshot(dst), exp)
    await owner.release(src)
    await requester.release(dst)


async def check_both_ways(a: Side, b: Side) -> None:
    await check_pull(a, b, seed=5)
    await check_pull(b, a, seed=7)


# -- link_clusters ---------------------------------------------------------------------------------------------

async def test_link_succeeds_and_both_sides_see_it(peer: PeerSide, make_local: MakeLocal) -> None:
    local = await make_local()
    code, codes = await link(local, peer)
    assert (code, codes) == OK
    assert isinstance(code, LLMStatusCode) and all(isinstance(c, LLMStatusCode) for c in codes)
    [mine] = local.dd.links()
    assert mine["remote_cluster_id"] == peer.cluster_id and mine["side"] == "client"
    await eventually(lambda: _peer_links(peer, {local.cluster_id}), what="the server lists the client")
    [theirs] = await peer.links()
    assert theirs["side"] == "server"
    await check_both_ways(local, peer)


async def _peer_links(peer: PeerSide, expected: set[int]) -> bool:
    return await peer.linked_to() == expected


async def test_linking_again_gives_already_link(peer: PeerSide, make_local: MakeLocal) -> None:
    local = await make_local()
    assert await link(local, peer) == OK
    assert await link(local, peer) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
    # Another instance with the same cluster id cannot link to the same server either.
    twin = await make_local(cluster_id=local.cluster_id)
    assert await link(twin, peer) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
    assert twin.dd.links() == []
    assert len(local.dd.links()) == 1
    assert await peer.linked_to() == {local.cluster_id}
    await check_both_ways(local, peer)


async def test_unreachable_port_fails_within_the_timeout(peer: PeerSide, make_local: MakeLocal) -> None:
    local = await make_local()
    start = time.monotonic()
    code, codes = await local.dd.link_clusters([cluster_info(peer.cluster_id, free_port())], timeout=300)
    elapsed = time.monotonic() - start
    assert (code, codes) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert elapsed < 3.0, f"link_clusters(timeout=300) took {elapsed:.2f} s"  # (10x: a loaded machine's room)
    assert local.dd.links() == []
    # The failure leaves nothing behind: the real server links fine afterwards.
    assert await link(local, peer) == OK
    await check_pull(local, peer)


async def test_wrong_remote_cluster_id_fails(peer: PeerSide, make_local: MakeLocal) -> None:
    local = await make_local()
    wrong = cluster_info(new_cluster_id(), peer.port or 0)
    assert await local.dd.link_clusters([wrong], timeout=2000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert local.dd.links() == []
    assert await peer.links() == []
    assert await link(local, peer) == OK
    await check_pull(peer, local)


async def test_several_clusters_in_one_call(peer: PeerSide, make_local: MakeLocal) -> None:
    local = await make_local()
    other = await make_local(listen=True, role=LLMRole.PROMPT)
    assert other.port is not None and peer.port is not None
    clusters = [
        cluster_info(peer.cluster_id, peer.port),            # fine
        cluster_info(new_cluster_id(), free_port()),          # nobody listens
        cluster_info(new_cluster_id(), peer.port),            # the server there has another id
        cluster_info(other.cluster_id, other.port),           # fine (a server in this process)
    ]
    code, codes = await local.dd.link_clusters(clusters, timeout=500)
    assert codes == [S.LLM_SUCCESS, S.LLM_LINK_FAILED, S.LLM_LINK_FAILED, S.LLM_SUCCESS]
    assert code != S.LLM_SUCCESS and code in codes
    assert {link["remote_cluster_id"] for link in local.dd.links()} == {peer.cluster_id, other.cluster_id}
    # Linking the same list again: the linked ones are already linked.
    code, codes = await local.dd.link_clusters([clusters[3], clusters[0]], timeout=500)
    assert (code, codes) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK, S.LLM_ALREADY_LINK])
    await check_both_ways(local, peer)
    await check_pull(local, other)


async def test_link_argument_errors(peer: PeerSide, make_local: MakeLocal) -> None:
    local = await make_local()
    assert peer.port is not None
    good = cluster_info(peer.cluster_id, peer.port)
    with pytest.raises(TypeError):
        await local.dd.link_clusters(good)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await local.dd.link_clusters({peer.cluster_id: good})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await local.dd.link_clusters([good, "127.0.0.1"])  # type: ignore[list-item]
    for timeout in (0, -1):
        with pytest.raises(LLMException) as info:
            await local.dd.link_clusters([good], timeout=timeout)
        assert info.value.status_code == PARAM_INVALID
    no_remote = LLMClusterInfo()
    no_remote.remote_cluster_id = peer.cluster_id
    no_remote.append_local_ip_info("127.0.0.1", 0)
    no_local = LLMClusterInfo()
    no_local.remote_cluster_id = peer.cluster_id
    no_local.append_remote_ip_info("127.0.0.1", peer.port)
    no_id = LLMClusterInfo()
    no_id.append_local_ip_info("127.0.0.1", 0)
    no_id.append_remote_ip_info("127.0.0.1", peer.port)
    for bad in (no_remote, no_local):
        with pytest.raises(LLMException) as info:
            await local.dd.link_clusters([good, bad])
        assert info.value.status_code == PARAM_INVALID
    with pytest.raises(TypeError):
        await local.dd.link_clusters([no_id])
    with pytest.raises(TypeError):
        await local.dd.unlink_clusters(good)  # type: ignore[arg-type]
    with pytest.raises(LLMException) as info:
        await local.dd.unlink_clusters([good], timeout=0)
    assert info.value.status_code == PARAM_INVALID
    # Argument errors are raised before anything happens: nothing got linked, on either side.
    assert local.dd.links() == []
    assert await peer.links() == []
    assert await local.dd.link_clusters((good,)) == OK  # a tuple is fine
    await check_pull(local, peer)


async def test_no_local_ip_info_is_fine_with_local_comm_res(peer: PeerSide, make_local: MakeLocal) -> None:
    local = await make_local(options={"llm.LocalCommRes": ""})
    assert peer.port is not None
    no_local = LLMClusterInfo()
    no_local.remote_cluster_id = peer.cluster_id
    no_local.append_remote_ip_info("127.0.0.1", peer.port)
    assert await local.dd.link_clusters([no_local]) == OK
    await check_both_ways(local, peer)


async def test_at_most_512_links_per_server(peer: PeerSide, make_local: MakeLocal) -> None:
    """The real cap: 512 in-process clients link to the peer process, the 513th is refused."""
    assert aiodatadist.link.manager.MAX_LINKS == 512
    clients = list(await asyncio.gather(*(make_local() for _ in range(512))))
    results = await asyncio.gather(*(link(c, peer, timeout=20000) for c in clients))
    assert all(r == OK for r in results), {str(r) for r in results if r != OK}
    assert len(await peer.links()) == 512
    extra = await make_local()
    assert await link(extra, peer) == (S.LLM_CLUSTER_NUM_EXCEED_LIMIT, [S.LLM_CLUSTER_NUM_EXCEED_LIMIT])
    assert extra.dd.links() == []
    # A slot freed by an unlink can be used again; the existing links keep working meanwhile.
    assert await clients[0].dd.unlink_clusters([cluster_info(peer.cluster_id, 1)]) == OK
    await eventually(lambda: _peer_link_count(peer, 511), what="the server drops the unlinked client")
    assert await link(extra, peer) == OK
    await check_pull(peer, extra)
    await check_pull(clients[-1], peer)


async def _peer_link_count(peer: PeerSide, n: int) -> bool:
    return len(await peer.links()) == n


async def test_client_side_link_cap(peer: PeerSide, make_local: MakeLocal, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap applies to the linking instance too (``MAX_LINKS`` of the client side patched to 2 here, so that
    it needs only three servers: the peer process and two in-process servers)."""
    monkeypatch.setattr(aiodatadist.link.dial, "MAX_LINKS", 2)
    local = await make_local()
    first = await make_local(listen=True, role=LLMRole.PROMPT)
    second = await make_local(listen=True, role=LLMRole.PROMPT)
    assert await link(local, peer) == OK
    assert await link(local, first) == OK
    assert await link(local, second) == (S.LLM_CLUSTER_NUM_EXCEED_LIMIT, [S.LLM_CLUSTER_NUM_EXCEED_LIMIT])
    assert second.dd.links() == []
    assert {x["remote_cluster_id"] for x in local.dd.links()} == {peer.cluster_id, first.cluster_id}
    await check_both_ways(local, peer)


# -- unlink_clusters -------------------------------------------------------------------------------------------

async def _linked_pair_with_caches(w: World) -> tuple[Any, Any]:
    """One contiguous cache on each end, filled; returns (local cache, peer cache)."""
    return (await w.local.new_cache(2, (2, 64), seed=31), await w.peer.new_cache(2, (2, 64), seed=32))


async def _assert_unlinked(w: World, local_cache: Any, peer_cache: Any) -> None:
    """Neither end lists the link; transfers both ways fail with LLM_NOT_YET_LINK and move nothing."""
    await eventually(lambda: _no_links(w.local), what="the in-process end drops the link")
    await eventually(lambda: _no_links(w.peer), what="the peer drops the link")
    local_before, peer_before = await w.local.snapshot(local_cache), await w.peer.snapshot(peer_cache)
    for requester, cache in ((w.local, local_cache), (w.peer, peer_cache)):
        owner = w.other(requester)
        owner_cache = peer_cache if requester is w.local else local_cache
        await expect_code(requester.transfer("pull_cache", cache, id_key(owner.cluster_id, owner_cache.cache_id)),
                          NOT_YET_LINK)
        await expect_code(requester.transfer("push_cache", cache, id_key(owner.cluster_id, owner_cache.cache_id)),
                          NOT_YET_LINK)
    assert_bytes(await w.local.snapshot(local_cache), local_before)
    assert_bytes(await w.peer.snapshot(peer_cache), peer_before)


async def _no_links(side: Side) -> bool:
    return await side.links() == []


async def test_client_unlink_is_seen_by_the_server(make_world: MakeWorld, topology: bool) -> None:
    w = await make_world(peer_listens=topology)
    local_cache, peer_cache = await _linked_pair_with_caches(w)
    assert await w.client.unlink(w.server.cluster_id) == OK
    assert await w.client.links() == []
    await _assert_unlinked(w, local_cache, peer_cache)
    # Relinking works and transfers are byte-exact again.
    await w.link()
    await check_both_ways(w.local, w.peer)
    await w.settled()


async def test_server_unlink_is_seen_by_the_client(make_world: MakeWorld, topology: bool) -> None:
    w = await make_world(peer_listens=topology)
    local_cache, peer_cache = await _linked_pair_with_caches(w)
    assert await w.server.unlink(w.client.cluster_id) == OK
    assert await w.server.links() == []
    await _assert_unlinked(w, local_cache, peer_cache)
    await w.link()
    await check_both_ways(w.local, w.peer)
    await w.settled()


async def test_finalize_is_seen_by_the_other_end(make_world: MakeWorld) -> None:
    w = await make_world(peer_listens=True)
    cache = await w.local.new_cache(2, (2, 64), seed=41)
    await w.peer.call("finalize")
    await eventually(lambda: _no_links(w.local), what="the client drops the link of a finalized server")
    before = await w.local.snapshot(cache)
    await expect_code(w.local.transfer("pull_cache", cache, id_key(w.peer.cluster_id, 1)), NOT_YET_LINK)
    assert_bytes(await w.local.snapshot(cache), before)


async def test_unlink_unknown_cluster(make_world: MakeWorld, topology: bool) -> None:
    w = await make_world(peer_listens=topology)
    unknown = new_cluster_id()
    for side in (w.local, w.peer):
        assert await side.unlink(unknown) == (S.LLM_UNLINK_FAILED, [S.LLM_UNLINK_FAILED])
        assert await side.unlink(unknown, force=True) == OK
    # The real link is untouched.
    assert await w.local.linked_to() == {w.peer.cluster_id}
    assert await w.peer.linked_to() == {w.local.cluster_id}
    await check_both_ways(w.local, w.peer)
    await w.settled()


async def test_forced_unlink_on_both_ends_then_relink(make_world: MakeWorld, topology: bool) -> None:
    w = await make_world(peer_listens=topology)
    assert await w.client.unlink(w.server.cluster_id, force=True) == OK
    assert await w.client.links() == []
    assert await w.server.unlink(w.client.cluster_id, force=True) == OK
    assert await w.server.links() == []
    await w.link()
    await check_both_ways(w.local, w.peer)
    await w.settled()


async def test_forced_unlink_still_tells_a_healthy_peer(make_world: MakeWorld) -> None:
    """docs/api.md: "With force, the BYE is sent without waiting" -- the peer should drop its end shortly after
    and its transfers should fail with LLM_NOT_YET_LINK instead of being sent into a dead link."""
    w = await make_world(peer_listens=True)
    assert await w.local.unlink(w.peer.cluster_id, force=True) == OK
    assert await w.local.links() == []
    # (by the BYE: well before the 5 s heartbeat timeout would drop it, however loaded the machine)
    await eventually(lambda: _no_links(w.peer), timeout=3.0, what="the server drops the force-unlinked link")


async def test_relink_after_unlink_repeatedly(make_world: MakeWorld) -> None:
    w = await make_world(peer_listens=True)
    for round_ in range(3):
        assert await w.local.unlink(w.peer.cluster_id) == OK
        await eventually(lambda: _no_links(w.peer), what="the server drops the link")
        await w.link()
        await check_pull(w.local, w.peer, seed=50 + round_)
    await w.settled()


# -- switch_role -------------------------------------------------------------------------------------------------

async def test_switch_role_with_a_live_link_is_refused(make_world: MakeWorld, topology: bool) -> None:
    w = await make_world(peer_listens=topology)
    role = w.local.dd.role
    for new_role, options in ((LLMRole.MIX, None), (LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{free_port()}"})):
        with pytest.raises(LLMException) as info:
            await w.local.dd.switch_role(new_role, options)
        assert info.value.status_code == S.LLM_EXIST_LINK
        assert w.local.dd.role == role
    assert await w.local.linked_to() == {w.peer.cluster_id}
    await check_both_ways(w.local, w.peer)
    await w.settled()


async def test_switch_role_server_to_client_and_back(peer_process: PeerSide, make_local: MakeLocal) -> None:
    peer = await peer_process.reset(listen=False)
    server = await make_local(listen=True, role=LLMRole.PROMPT)
    assert server.port is not None
    # The peer (a client) links, pulls, unlinks.
    assert await peer.link(server.cluster_id, server.port) == OK
    await check_pull(peer, server)
    assert await peer.unlink(server.cluster_id) == OK
    await eventually(lambda: _no_links(server), what="the server drops the link")

    await server.dd.switch_role(LLMRole.DECODER)  # no listen address: stop listening
    assert server.dd.role == LLMRole.DECODER
    assert await peer.link(server.cluster_id, server.port, timeout=500) == (S.LLM_LINK_FAILED,
                                                                            [S.LLM_LINK_FAILED])
    assert await peer.links() == []
    assert server.dd.links() == []

    port = free_port()
    await server.dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{port}"})
    assert server.dd.role == LLMRole.PROMPT
    assert await peer.link(server.cluster_id, port) == OK
    await check_both_ways(server, peer)
    await peer.call("finalize")


async def test_switch_role_moves_a_server_to_another_port(peer_process: PeerSide, make_local: MakeLocal) -> None:
    peer = await peer_process.reset(listen=False)
    server = await make_local(listen=True, role=LLMRole.PROMPT)
    old = server.port
    assert old is not None
    new = free_port()
    await server.dd.switch_role(LLMRole.MIX, {"llm.listenIpInfo": f"127.0.0.1:{new}"})
    assert server.dd.role == LLMRole.MIX
    assert await peer.link(server.cluster_id, old, timeout=300) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert await peer.link(server.cluster_id, new) == OK
    await check_both_ways(server, peer)
    await peer.call("finalize")


async def test_failed_switch_role_changes_nothing(peer_process: PeerSide, make_local: MakeLocal) -> None:
    peer = await peer_process.reset(listen=False)
    server = await make_local(listen=True, role=LLMRole.PROMPT)
    assert server.port is not None
    with socket.socket() as blocker:  # the new address is taken by someone else
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy = blocker.getsockname()[1]
        code = None
        try:
            await server.dd.switch_role(LLMRole.DECODER, {"llm.listenIpInfo": f"127.0.0.1:{busy}"})
        except LLMException as exc:
            # Keep only the code: the traceback holds the half-built server socket, and while that socket is
            # alive finalize() cannot terminate the ZeroMQ context (see test_init_on_a_busy_port_raises).
            code = exc.status_code
        assert code == PARAM_INVALID
    assert server.dd.role == LLMRole.PROMPT
    # The failed call must leave the server listening where it was.
    assert await peer.link(server.cluster_id, server.port, timeout=500) == OK
    await check_both_ways(server, peer)
    await peer.call("finalize")


INIT_ON_A_BUSY_PORT = """
import asyncio, socket
from aiodatadist import LLMDataDist, LLMException, LLMRole

async def main():
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        try:
            async with asyncio.timeout(2):
                await dd.init({"llm.listenIpInfo": "127.0.0.1:%d" % blocker.getsockname()[1]})
        except LLMException as exc:
            print("raised", int(exc.status_code), dd.is_initialized, flush=True)
        except TimeoutError:
            print("hung", flush=True)
        else:
            print("initialized", flush=True)

asyncio.run(main())
"""


async def test_init_on_a_busy_port_raises() -> None:
    """``init`` with a ``llm.listenIpInfo`` that another socket holds must raise LLM_PARAM_INVALID promptly and
    leave the instance uninitialized (it runs in a child process because the bug makes it hang)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", INIT_ON_A_BUSY_PORT,
                                                stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()
    finally:
        proc.kill()
        await proc.wait()
    assert line == f"raised {int(PARAM_INVALID)} False"


async def test_switch_role_client_to_server(peer: PeerSide, make_local: MakeLocal) -> None:
    """The reference's switch_role sample: a client that pulled becomes a server and the old server, now a
    client, links to it and pushes into it."""
    local = await make_local(role=LLMRole.DECODER)
    assert await link(local, peer) == OK
    await check_pull(local, peer)
    assert await local.unlink(peer.cluster_id) == OK
    await eventually(lambda: _no_links(peer), what="the server drops the link")

    port = free_port()
    await local.dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{port}"})
    assert local.dd.role == LLMRole.PROMPT
    newcomer = await peer.reset(listen=False)
    assert await newcomer.link(local.cluster_id, port) == OK
    dst = await local.new_cache(2, (4, 32), blocks=True, model_id=3, seed=61)
    src = await newcomer.new_cache(2, (4, 32), blocks=True, seed=62)
    before, src_bytes = await local.snapshot(dst), await newcomer.snapshot(src)
    await newcomer.transfer("push_blocks", src, blocks_key(local.cluster_id, 3), src_blocks=[0, 1],
                            dst_blocks=[3, 0])
    exp = expected_after(before, src_bytes, [(0, 0), (1, 1)], block_runs([0, 1], [3, 0], 32))
    assert_changed(before, exp)
    assert_bytes(await local.snapshot(dst), exp)


# -- transfers without a usable link ----------------------------------------------------------------------------

async def test_transfers_without_a_link(peer: PeerSide, make_local: MakeLocal) -> None:
    local = await make_local()
    mine = await local.new_cache(2, (2, 64), seed=71)
    blk = await local.new_cache(2, (4, 64), blocks=True, seed=72)
    theirs = await peer.new_cache(2, (2, 64), seed=73)
    before, before_blk, theirs_before = await local.snapshot(mine), await local.snapshot(blk), \
        await peer.snapshot(theirs)
    pc = peer.cluster_id
    await expect_code(local.transfer("pull_cache", mine, id_key(pc, theirs.cache_id)), NOT_YET_LINK)
    await expect_code(local.transfer("pull_cache", mine, req_key(pc, 1)), NOT_YET_LINK)
    await expect_code(local.transfer("pull_blocks", blk, blocks_key(pc, 0), src_blocks=[0], dst_blocks=[0]),
                      NOT_YET_LINK)
    await expect_code(local.transfer("push_cache", mine, id_key(pc, theirs.cache_id)), NOT_YET_LINK)
    await expect_code(local.transfer("push_blocks", blk, blocks_key(pc, 0), src_blocks=[0], dst_blocks=[0]),
                      NOT_YET_LINK)
    await expect_code(peer.transfer("pull_cache", theirs, id_key(local.cluster_id, mine.cache_id)), NOT_YET_LINK)
    await expect_code(peer.transfer("push_cache", theirs, id_key(local.cluster_id, mine.cache_id)), NOT_YET_LINK)
    assert_bytes(await local.snapshot(mine), before)
    assert_bytes(await local.snapshot(blk), before_blk)
    assert_bytes(await peer.snapshot(theirs), theirs_before)


async def test_pull_from_own_cluster_is_invalid(make_world: MakeWorld) -> None:
    w = await make_world(peer_listens=True)
    for side in (w.local, w.peer):
        own = await side.new_cache(2, (2, 64), seed=81, keys=[[side.cluster_id, 8]])
        dst = await side.new_cache(2, (2, 64), seed=82)
        blk = await side.new_cache(2, (2, 64), blocks=True, model_id=0, seed=83)
        before = await side.snapshot(dst)
        cid = side.cluster_id
        await expect_code(side.transfer("pull_cache", dst, id_key(cid, own.cache_id)), PARAM_INVALID)
        await expect_code(side.transfer("pull_cache", dst, req_key(cid, 8)), PARAM_INVALID)
        await expect_code(side.transfer("pull_blocks", blk, blocks_key(cid, 0), src_blocks=[0], dst_blocks=[1]),
                          PARAM_INVALID)
        assert_bytes(await side.snapshot(dst), before)
    await check_both_ways(w.local, w.peer)
    await w.settled()


# -- transfer errors: the call fails, nothing moves, both ends keep working --------------------------------------

async def _err_unknown_model_id(req: Side, own: Side) -> tuple[Any, Any]:
    dst = await req.new_cache(2, (4, 64), blocks=True, seed=1)
    await own.new_cache(2, (4, 64), blocks=True, model_id=1, seed=2)
    return dst, req.transfer("pull_blocks", dst, blocks_key(own.cluster_id, 2), src_blocks=[0], dst_blocks=[0])


async def _err_unknown_model_id_push(req: Side, own: Side) -> tuple[Any, Any]:
    src = await req.new_cache(2, (4, 64), blocks=True, seed=1)
    return src, req.transfer("push_blocks", src, blocks_key(own.cluster_id, 9), src_blocks=[0], dst_blocks=[0])


async def _err_unknown_cache_id(req: Side, own: Side) -> tuple[Any, Any]:
    dst = await req.new_cache(2, (2, 64), seed=1)
    return dst, req.transfer("pull_cache", dst, id_key(own.cluster_id, 10**6))


async def _err_unknown_cache_id_push(req: Side, own: Side) -> tuple[Any, Any]:
    src = await req.new_cache(2, (2, 64), seed=1)
    return src, req.transfer("push_cache", src, id_key(own.cluster_id, 10**6))


async def _err_unknown_cache_id_c2b(req: Side, own: Side) -> tuple[Any, Any]:
    dst = await req.new_cache(2, (4, 32), blocks=True, seed=1)
    return dst, req.transfer("pull_blocks", dst, id_key(own.cluster_id, 10**6), dst_blocks=[0])


async def _err_unknown_key(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (2, 64), keys=[[own.cluster_id, 1000]], seed=2)
    dst = await req.new_cache(2, (2, 64), seed=1)
    return dst, req.transfer("pull_cache", dst, req_key(own.cluster_id, 1001))


async def _err_remote_block_out_of_range(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (8, 64), blocks=True, model_id=4, seed=2)
    dst = await req.new_cache(2, (16, 64), blocks=True, seed=1)
    return dst, req.transfer("pull_blocks", dst, blocks_key(own.cluster_id, 4), src_blocks=[0, 8], dst_blocks=[0, 1])


async def _err_remote_block_out_of_range_push(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (8, 64), blocks=True, model_id=4, seed=2)
    src = await req.new_cache(2, (16, 64), blocks=True, seed=1)
    return src, req.transfer("push_blocks", src, blocks_key(own.cluster_id, 4), src_blocks=[9], dst_blocks=[8])


async def _err_remote_batch_out_of_range(req: Side, own: Side) -> tuple[Any, Any]:
    src = await own.new_cache(2, (2, 64), seed=2)
    dst = await req.new_cache(2, (2, 64), seed=1)
    return dst, req.transfer("pull_cache", dst, id_key(own.cluster_id, src.cache_id, 2))


async def _err_remote_batch_out_of_range_push(req: Side, own: Side) -> tuple[Any, Any]:
    dst = await own.new_cache(2, (2, 64), seed=2)
    src = await req.new_cache(2, (2, 64), seed=1)
    return src, req.transfer("push_cache", src, id_key(own.cluster_id, dst.cache_id, 2))


async def _err_block_size_mismatch(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (8, 64), blocks=True, model_id=5, seed=2)
    dst = await req.new_cache(2, (8, 32), blocks=True, seed=1)
    return dst, req.transfer("pull_blocks", dst, blocks_key(own.cluster_id, 5), src_blocks=[1], dst_blocks=[1])


async def _err_block_size_mismatch_push(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (8, 64), blocks=True, model_id=5, seed=2)
    src = await req.new_cache(2, (8, 128), blocks=True, seed=1)
    return src, req.transfer("push_blocks", src, blocks_key(own.cluster_id, 5), src_blocks=[1], dst_blocks=[1])


async def _err_b2c_into_contiguous(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (4, 64), blocks=True, model_id=6, seed=2)
    dst = await req.new_cache(2, (4, 64), seed=1)
    return dst, req.transfer("pull_blocks", dst, blocks_key(own.cluster_id, 6), src_blocks=[0], dst_blocks=[0])


async def _err_b2c_pull_cache_from_blocks(req: Side, own: Side) -> tuple[Any, Any]:
    src = await own.new_cache(2, (4, 64), blocks=True, model_id=6, seed=2)
    dst = await req.new_cache(2, (4, 64), seed=1)
    return dst, req.transfer("pull_cache", dst, id_key(own.cluster_id, src.cache_id, 0))


async def _err_push_cache_into_blocks(req: Side, own: Side) -> tuple[Any, Any]:
    dst = await own.new_cache(2, (4, 64), blocks=True, model_id=6, seed=2)
    src = await req.new_cache(2, (4, 64), seed=1)
    return src, req.transfer("push_cache", src, id_key(own.cluster_id, dst.cache_id, 0))


async def _err_num_tensors_mismatch(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(4, (4, 64), blocks=True, model_id=7, seed=2)
    dst = await req.new_cache(2, (4, 64), blocks=True, seed=1)
    return dst, req.transfer("pull_blocks", dst, blocks_key(own.cluster_id, 7), src_blocks=[0], dst_blocks=[0])


async def _err_size_too_big(req: Side, own: Side) -> tuple[Any, Any]:
    src = await own.new_cache(2, (2, 64), seed=2)
    dst = await req.new_cache(2, (2, 128), seed=1)
    return dst, req.transfer("pull_cache", dst, id_key(own.cluster_id, src.cache_id, 0), size=65)


async def _err_layer_range_too_big(req: Side, own: Side) -> tuple[Any, Any]:
    src = await own.new_cache(4, (2, 64), seed=2)
    dst = await req.new_cache(4, (2, 64), seed=1)
    return dst, req.transfer("pull_cache", dst, id_key(own.cluster_id, src.cache_id, 0), src_layer_range=[1, 3],
                             dst_layer_range=[0, 2], tensor_num_per_layer=2)


async def _err_push_layer_range_too_big(req: Side, own: Side) -> tuple[Any, Any]:
    dst = await own.new_cache(2, (2, 64), seed=2)
    src = await req.new_cache(4, (2, 64), seed=1)
    return src, req.transfer("push_cache", src, id_key(own.cluster_id, dst.cache_id, 0), src_layer_range=[1, 2],
                             dst_layer_range=[1, 2], tensor_num_per_layer=2)


async def _err_not_remote_accessible_id(req: Side, own: Side) -> tuple[Any, Any]:
    src = await own.new_cache(2, (2, 64), mem="register", remote_accessible=False, seed=2)
    dst = await req.new_cache(2, (2, 64), seed=1)
    return dst, req.transfer("pull_cache", dst, id_key(own.cluster_id, src.cache_id, 1))


async def _err_not_remote_accessible_key(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (2, 64), mem="register", remote_accessible=False, seed=2,
                        keys=[[own.cluster_id, 1200]])
    dst = await req.new_cache(2, (2, 64), seed=1)
    return dst, req.transfer("pull_cache", dst, req_key(own.cluster_id, 1200))


async def _err_not_remote_accessible_blocks(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (4, 64), mem="register", blocks=True, model_id=8, remote_accessible=False, seed=2)
    dst = await req.new_cache(2, (4, 64), blocks=True, seed=1)
    return dst, req.transfer("pull_blocks", dst, blocks_key(own.cluster_id, 8), src_blocks=[0], dst_blocks=[0])


async def _err_not_remote_accessible_push(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (4, 64), mem="register", blocks=True, model_id=8, remote_accessible=False, seed=2)
    src = await req.new_cache(2, (4, 64), blocks=True, seed=1)
    return src, req.transfer("push_blocks", src, blocks_key(own.cluster_id, 8), src_blocks=[0], dst_blocks=[0])


async def _err_local_block_out_of_range(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (8, 64), blocks=True, model_id=4, seed=2)
    dst = await req.new_cache(2, (4, 64), blocks=True, seed=1)
    return dst, req.transfer("pull_blocks", dst, blocks_key(own.cluster_id, 4), src_blocks=[0, 1], dst_blocks=[3, 4])


async def _err_local_batch_out_of_range(req: Side, own: Side) -> tuple[Any, Any]:
    src = await own.new_cache(2, (2, 64), seed=2)
    dst = await req.new_cache(2, (2, 64), seed=1)
    return dst, req.transfer("pull_cache", dst, id_key(own.cluster_id, src.cache_id, 0), batch_index=2)


async def _err_c2b_too_many_dst_blocks(req: Side, own: Side) -> tuple[Any, Any]:
    src = await own.new_cache(2, (2, 256), seed=2)  # a 256-byte slot fills 4 blocks of 64
    dst = await req.new_cache(2, (8, 64), blocks=True, seed=1)
    return dst, req.transfer("pull_blocks", dst, id_key(own.cluster_id, src.cache_id, 1), dst_blocks=[0, 1, 2, 3, 4])


async def _err_c2b_with_src_blocks(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (2, 64), seed=2, keys=[[own.cluster_id, 1300]])
    dst = await req.new_cache(2, (8, 64), blocks=True, seed=1)
    return dst, req.transfer("pull_blocks", dst, req_key(own.cluster_id, 1300), src_blocks=[0], dst_blocks=[1])


async def _err_duplicate_dst_blocks(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (8, 64), blocks=True, model_id=4, seed=2)
    dst = await req.new_cache(2, (8, 64), blocks=True, seed=1)
    return dst, req.transfer("pull_blocks", dst, blocks_key(own.cluster_id, 4), src_blocks=[0, 1], dst_blocks=[2, 2])


async def _err_block_count_mismatch(req: Side, own: Side) -> tuple[Any, Any]:
    await own.new_cache(2, (8, 64), blocks=True, model_id=4, seed=2)
    src = await req.new_cache(2, (8, 64), blocks=True, seed=1)
    return src, req.transfer("push_blocks", src, blocks_key(own.cluster_id, 4), src_blocks=[0, 1], dst_blocks=[2])


TRANSFER_ERRORS: dict[str, tuple[Callable[[Side, Side], Awaitable[tuple[Any, Any]]], LLMStatusCode]] = {
    "unknown-model-id": (_err_unknown_model_id, NOT_EXIST),
    "unknown-model-id-push": (_err_unknown_model_id_push, NOT_EXIST),
    "unknown-cache-id": (_err_unknown_cache_id, NOT_EXIST),
    "unknown-cache-id-push": (_err_unknown_cache_id_push, NOT_EXIST),
    "unknown-cache-id-c2b": (_err_unknown_cache_id_c2b, NOT_EXIST),
    "unknown-key": (_err_unknown_key, NOT_EXIST),
    "remote-block-out-of-range": (_err_remote_block_out_of_range, PARAM_INVALID),
    "remote-block-out-of-range-push": (_err_remote_block_out_of_range_push, PARAM_INVALID),
    "remote-batch-out-of-range": (_err_remote_batch_out_of_range, PARAM_INVALID),
    "remote-batch-out-of-range-push": (_err_remote_batch_out_of_range_push, PARAM_INVALID),
    "block-size-mismatch": (_err_block_size_mismatch, PARAM_INVALID),
    "block-size-mismatch-push": (_err_block_size_mismatch_push, PARAM_INVALID),
    "b2c-pull-blocks-into-contiguous": (_err_b2c_into_contiguous, PARAM_INVALID),
    "b2c-pull-cache-from-blocks": (_err_b2c_pull_cache_from_blocks, PARAM_INVALID),
    "push-cache-into-blocks": (_err_push_cache_into_blocks, PARAM_INVALID),
    "num-tensors-mismatch": (_err_num_tensors_mismatch, PARAM_INVALID),
    "size-too-big": (_err_size_too_big, PARAM_INVALID),
    "layer-range-too-big": (_err_layer_range_too_big, PARAM_INVALID),
    "push-layer-range-too-big": (_err_push_layer_range_too_big, PARAM_INVALID),
    "not-remote-accessible-id": (_err_not_remote_accessible_id, PARAM_INVALID),
    "not-remote-accessible-key": (_err_not_remote_accessible_key, PARAM_INVALID),
    "not-remote-accessible-blocks": (_err_not_remote_accessible_blocks, PARAM_INVALID),
    "not-remote-accessible-push": (_err_not_remote_accessible_push, PARAM_INVALID),
    "local-block-out-of-range": (_err_local_block_out_of_range, PARAM_INVALID),
    "local-batch-out-of-range": (_err_local_batch_out_of_range, PARAM_INVALID),
    "c2b-too-many-dst-blocks": (_err_c2b_too_many_dst_blocks, PARAM_INVALID),
    "c2b-with-src-blocks": (_err_c2b_with_src_blocks, PARAM_INVALID),
    "duplicate-dst-blocks": (_err_duplicate_dst_blocks, PARAM_INVALID),
    "block-count-mismatch": (_err_block_count_mismatch, PARAM_INVALID),
}


@pytest_asyncio.fixture(loop_scope="module")
async def error_world(make_world: MakeWorld) -> World:
    return await make_world(peer_listens=True)


@pytest.mark.parametrize("requester", ["local", "peer"], ids=["local-requests", "peer-requests"])
@pytest.mark.parametrize("case", list(TRANSFER_ERRORS))
async def test_transfer_errors_leave_both_ends_working(error_world: World, requester: str, case: str) -> None:
    w = error_world
    req = w.side(requester)
    own = w.other(req)
    setup, code = TRANSFER_ERRORS[case]
    local_cache, call = await setup(req, own)
    owner_before = {c.cache_id: await own.snapshot(c) for c in own.caches.values()}
    req_before = {c.cache_id: await req.snapshot(c) for c in req.caches.values()}
    await expect_code(call, code)
    # Nothing moved on either end.
    for c in list(own.caches.values()):
        assert_bytes(await own.snapshot(c), owner_before[c.cache_id], f"owner cache {c.cache_id}")
    for c in list(req.caches.values()):
        assert_bytes(await req.snapshot(c), req_before[c.cache_id], f"requester cache {c.cache_id}")
    assert local_cache.cache_id in req.caches
    # Both ends still work, in both directions, and the in-process end holds no lease.
    await w.settled()
    await check_both_ways(w.local, w.peer)
    await w.settled()


@pytest.mark.parametrize("requester", ["local", "peer"], ids=["local-requests", "peer-requests"])
async def test_push_needs_remote_cache_access_enabled(make_world: MakeWorld, requester: str) -> None:
    flag = {"llm.EnableRemoteCacheAccessible": "0"}
    w = await make_world(peer_listens=True, **({"local_options": flag} if requester == "local"
                                               else {"peer_options": flag}))
    req = w.side(requester)
    own = w.other(req)
    dst_c = await own.new_cache(2, (2, 64), seed=91)
    dst_b = await own.new_cache(2, (4, 64), blocks=True, model_id=9, seed=92)
    src_c = await req.new_cache(2, (2, 64), seed=93)
    src_b = await req.new_cache(2, (4, 64), blocks=True, seed=94)
    before_c, before_b = await own.snapshot(dst_c), await own.snapshot(dst_b)
    for call in (req.transfer("push_cache", src_c, id_key(own.cluster_id, dst_c.cache_id, 0)),
                 req.transfer("push_blocks", src_b, blocks_key(own.cluster_id, 9), src_blocks=[0], dst_blocks=[1])):
        with pytest.raises((LLMException, PeerError)) as info:
            await call
        if isinstance(info.value, PeerError):
            assert info.value.kind == "LLMException", info.value
    assert_bytes(await own.snapshot(dst_c), before_c)
    assert_bytes(await own.snapshot(dst_b), before_b)
    # Pulls are still allowed with the flag off, and the other end may still push.
    await check_both_ways(w.local, w.peer)
    req_before = await req.snapshot(src_c)
    await own.transfer("push_cache", dst_c, id_key(req.cluster_id, src_c.cache_id, 1), batch_index=0)
    exp = expected_after(req_before, before_c, [(0, 0), (1, 1)], slot_runs(0, 64, 1, 64))
    assert_changed(req_before, exp)
    assert_bytes(await req.snapshot(src_c), exp)
    await w.settled()


async def test_a_failed_link_reader_drops_its_link_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client link's reader task that fails (a bug: it survives any peer input) drops its link, so a waiting
    pull fails at once with LLM_LINK_FAILED instead of running into sync_kv_timeout; finalize stays quiet (the
    failure was handled) and the other side keeps serving."""
    from aiodatadist.control.channel import Channel
    from aiodatadist.testing import linked_pair

    resolve = Channel.resolve

    def broken(channel: Channel, reply: dict[str, Any]) -> None:  # a reply handed over by the reader
        if channel.name.startswith("2->"):
            raise RuntimeError("a bug in the reader")
        resolve(channel, reply)

    desc = CacheDesc(1, (4, 1024), DataType.DT_UINT8, Placement.HOST)
    async with linked_pair(1, 2, sync_kv_timeout=10_000) as (prompt, decoder):
        prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        dst = decoder.cache_manager.allocate_blocks_cache(desc)
        monkeypatch.setattr(Channel, "resolve", broken)
        started = time.monotonic()
        with pytest.raises(LLMException) as info:
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
        assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert time.monotonic() - started < 5
        assert decoder.links() == []
        monkeypatch.setattr(Channel, "resolve", resolve)
        assert prompt._links is not None and prompt._links.listening is not None
        port = int(prompt._links.listening.rsplit(":", 1)[1])
        code, _ = await decoder.link_clusters([cluster_info(1, port)])  # the server drops its stale end
        assert code == LLMStatusCode.LLM_SUCCESS
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])


@pytest.mark.parametrize("transport", ["auto", "tcp"])
async def test_a_server_on_port_0_tells_its_port(transport: str) -> None:
    """An instance listening on port 0 tells which port it got: ``listen_address`` gives
    the bound address (also after ``switch_role`` listens again), ``links()`` shows the real port, and a client
    linked to it transfers."""
    from aiodatadist import LLMConfig, LLMDataDist
    from aiodatadist.testing import fill_pattern

    desc = CacheDesc(2, (4, 1024), DataType.DT_UINT8, Placement.HOST)
    server_cfg, client_cfg = LLMConfig(), LLMConfig()
    server_cfg.listen_ip_info = "127.0.0.1:0"
    server_cfg.transport = client_cfg.transport = transport
    async with LLMDataDist(LLMRole.PROMPT, 1) as server, LLMDataDist(LLMRole.DECODER, 2) as client:
        await server.init(dict(server_cfg.generate_options()))
        await client.init(dict(client_cfg.generate_options()))
        assert client.listen_address is None
        address = server.listen_address
        assert address is not None and address[0] == "127.0.0.1" and address[1] != 0
        src = server.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        data = fill_pattern(src, 5)
        dst = client.cache_manager.allocate_blocks_cache(desc)
        assert await client.link_clusters([cluster_info(1, address[1])], timeout=5000) == OK
        await client.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0, 2], [1, 3])
        got = dst.tensors
        for t in range(2):
            assert (got[t][1] == data[t][:1024]).all() and (got[t][3] == data[t][2048:3072]).all()
        endpoint = f"tcp://127.0.0.1:{address[1]}"
        assert [link["endpoint"] for link in client.links()] == [endpoint]
        assert [link["endpoint"] for link in server.links()] == [endpoint]
        assert await client.unlink_clusters([cluster_info(1, address[1])]) == OK
        await eventually(lambda: server.links() == [])
        await server.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})  # the same request: kept
        assert server.listen_address == address
        await server.switch_role(LLMRole.DECODER)
        assert server.listen_address is None
        await server.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
        again = server.listen_address
        assert again is not None and again[1] != 0
        assert await client.link_clusters([cluster_info(1, again[1])], timeout=5000) == OK
        assert [link["endpoint"] for link in server.links()] == [f"tcp://127.0.0.1:{again[1]}"]
        await client.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [0])
        assert (dst.tensors[0][0] == data[0][1024:2048]).all()


async def test_unlink_after_a_transfer_on_the_python_tcp_plane_is_acknowledged() -> None:
    """The peer answering our BYE closes its data connections; on the Python TCP plane that end used to reach this
    side before the BYE's reply and drop the link, so ``unlink_clusters`` said LLM_NOTIFY_PROMPT_UNLINK_FAILED
    (4 times in 5 here).  An unlinking link no longer treats the peer's closing as a failure."""
    from aiodatadist import LLMConfig, LLMDataDist
    from aiodatadist.testing import fill_pattern

    desc = CacheDesc(2, (4, 1024), DataType.DT_UINT8, Placement.HOST)
    server_cfg, client_cfg = LLMConfig(), LLMConfig()
    server_cfg.listen_ip_info = "127.0.0.1:0"
    for cfg in (server_cfg, client_cfg):
        cfg.transport = "tcp"
        cfg.net = "python"
    async with LLMDataDist(LLMRole.PROMPT, 1) as server, LLMDataDist(LLMRole.DECODER, 2) as client:
        await server.init(dict(server_cfg.generate_options()))
        await client.init(dict(client_cfg.generate_options()))
        assert server.listen_address is not None
        port = server.listen_address[1]
        src = server.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        data = fill_pattern(src, 9)
        dst = client.cache_manager.allocate_blocks_cache(desc)
        for _ in range(5):
            assert await client.link_clusters([cluster_info(1, port)], timeout=5000) == OK
            await client.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0, 2], [1, 3])
            assert (dst.tensors[1][3] == data[1][2048:3072]).all()
            assert await client.unlink_clusters([cluster_info(1, port)]) == OK
            await eventually(lambda: server.links() == [])
