"""Pulls and pushes between two real processes linked over ZeroMQ on 127.0.0.1, checked byte for byte.

One peer process per module runs the remote ``LLMDataDist`` (``aiodatadist.testing._agent``); the other end lives in
the test's event loop.  Every test runs in both topologies (the peer is the server / the peer is the client) and,
where it matters, with either end as the requester, so "either side may pull or push" is covered for servers
pulling from their clients as well.  Caches hold random non-zero pattern bytes on both ends; expected contents are
computed with plain numpy from snapshots taken before the transfer, and every byte the transfer must not touch is
compared too (on both ends).  After each test the in-process end must hold no lease and no copy job for the link.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence

import numpy as np
import pytest
import pytest_asyncio
from helpers.data import pattern
from helpers.marks import NIXL
from helpers.world import (
    U64_MAX,
    PeerSide,
    Side,
    World,
    assert_bytes,
    assert_changed,
    block_runs,
    blocks_key,
    c2b_runs_expected,
    expect_code,
    expected_after,
    id_key,
    prefix_key,
    req_key,
    slot_runs,
    start_peer,
)

from aiodatadist import LLMStatusCode

pytestmark = pytest.mark.asyncio(loop_scope="module")

S = LLMStatusCode
NOT_EXIST = S.LLM_KV_CACHE_NOT_EXIST
PARAM_INVALID = S.LLM_PARAM_INVALID
MEMS = [("allocate", "allocate"), ("allocate", "register"), ("register", "allocate"), ("register", "register")]
MEM_IDS = ["own-alloc-req-alloc", "own-alloc-req-reg", "own-reg-req-alloc", "own-reg-req-reg"]


# -- fixtures ------------------------------------------------------------------------------------------------

@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def peer_side() -> AsyncIterator[PeerSide]:
    peer = await start_peer()
    try:
        yield peer
    finally:
        await peer.proc.close()


@pytest_asyncio.fixture(loop_scope="module", scope="module",
                        params=["peer-server-shm", "peer-client-shm", "peer-server-tcp", "peer-client-tcp",
                                pytest.param("peer-server-nixl", marks=NIXL)])
async def world(request: pytest.FixtureRequest, peer_side: PeerSide) -> AsyncIterator[World]:
    """Both topologies, on the same-host plane and the TCP plane, and the NIXL plane (forced by the peer; one
    topology: the plane is the same whoever linked, and both ends request in each test)."""
    topology, transport = request.param.rsplit("-", 1)
    w = await World.create(peer_side, peer_listens=topology == "peer-server",
                           peer_options={"llm.Transport": transport})
    assert (await w.peer.links())[0]["plane"] == transport
    try:
        yield w
    finally:
        await w.close()


@pytest_asyncio.fixture(loop_scope="module")
async def w(world: World) -> AsyncIterator[World]:
    await world.ensure_linked()
    try:
        yield world
    finally:
        await world.cleanup()


@pytest.fixture(params=["local", "peer"], ids=["local-requests", "peer-requests"])
def requester(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def ends(w: World, requester: str) -> tuple[Side, Side]:
    """(requester, owner): the requester pulls from / pushes to the owner's cache."""
    req = w.side(requester)
    return req, w.other(req)


def all_tensors(n: int) -> list[tuple[int, int]]:
    return [(t, t) for t in range(n)]


# -- pull_cache (C2C) ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mems", MEMS, ids=MEM_IDS)
async def test_pull_cache_by_req_id_releases_only_that_key(w: World, requester: str,
                                                           mems: tuple[str, str]) -> None:
    req, own = ends(w, requester)
    # Owner: 3 slots of 256 bytes as fp16 [3, 16, 8]; requester: 4 slots of 256 bytes as fp16 [4, 128] (the data
    # types must match, the shapes need not).
    oc = own.cluster_id
    src = await own.new_cache(4, (3, 16, 8), dtype="DT_FLOAT16", mem=mems[0], seed=11,
                              keys=[[oc, 100, 5], [oc, 101, 5], [oc, 102, 5]])
    dst = await req.new_cache(4, (4, 128), dtype="DT_FLOAT16", mem=mems[1], seed=12)
    src_bytes, before = await own.snapshot(src), await req.snapshot(dst)

    # A key with another model_id is a different key.
    await expect_code(req.transfer("pull_cache", dst, req_key(oc, 101, 0), batch_index=3), NOT_EXIST)
    await req.transfer("pull_cache", dst, req_key(oc, 101, 5), batch_index=3)
    exp = expected_after(before, src_bytes, all_tensors(4), slot_runs(1, 256, 3, 256))
    assert_changed(before, exp)
    assert_bytes(await req.snapshot(dst), exp)
    assert_bytes(await own.snapshot(src), src_bytes, "source")

    # The key was released on the owner by the successful pull: pulling it again fails and moves nothing.
    await expect_code(req.transfer("pull_cache", dst, req_key(oc, 101, 5), batch_index=0), NOT_EXIST)
    assert_bytes(await req.snapshot(dst), exp, "destination after the failed pull")

    # ... but only that key: the cache and its other keys are still there.
    await req.transfer("pull_cache", dst, req_key(oc, 102, 5), batch_index=0)
    exp = expected_after(exp, src_bytes, all_tensors(4), slot_runs(2, 256, 0, 256))
    assert_bytes(await req.snapshot(dst), exp)
    await req.transfer("pull_cache", dst, id_key(oc, src.cache_id, 1), batch_index=1)
    exp = expected_after(exp, src_bytes, all_tensors(4), slot_runs(1, 256, 1, 256))
    assert_bytes(await req.snapshot(dst), exp)
    assert_bytes(await own.snapshot(src), src_bytes, "source")
    await w.settled()


async def test_pull_cache_by_prefix_id(w: World, requester: str) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    # Slot 0 is bound to prefix 77 (model 3), slot 1 to request 55, slot 2 is a placeholder.
    src = await own.new_cache(2, (3, 128), seed=21,
                              keys=[[oc, U64_MAX, 3, 77], [oc, 55, 3], [oc, U64_MAX, 0]])
    dst = await req.new_cache(2, (2, 128), seed=22)
    src_bytes, before = await own.snapshot(src), await req.snapshot(dst)

    await expect_code(req.transfer("pull_cache", dst, prefix_key(oc, 77, 0), batch_index=1), NOT_EXIST)
    await expect_code(req.transfer("pull_cache", dst, req_key(oc, 77, 3), batch_index=1), NOT_EXIST)
    assert_bytes(await req.snapshot(dst), before, "destination after failed pulls")

    await req.transfer("pull_cache", dst, prefix_key(oc, 77, 3), batch_index=1)
    exp = expected_after(before, src_bytes, all_tensors(2), slot_runs(0, 128, 1, 128))
    assert_changed(before, exp)
    assert_bytes(await req.snapshot(dst), exp)
    # A pull by CacheKey releases the key, prefix keys included.
    await expect_code(req.transfer("pull_cache", dst, prefix_key(oc, 77, 3), batch_index=0), NOT_EXIST)
    await req.transfer("pull_cache", dst, req_key(oc, 55, 3), batch_index=0)
    exp = expected_after(exp, src_bytes, all_tensors(2), slot_runs(1, 128, 0, 128))
    assert_bytes(await req.snapshot(dst), exp)
    assert_bytes(await own.snapshot(src), src_bytes, "source")
    await w.settled()


@pytest.mark.parametrize("mems", MEMS, ids=MEM_IDS)
async def test_pull_cache_by_id_and_index_releases_nothing(w: World, requester: str,
                                                           mems: tuple[str, str]) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    src = await own.new_cache(3, (4, 96), mem=mems[0], seed=31, keys=[[oc, 300], [oc, 301]])
    dst = await req.new_cache(3, (3, 96), mem=mems[1], seed=32)
    src_bytes, before = await own.snapshot(src), await req.snapshot(dst)

    exp = before
    for remote_slot, local_slot in [(3, 1), (0, 2), (3, 0)]:  # the same remote slot twice: nothing released
        await req.transfer("pull_cache", dst, id_key(oc, src.cache_id, remote_slot), batch_index=local_slot)
        exp = expected_after(exp, src_bytes, all_tensors(3), slot_runs(remote_slot, 96, local_slot, 96))
        assert_bytes(await req.snapshot(dst), exp)
    assert_changed(before, exp)
    # The keys bound to the cache are still there after pulls by id.
    await req.transfer("pull_cache", dst, req_key(oc, 301), batch_index=2)
    exp = expected_after(exp, src_bytes, all_tensors(3), slot_runs(1, 96, 2, 96))
    assert_bytes(await req.snapshot(dst), exp)
    assert_bytes(await own.snapshot(src), src_bytes, "source")
    await w.settled()


@pytest.mark.parametrize("size", [1, 37, 255])
async def test_pull_cache_size_smaller_than_slot(w: World, requester: str, size: int) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    src = await own.new_cache(2, (2, 256), seed=41, keys=[[oc, 400], [oc, 401]])
    dst = await req.new_cache(2, (3, 256), seed=42)
    src_bytes, before = await own.snapshot(src), await req.snapshot(dst)

    await req.transfer("pull_cache", dst, id_key(oc, src.cache_id, 1), batch_index=2, size=size)
    exp = expected_after(before, src_bytes, all_tensors(2), slot_runs(1, 256, 2, 256, size))
    assert_changed(before, exp)
    assert_bytes(await req.snapshot(dst), exp)
    await req.transfer("pull_cache", dst, req_key(oc, 400), batch_index=0, size=size)
    exp = expected_after(exp, src_bytes, all_tensors(2), slot_runs(0, 256, 0, 256, size))
    assert_bytes(await req.snapshot(dst), exp)
    assert_bytes(await own.snapshot(src), src_bytes, "source")
    await w.settled()


# -- pull_blocks (B2B and C2B) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mems", MEMS, ids=MEM_IDS)
async def test_pull_blocks_b2b_scattered(w: World, requester: str, mems: tuple[str, str]) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    # 64-byte blocks on both ends, with different shapes (the same data type).
    src = await own.new_cache(4, (8, 32), dtype="DT_FLOAT16", mem=mems[0], blocks=True, model_id=7, seed=51)
    dst = await req.new_cache(4, (10, 2, 16), dtype="DT_FLOAT16", mem=mems[1], blocks=True, seed=52)
    src_bytes, before = await own.snapshot(src), await req.snapshot(dst)

    src_blocks, dst_blocks = [5, 0, 3, 4, 7], [1, 9, 2, 3, 0]  # (3, 4) -> (2, 3) is a contiguous run
    await req.transfer("pull_blocks", dst, blocks_key(oc, 7), src_blocks=src_blocks, dst_blocks=dst_blocks)
    exp = expected_after(before, src_bytes, all_tensors(4), block_runs(src_blocks, dst_blocks, 64))
    assert_changed(before, exp)
    assert_bytes(await req.snapshot(dst), exp)
    # Pulling by BlocksCacheKey releases nothing: the same blocks again, into other places.
    await req.transfer("pull_blocks", dst, blocks_key(oc, 7), src_blocks=[5, 6], dst_blocks=[8, 5])
    exp = expected_after(exp, src_bytes, all_tensors(4), block_runs([5, 6], [8, 5], 64))
    assert_bytes(await req.snapshot(dst), exp)
    assert_bytes(await own.snapshot(src), src_bytes, "source")
    await w.settled()


async def test_pull_blocks_model_id_selects_the_remote_cache(w: World, requester: str) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    srcs = {m: await own.new_cache(2, (6, 32), blocks=True, model_id=m, seed=60 + m,
                                   mem="register" if m == 1 else "allocate") for m in (0, 1, 2)}
    src_bytes = {m: await own.snapshot(c) for m, c in srcs.items()}
    dst = await req.new_cache(2, (9, 32), blocks=True, seed=64)
    before = exp = await req.snapshot(dst)
    plan = {2: ([1, 4], [0, 8]), 0: ([1, 4], [3, 4]), 1: ([5, 1, 0], [7, 1, 6])}
    for m, (sb, db) in plan.items():
        await req.transfer("pull_blocks", dst, blocks_key(oc, m), src_blocks=sb, dst_blocks=db)
        exp = expected_after(exp, src_bytes[m], all_tensors(2), block_runs(sb, db, 32))
        assert_bytes(await req.snapshot(dst), exp, f"destination after pulling model_id {m}")
    assert_changed(before, exp)
    for m, c in srcs.items():
        assert_bytes(await own.snapshot(c), src_bytes[m], f"source model_id {m}")
    await w.settled()


@pytest.mark.parametrize("mems", MEMS, ids=MEM_IDS)
@pytest.mark.parametrize("dst_blocks", [[7, 2, 5, 0], [3, 1]], ids=["whole-slot", "slot-prefix"])
@pytest.mark.parametrize("key_kind", ["req", "id"])
async def test_pull_blocks_c2b(w: World, requester: str, mems: tuple[str, str], dst_blocks: list[int],
                               key_kind: str) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    src = await own.new_cache(3, (2, 256), mem=mems[0], seed=71, keys=[[oc, 700], [oc, 701]])
    dst = await req.new_cache(3, (8, 64), mem=mems[1], blocks=True, seed=72)
    src_bytes, before = await own.snapshot(src), await req.snapshot(dst)

    key = req_key(oc, 701) if key_kind == "req" else id_key(oc, src.cache_id, 1)
    await req.transfer("pull_blocks", dst, key, dst_blocks=dst_blocks)
    exp = expected_after(before, src_bytes, all_tensors(3), c2b_runs_expected(1, 256, dst_blocks, 64))
    assert_changed(before, exp)
    assert_bytes(await req.snapshot(dst), exp)
    if key_kind == "req":  # released by the successful pull
        await expect_code(req.transfer("pull_blocks", dst, key, dst_blocks=[6]), NOT_EXIST)
    else:  # nothing released: the slot can be pulled again
        await req.transfer("pull_blocks", dst, key, dst_blocks=[6])
        exp = expected_after(exp, src_bytes, all_tensors(3), c2b_runs_expected(1, 256, [6], 64))
    assert_bytes(await req.snapshot(dst), exp)
    assert_bytes(await own.snapshot(src), src_bytes, "source")
    await w.settled()


async def test_pull_blocks_c2b_slot_not_a_multiple_of_the_block(w: World, requester: str) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    src = await own.new_cache(2, (3, 200), seed=81)  # 200-byte slots -> chunks of 64, 64, 64, 8
    dst = await req.new_cache(2, (6, 64), blocks=True, seed=82)
    src_bytes, before = await own.snapshot(src), await req.snapshot(dst)
    await req.transfer("pull_blocks", dst, id_key(oc, src.cache_id, 2), dst_blocks=[5, 0, 3, 1])
    exp = expected_after(before, src_bytes, all_tensors(2), c2b_runs_expected(2, 200, [5, 0, 3, 1], 64))
    assert_changed(before, exp)
    assert_bytes(await req.snapshot(dst), exp)  # the last 56 bytes of block 1 are untouched
    assert_bytes(await own.snapshot(src), src_bytes, "source")
    await w.settled()


# -- push_cache / push_blocks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mems", MEMS, ids=MEM_IDS)
async def test_push_cache_by_id_and_index(w: World, requester: str, mems: tuple[str, str]) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    dst = await own.new_cache(4, (3, 8, 8), dtype="DT_INT32", mem=mems[0], seed=91, keys=[[oc, 900]])
    src = await req.new_cache(4, (2, 64), dtype="DT_INT32", mem=mems[1], seed=92)
    before, src_bytes = await own.snapshot(dst), await req.snapshot(src)

    await req.transfer("push_cache", src, id_key(oc, dst.cache_id, 2), batch_index=1)
    exp = expected_after(before, src_bytes, all_tensors(4), slot_runs(1, 256, 2, 256))
    assert_changed(before, exp)
    assert_bytes(await own.snapshot(dst), exp)
    await req.transfer("push_cache", src, id_key(oc, dst.cache_id, 0), batch_index=0)
    exp = expected_after(exp, src_bytes, all_tensors(4), slot_runs(0, 256, 0, 256))
    assert_bytes(await own.snapshot(dst), exp)
    assert_bytes(await req.snapshot(src), src_bytes, "source")
    # Pushing by id does not touch the owner's keys.
    probe = await req.new_cache(4, (1, 64), dtype="DT_INT32", seed=93)
    await req.transfer("pull_cache", probe, req_key(oc, 900), batch_index=0)
    assert_bytes(await req.snapshot(probe), [t[:256] for t in exp], "slot 0 pulled back by its key")
    await w.settled()


@pytest.mark.parametrize("mems", MEMS, ids=MEM_IDS)
async def test_push_blocks(w: World, requester: str, mems: tuple[str, str]) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    dst = await own.new_cache(2, (8, 24), dtype="DT_INT16", mem=mems[0], blocks=True, model_id=11, seed=101)
    src = await req.new_cache(2, (6, 24), dtype="DT_INT16", mem=mems[1], blocks=True, seed=102)
    before, src_bytes = await own.snapshot(dst), await req.snapshot(src)

    src_blocks, dst_blocks = [0, 5, 2, 3], [7, 3, 4, 5]
    await req.transfer("push_blocks", src, blocks_key(oc, 11), src_blocks=src_blocks, dst_blocks=dst_blocks)
    exp = expected_after(before, src_bytes, all_tensors(2), block_runs(src_blocks, dst_blocks, 48))
    assert_changed(before, exp)
    assert_bytes(await own.snapshot(dst), exp)
    assert_bytes(await req.snapshot(src), src_bytes, "source")
    await w.settled()


# -- layer ranges ------------------------------------------------------------------------------------------

# (n, mode) -> (source tensors, destination tensors, src_layer_range, dst_layer_range)
PULL_RANGES = {
    (1, "src"): (8, 4, (2, 6), None),
    (2, "src"): (8, 4, (1, 3), None),
    (4, "src"): (8, 4, (1, 2), None),
    (1, "dst"): (4, 8, None, (3, 7)),
    (2, "dst"): (4, 8, None, (1, 3)),
    (4, "dst"): (4, 8, None, (1, 2)),
    (1, "both"): (8, 8, (1, 4), (4, 7)),
    (2, "both"): (8, 8, (0, 2), (2, 4)),
    (4, "both"): (8, 8, (1, 2), (0, 1)),
}


def layer_pairs(n: int, src_range: Sequence[int] | None, dst_range: Sequence[int] | None,
                dst_tensors: int) -> list[tuple[int, int]]:
    """Tensor pairs of a pull as in LLM-DataDist: layer L = tensors [L*n, (L+1)*n); only a source range:
    it fills the whole destination; only a destination range: source tensors from 0."""
    if src_range is not None and dst_range is not None:
        s = range(src_range[0] * n, src_range[1] * n)
        d = range(dst_range[0] * n, dst_range[1] * n)
    elif src_range is not None:
        s = range(src_range[0] * n, src_range[1] * n)
        d = range(dst_tensors)
    else:
        assert dst_range is not None
        d = range(dst_range[0] * n, dst_range[1] * n)
        s = range(len(d))
    assert len(s) == len(d)
    return list(zip(s, d))


@pytest.mark.parametrize("api", ["cache", "blocks"])
@pytest.mark.parametrize("n,mode", list(PULL_RANGES), ids=[f"n{n}-{m}" for n, m in PULL_RANGES])
async def test_pull_layer_ranges(w: World, requester: str, api: str, n: int, mode: str) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    src_nt, dst_nt, src_range, dst_range = PULL_RANGES[(n, mode)]
    kw = {"tensor_num_per_layer": n, "src_layer_range": src_range, "dst_layer_range": dst_range}
    pairs = layer_pairs(n, src_range, dst_range, dst_nt)
    if api == "cache":
        src = await own.new_cache(src_nt, (2, 40), seed=111, mem="register", keys=[[oc, 1100], [oc, 1101]])
        dst = await req.new_cache(dst_nt, (3, 40), seed=112)
        src_bytes, before = await own.snapshot(src), await req.snapshot(dst)
        await req.transfer("pull_cache", dst, req_key(oc, 1101), batch_index=2, **kw)
        runs = slot_runs(1, 40, 2, 40)
    else:
        src = await own.new_cache(src_nt, (5, 16), blocks=True, model_id=21, seed=113)
        dst = await req.new_cache(dst_nt, (6, 16), blocks=True, mem="register", seed=114)
        src_bytes, before = await own.snapshot(src), await req.snapshot(dst)
        await req.transfer("pull_blocks", dst, blocks_key(oc, 21), src_blocks=[4, 0, 1], dst_blocks=[1, 5, 2], **kw)
        runs = block_runs([4, 0, 1], [1, 5, 2], 16)
    exp = expected_after(before, src_bytes, pairs, runs)
    assert_changed(before, exp)
    assert_bytes(await req.snapshot(dst), exp)  # tensors outside the range are untouched
    assert_bytes(await own.snapshot(src), src_bytes, "source")
    await w.settled()


# n -> (src_layer_range, dst_layer_range); both caches have 8 tensors
PUSH_RANGES = {1: ((2, 5), (0, 3)), 2: ((1, 3), (2, 4)), 4: ((0, 1), (1, 2))}


@pytest.mark.parametrize("api", ["cache", "blocks"])
@pytest.mark.parametrize("n", list(PUSH_RANGES))
async def test_push_layer_ranges(w: World, requester: str, api: str, n: int) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    src_range, dst_range = PUSH_RANGES[n]
    kw = {"tensor_num_per_layer": n, "src_layer_range": src_range, "dst_layer_range": dst_range}
    pairs = layer_pairs(n, src_range, dst_range, 8)
    if api == "cache":
        dst = await own.new_cache(8, (3, 24), seed=121)
        src = await req.new_cache(8, (2, 24), seed=122, mem="register")
        before, src_bytes = await own.snapshot(dst), await req.snapshot(src)
        await req.transfer("push_cache", src, id_key(oc, dst.cache_id, 2), batch_index=1, **kw)
        runs = slot_runs(1, 24, 2, 24)
    else:
        dst = await own.new_cache(8, (5, 16), blocks=True, model_id=22, seed=123, mem="register")
        src = await req.new_cache(8, (4, 16), blocks=True, seed=124)
        before, src_bytes = await own.snapshot(dst), await req.snapshot(src)
        await req.transfer("push_blocks", src, blocks_key(oc, 22), src_blocks=[3, 0], dst_blocks=[0, 4], **kw)
        runs = block_runs([3, 0], [0, 4], 16)
    exp = expected_after(before, src_bytes, pairs, runs)
    assert_changed(before, exp)
    assert_bytes(await own.snapshot(dst), exp)
    assert_bytes(await req.snapshot(src), src_bytes, "source")
    await w.settled()


@pytest.mark.parametrize("api", ["cache", "blocks"])
async def test_pull_empty_layer_ranges_mean_all_layers(w: World, requester: str, api: str) -> None:
    """An empty range (``range(0, 0)``) selects nothing and therefore means "all", as in LLM-DataDist."""
    req, own = ends(w, requester)
    oc = own.cluster_id
    kw = {"tensor_num_per_layer": 2, "src_layer_range": [0, 0], "dst_layer_range": [0, 0]}
    if api == "cache":
        src = await own.new_cache(4, (2, 32), seed=191)
        dst = await req.new_cache(4, (2, 32), seed=192)
        src_bytes, before = await own.snapshot(src), await req.snapshot(dst)
        await req.transfer("pull_cache", dst, id_key(oc, src.cache_id, 0), batch_index=1, **kw)
        runs = slot_runs(0, 32, 1, 32)
    else:
        src = await own.new_cache(4, (3, 32), blocks=True, model_id=61, seed=193)
        dst = await req.new_cache(4, (3, 32), blocks=True, seed=194)
        src_bytes, before = await own.snapshot(src), await req.snapshot(dst)
        await req.transfer("pull_blocks", dst, blocks_key(oc, 61), src_blocks=[2], dst_blocks=[0], **kw)
        runs = block_runs([2], [0], 32)
    exp = expected_after(before, src_bytes, all_tensors(4), runs)
    assert_changed(before, exp)
    assert_bytes(await req.snapshot(dst), exp)
    await w.settled()


# -- lifetime of remote caches and keys ----------------------------------------------------------------------

async def test_caches_created_after_the_link_are_visible(w: World, requester: str) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    dst = await req.new_cache(2, (4, 32), blocks=True, seed=131)
    slots = await req.new_cache(2, (1, 32), seed=132)
    before = await req.snapshot(dst)
    await expect_code(req.transfer("pull_blocks", dst, blocks_key(oc, 31), src_blocks=[0], dst_blocks=[0]),
                      NOT_EXIST)
    await expect_code(req.transfer("pull_cache", slots, req_key(oc, 1300)), NOT_EXIST)
    assert_bytes(await req.snapshot(dst), before, "destination after failed pulls")

    first = await own.new_cache(2, (4, 32), blocks=True, model_id=31, seed=133)
    keyed = await own.new_cache(2, (2, 32), keys=[[oc, 1301], [oc, 1300]], seed=134)
    first_bytes, keyed_bytes = await own.snapshot(first), await own.snapshot(keyed)
    await req.transfer("pull_blocks", dst, blocks_key(oc, 31), src_blocks=[2], dst_blocks=[0])
    exp = expected_after(before, first_bytes, all_tensors(2), block_runs([2], [0], 32))
    assert_bytes(await req.snapshot(dst), exp)
    await req.transfer("pull_cache", slots, req_key(oc, 1300))
    assert_bytes(await req.snapshot(slots), [t[32:64] for t in keyed_bytes])

    # A second blocks cache with the same model_id replaces the first in the index (last wins).
    second = await own.new_cache(2, (4, 32), blocks=True, model_id=31, seed=135, mem="register")
    second_bytes = await own.snapshot(second)
    await req.transfer("pull_blocks", dst, blocks_key(oc, 31), src_blocks=[2], dst_blocks=[1])
    exp = expected_after(exp, second_bytes, all_tensors(2), block_runs([2], [1], 32))
    assert_bytes(await req.snapshot(dst), exp)
    await w.settled()


@pytest.mark.parametrize("mem", ["allocate", "register"])
async def test_released_caches_are_gone_for_peers(w: World, requester: str, mem: str) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    cont = await own.new_cache(2, (2, 64), mem=mem, seed=141)
    blk = await own.new_cache(2, (4, 64), mem=mem, blocks=True, model_id=41, seed=142)
    dst_c = await req.new_cache(2, (2, 64), seed=143)
    dst_b = await req.new_cache(2, (4, 64), blocks=True, seed=144)
    # Both are reachable before the release ...
    await req.transfer("pull_cache", dst_c, id_key(oc, cont.cache_id, 1))
    await req.transfer("pull_blocks", dst_b, blocks_key(oc, 41), src_blocks=[1], dst_blocks=[1])
    await req.transfer("push_cache", dst_c, id_key(oc, cont.cache_id, 0))
    before_c, before_b = await req.snapshot(dst_c), await req.snapshot(dst_b)

    await own.release(cont, "unregister" if mem == "register" else None)
    await own.release(blk, "unregister" if mem == "register" else None)
    # ... and gone for every kind of access afterwards, without touching the destination.
    await expect_code(req.transfer("pull_cache", dst_c, id_key(oc, cont.cache_id, 1)), NOT_EXIST)
    await expect_code(req.transfer("pull_blocks", dst_b, id_key(oc, cont.cache_id, 0), dst_blocks=[0]), NOT_EXIST)
    await expect_code(req.transfer("push_cache", dst_c, id_key(oc, cont.cache_id, 0)), NOT_EXIST)
    await expect_code(req.transfer("pull_blocks", dst_b, blocks_key(oc, 41), src_blocks=[1], dst_blocks=[1]),
                      NOT_EXIST)
    await expect_code(req.transfer("push_blocks", dst_b, blocks_key(oc, 41), src_blocks=[1], dst_blocks=[1]),
                      NOT_EXIST)
    assert_bytes(await req.snapshot(dst_c), before_c)
    assert_bytes(await req.snapshot(dst_b), before_b)
    await w.settled()


async def test_keys_of_a_released_cache(w: World, requester: str) -> None:
    """An allocated cache stays reachable through its bound keys after ``deallocate_cache`` (reference counting,
    as in LLM-DataDist) until the key is pulled or removed; a registered cache loses its keys with
    ``unregister_cache``."""
    req, own = ends(w, requester)
    oc = own.cluster_id
    alloc = await own.new_cache(2, (3, 64), seed=151, keys=[[oc, 1500], [oc, 1501], [oc, 1502]])
    reg = await own.new_cache(2, (1, 64), mem="register", seed=152, keys=[[oc, 1510]])
    alloc_bytes = await own.snapshot(alloc)
    dst = await req.new_cache(2, (2, 64), seed=153)
    before = await req.snapshot(dst)

    await own.release(alloc)
    await own.release(reg, "unregister")
    await expect_code(req.transfer("pull_cache", dst, id_key(oc, alloc.cache_id, 0)), NOT_EXIST)
    await expect_code(req.transfer("pull_cache", dst, req_key(oc, 1510)), NOT_EXIST)
    assert_bytes(await req.snapshot(dst), before)

    await req.transfer("pull_cache", dst, req_key(oc, 1501), batch_index=1)
    exp = expected_after(before, alloc_bytes, all_tensors(2), slot_runs(1, 64, 1, 64))
    assert_changed(before, exp)
    assert_bytes(await req.snapshot(dst), exp)
    await expect_code(req.transfer("pull_cache", dst, req_key(oc, 1501)), NOT_EXIST)
    await own.remove_key([oc, 1502])
    await expect_code(req.transfer("pull_cache", dst, req_key(oc, 1502)), NOT_EXIST)
    await req.transfer("pull_cache", dst, req_key(oc, 1500), batch_index=0)
    exp = expected_after(exp, alloc_bytes, all_tensors(2), slot_runs(0, 64, 0, 64))
    assert_bytes(await req.snapshot(dst), exp)
    await w.settled()


async def test_failed_pull_by_cache_key_keeps_the_key(w: World, requester: str) -> None:
    req, own = ends(w, requester)
    oc = own.cluster_id
    src = await own.new_cache(2, (2, 64), seed=161, keys=[[oc, 1600], [oc, 1601]])
    src_bytes = await own.snapshot(src)
    small = await req.new_cache(2, (2, 32), seed=162)
    dst = await req.new_cache(2, (2, 64), seed=163)
    before_small, before = await req.snapshot(small), await req.snapshot(dst)
    # Slot size mismatch (64 -> 32 with size=-1 is fine, size=64 is not), a bad layer range, a too big size.
    await expect_code(req.transfer("pull_cache", small, req_key(oc, 1601), size=64), PARAM_INVALID)
    await expect_code(req.transfer("pull_cache", dst, req_key(oc, 1601), src_layer_range=[1, 3],
                                   tensor_num_per_layer=1), PARAM_INVALID)
    await expect_code(req.transfer("pull_cache", dst, req_key(oc, 1601), size=65), PARAM_INVALID)
    assert_bytes(await req.snapshot(small), before_small)
    assert_bytes(await req.snapshot(dst), before)
    await req.transfer("pull_cache", dst, req_key(oc, 1601), batch_index=1)
    exp = expected_after(before, src_bytes, all_tensors(2), slot_runs(1, 64, 1, 64))
    assert_bytes(await req.snapshot(dst), exp)
    await w.settled()


async def test_concurrent_pulls_by_one_cache_key_consume_it_once(w: World, requester: str) -> None:
    """A CacheKey is released by the first successful pull, so of several pulls by the same key exactly one
    succeeds; the others get LLM_KV_CACHE_NOT_EXIST (after it) or LLM_REPEAT_REQUEST (while it runs)."""
    req, own = ends(w, requester)
    oc = own.cluster_id
    await own.new_cache(2, (1, 4096), seed=201, keys=[[oc, 2000]])
    dsts = [await req.new_cache(2, (1, 4096), seed=202 + i) for i in range(8)]
    results = await asyncio.gather(*(req.transfer("pull_cache", d, req_key(oc, 2000)) for d in dsts),
                                   return_exceptions=True)
    failures = [r for r in results if r is not None]
    allowed = {NOT_EXIST, LLMStatusCode.LLM_REPEAT_REQUEST}
    assert all(getattr(r, "status_code", None) in allowed for r in failures), failures
    assert len(results) - len(failures) == 1, f"{len(results) - len(failures)} of 8 pulls by one key succeeded"


async def test_a_pull_by_cache_key_has_released_it_when_it_returns(w: World, requester: str) -> None:
    """The owner may bind the key anew the moment the pull returned (no settling first), and a pull by it then
    gets the new cache's bytes; the old cache stays intact and pullable by id."""
    req, own = ends(w, requester)
    oc = own.cluster_id
    dst = await req.new_cache(2, (1, 256), seed=210)
    before = await req.snapshot(dst)
    for round_ in range(5):
        seed = 211 + 2 * round_
        old = await own.new_cache(2, (1, 256), seed=seed, keys=[[oc, 2100]])
        old_bytes = await own.snapshot(old)
        await req.transfer("pull_cache", dst, req_key(oc, 2100))
        exp = expected_after(before, old_bytes, all_tensors(2), slot_runs(0, 256, 0, 256))
        assert_bytes(await req.snapshot(dst), exp)
        new = await own.new_cache(2, (1, 256), seed=seed + 1, keys=[[oc, 2100]])  # the key is free again
        new_bytes = await own.snapshot(new)
        await req.transfer("pull_cache", dst, req_key(oc, 2100))
        assert_bytes(await req.snapshot(dst), expected_after(exp, new_bytes, all_tensors(2), slot_runs(0, 256, 0, 256)))
        await expect_code(req.transfer("pull_cache", dst, req_key(oc, 2100)), NOT_EXIST)
        await req.transfer("pull_cache", dst, id_key(oc, old.cache_id, 0))
        assert_bytes(await req.snapshot(dst), exp, "the first cache, by id")
        assert_bytes(await own.snapshot(old), old_bytes, "the first cache")
        await own.release(old)
        await own.release(new)
    await w.settled()


# -- size and concurrency ------------------------------------------------------------------------------------

async def test_large_transfers_are_byte_exact(w: World, requester: str) -> None:
    """Slots of 4.5 MiB x 2 tensors (above the 8 MiB streaming threshold, many copy chunks), pulled and pushed."""
    req, own = ends(w, requester)
    oc = own.cluster_id
    slot = 9 << 19
    src = await own.new_cache(2, (2, slot), seed=171, mem="register")
    dst = await req.new_cache(2, (2, slot), seed=172)
    src_full = [pattern(171, t, 2 * slot) for t in range(2)]
    dst_full = [pattern(172, t, 2 * slot) for t in range(2)]
    assert await own.digests(src) == [hashlib.sha256(x.tobytes()).hexdigest() for x in src_full]

    await req.transfer("pull_cache", dst, id_key(oc, src.cache_id, 1), batch_index=0)
    exp = expected_after(dst_full, src_full, all_tensors(2), slot_runs(1, slot, 0, slot))
    assert await req.digests(dst) == [hashlib.sha256(x.tobytes()).hexdigest() for x in exp]
    # Push the untouched slot 1 of the requester back into slot 0 of the owner.
    await req.transfer("push_cache", dst, id_key(oc, src.cache_id, 0), batch_index=1)
    exp_src = expected_after(src_full, exp, all_tensors(2), slot_runs(1, slot, 0, slot))
    assert await own.digests(src) == [hashlib.sha256(x.tobytes()).hexdigest() for x in exp_src]
    await w.settled()


async def test_64_concurrent_pull_blocks(w: World, requester: str) -> None:
    """64 requests pulled at once (asyncio.gather), each its own scattered blocks; all byte-exact."""
    req, own = ends(w, requester)
    oc = own.cluster_id
    per_request, block = 4, 1024
    src = await own.new_cache(4, (320, block), blocks=True, model_id=51, seed=181)
    dst = await req.new_cache(4, (300, block), blocks=True, seed=182, mem="register")
    src_bytes, before = await own.snapshot(src), await req.snapshot(dst)
    rng = np.random.default_rng(183)
    src_perm = rng.permutation(320)[:64 * per_request].tolist()
    dst_perm = rng.permutation(300)[:64 * per_request].tolist()
    jobs = [(src_perm[i * per_request:(i + 1) * per_request], dst_perm[i * per_request:(i + 1) * per_request])
            for i in range(64)]
    await asyncio.gather(*(req.transfer("pull_blocks", dst, blocks_key(oc, 51), src_blocks=sb, dst_blocks=db)
                           for sb, db in jobs))
    exp = expected_after(before, src_bytes, all_tensors(4), block_runs(src_perm, dst_perm, block))
    assert_changed(before, exp)
    assert_bytes(await req.snapshot(dst), exp)
    assert_bytes(await own.snapshot(src), src_bytes, "source")
    await w.settled()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
async def test_caches_of_different_data_types_are_refused(transport: str) -> None:
    """bf16 into float16 (equal bytes per block) is refused: every pull and push between caches whose
    data types differ fails with LLM_PARAM_INVALID, on both planes, before a byte moves, whichever side checks
    (the owner from BEGIN's geometry, the requester from a published descriptor); the link keeps working."""
    from aiodatadist import (
        BlocksCacheKey,
        CacheDesc,
        CacheKeyByIdAndIndex,
        DataType,
        LLMConfig,
        LLMException,
        Placement,
    )
    from aiodatadist.testing import fill_pattern, linked_pair

    cfg = LLMConfig()
    cfg.transport = transport
    bf16_blocks = CacheDesc(2, (4, 512), DataType.DT_BF16, Placement.HOST)
    fp16_blocks = CacheDesc(2, (4, 512), DataType.DT_FLOAT16, Placement.HOST)
    bf16_cache = CacheDesc(2, (2, 512), DataType.DT_BF16, Placement.HOST)
    fp16_cache = CacheDesc(2, (2, 512), DataType.DT_FLOAT16, Placement.HOST)
    async with linked_pair(1, 2, config=cfg) as (prompt, decoder):
        owner, requester = prompt.cache_manager, decoder.cache_manager
        remote_blocks = owner.allocate_blocks_cache(bf16_blocks, BlocksCacheKey(1, 0))
        remote_cache = owner.allocate_cache(bf16_cache)
        fill_pattern(remote_blocks, 1)
        fill_pattern(remote_cache, 2)
        local_blocks = requester.allocate_blocks_cache(fp16_blocks)
        local_cache = requester.allocate_cache(fp16_cache)
        fill_pattern(local_blocks, 3)
        fill_pattern(local_cache, 4)
        before = [[t.tobytes() for t in c.tensors] for c in (remote_blocks, remote_cache, local_blocks, local_cache)]
        cache_key = CacheKeyByIdAndIndex(1, remote_cache.cache_id, 0)
        attempts = {
            "pull_blocks": lambda: requester.pull_blocks(BlocksCacheKey(1, 0), local_blocks, [0, 1], [2, 3]),
            "push_blocks": lambda: requester.push_blocks(BlocksCacheKey(1, 0), local_blocks, [0, 1], [2, 3]),
            "pull_cache": lambda: requester.pull_cache(cache_key, local_cache, 1),
            "push_cache": lambda: requester.push_cache(cache_key, local_cache, 1),
            "pull c2b": lambda: requester.pull_blocks(cache_key, local_blocks, [], [0, 1]),
        }
        for _ in range(2):  # the second time the requester may know the owner's descriptor (published caches)
            for name, attempt in attempts.items():
                with pytest.raises(LLMException) as info:
                    await attempt()
                assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, name
                assert "data type" in str(info.value), (name, str(info.value))
        after = [[t.tobytes() for t in c.tensors] for c in (remote_blocks, remote_cache, local_blocks, local_cache)]
        assert before == after
        same = requester.allocate_blocks_cache(bf16_blocks)  # the same data type still goes through
        await requester.pull_blocks(BlocksCacheKey(1, 0), same, [0, 1], [2, 3])
        assert (same.tensors[0][2:] == remote_blocks.tensors[0][:2]).all()
