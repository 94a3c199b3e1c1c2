"""One-sided TCP pushes: after the first push by a key, a push into a published cache goes as WRITE frames that
the owner's I/O threads validate against its cache directory and write, with no BEGIN/END round trip.

Checked between two real processes: the bytes land exactly; a push to a re-keyed cache writes nothing into the
old one and lands in the new one (through the owner again); a push to a released cache fails with
LLM_KV_CACHE_NOT_EXIST; a caller-owned cache goes one-sided too, until it is unregistered.  Checked on two data
planes in one process: refused WRITE frames (stale stamp, wrong cache, outside the cache, between the tensors of
caller memory, withdrawn row) and frames of an unknown transfer write nothing, refused READs send nothing, and the
connection stays in sync.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from helpers.data import fill_pattern, pattern
from helpers.prompt_process import linked_decoder, prompt_process

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMException,
    LLMStatusCode,
    Placement,
)
from aiodatadist.errors import LLMLinkError
from aiodatadist.native import DIR_WORDS, DirWord, native_pool
from aiodatadist.testing import PeerProcess
from aiodatadist.transport.base import PUSH
from aiodatadist.transport.directory import Resolved
from aiodatadist.transport.plane import Transfer
from aiodatadist.transport.tcp.native_connections import NativeConnections
from aiodatadist.transport.tcp.plane import NativeTcpPlane

pytestmark = pytest.mark.skipif(native_pool() is None, reason="needs the native helper")

TENSORS, BLOCKS, BLOCK = 8, 16, 16 << 10
PROMPT, DECODER = 41, 42
S = LLMStatusCode


def _desc() -> CacheDesc:
    return CacheDesc(TENSORS, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.HOST)


class Pair:
    def __init__(self, peer: PeerProcess, dd: LLMDataDist) -> None:
        self.peer, self.dd = peer, dd
        self.one_sided: list[bool] = []

    async def allocate(self) -> int:
        made = await self.peer.call("allocate", blocks=True, num_tensors=TENSORS, shape=[BLOCKS, BLOCK],
                                    blocks_key=[PROMPT, 0])
        await self.peer.call("poison", cache_id=made["cache_id"], value=0)
        return int(made["cache_id"])

    async def block(self, cache_id: int, block: int) -> list[bytes]:
        return [bytes.fromhex(await self.peer.call("read", cache_id=cache_id, tensor=t, offset=block * BLOCK,
                                                   nbytes=BLOCK)) for t in range(TENSORS)]


@pytest.fixture
async def pair(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Pair]:
    async with (prompt_process(PROMPT, "tcp", sync_kv_timeout_ms=10000) as (peer, port),
                linked_decoder(DECODER, PROMPT, port, "tcp", sync_kv_timeout_ms=10000) as dd):
        result = Pair(peer, dd)
        original = NativeTcpPlane.move_published

        async def recorded(self: NativeTcpPlane, transfer: Transfer, resolved: Resolved) -> bool:
            moved = await original(self, transfer, resolved)
            if not transfer.pull:
                result.one_sided.append(moved)
            return moved

        monkeypatch.setattr(NativeTcpPlane, "move_published", recorded)
        yield result


def _expected(seed: int, tensor: int, block: int) -> bytes:
    return pattern(seed, tensor, BLOCKS * BLOCK)[block * BLOCK: (block + 1) * BLOCK].tobytes()


async def test_one_sided_push_lands_byte_exact(pair: Pair) -> None:
    remote = await pair.allocate()
    cache = pair.dd.cache_manager.allocate_blocks_cache(_desc())
    fill_pattern(cache, 7)
    key = BlocksCacheKey(PROMPT, 0)
    await pair.dd.cache_manager.push_blocks(key, cache, [1], [2])  # through the owner: resolves the key
    assert pair.one_sided == []
    await pair.dd.cache_manager.push_blocks(key, cache, [3, 4, 9], [5, 6, 15])
    assert pair.one_sided == [True]
    for src, dst in ((1, 2), (3, 5), (4, 6), (9, 15)):
        assert await pair.block(remote, dst) == [_expected(7, t, src) for t in range(TENSORS)]
    assert await pair.block(remote, 0) == [bytes(BLOCK)] * TENSORS  # nothing else written
    # many at once
    await asyncio.gather(*(pair.dd.cache_manager.push_blocks(key, cache, [b], [b]) for b in range(BLOCKS)))
    assert pair.one_sided == [True] * (BLOCKS + 1)
    for b in range(BLOCKS):
        assert await pair.block(remote, b) == [_expected(7, t, b) for t in range(TENSORS)]


async def test_one_sided_push_cache_by_id(pair: Pair) -> None:
    made = await pair.peer.call("allocate", num_tensors=TENSORS, shape=[2, BLOCK])
    remote = int(made["cache_id"])
    cache = pair.dd.cache_manager.allocate_cache(CacheDesc(TENSORS, (2, BLOCK), DataType.DT_UINT8, Placement.HOST))
    fill_pattern(cache, 3)
    for batch in (0, 1, 1):
        await pair.dd.cache_manager.push_cache(CacheKeyByIdAndIndex(PROMPT, remote, batch), cache, batch)
    assert pair.one_sided == [True]  # the first push by each key resolves it through the owner
    for t in range(TENSORS):
        got = bytes.fromhex(await pair.peer.call("read", cache_id=remote, tensor=t, offset=0, nbytes=2 * BLOCK))
        assert got == pattern(3, t, 2 * BLOCK).tobytes()


async def test_push_to_a_rekeyed_cache_writes_nothing_into_the_old_one(pair: Pair) -> None:
    old = await pair.allocate()
    cache = pair.dd.cache_manager.allocate_blocks_cache(_desc())
    fill_pattern(cache, 9)
    key = BlocksCacheKey(PROMPT, 0)
    await pair.dd.cache_manager.push_blocks(key, cache, [1], [1])
    before = await pair.peer.call("digest", cache_id=old)
    new = await pair.allocate()  # takes the model id over: the old cache no longer answers to the key
    await pair.dd.cache_manager.push_blocks(key, cache, [3], [4])
    assert pair.one_sided == [False]  # refused by the owner's I/O threads, then through the owner
    assert await pair.peer.call("digest", cache_id=old) == before
    assert await pair.block(new, 4) == [_expected(9, t, 3) for t in range(TENSORS)]


async def test_push_to_a_released_cache_fails_and_writes_nothing(pair: Pair) -> None:
    remote = await pair.allocate()
    cache = pair.dd.cache_manager.allocate_blocks_cache(_desc())
    fill_pattern(cache, 5)
    key = BlocksCacheKey(PROMPT, 0)
    await pair.dd.cache_manager.push_blocks(key, cache, [1], [1])
    await pair.peer.call("release", cache_id=remote)
    with pytest.raises(LLMException) as caught:
        await pair.dd.cache_manager.push_blocks(key, cache, [2], [2])
    assert caught.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    # Either the owner's FREED reached this end first (the push then asked the owner, no one-sided attempt), or the
    # one-sided write went out and the owner's threads refused the stale row (``test_refused_writes_write_nothing``
    # covers that refusal deterministically); a one-sided write that was taken would show as True.
    assert pair.one_sided in ([], [False])
    # the owner is alive and the link moves data
    other = await pair.allocate()
    await pair.dd.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), cache, [6], [7])
    assert await pair.block(other, 7) == [_expected(5, t, 6) for t in range(TENSORS)]


@pytest.mark.parametrize("where", ["host_memory", "in_place", "own"])
async def test_caller_owned_cache_goes_one_sided_until_unregistered(pair: Pair, where: str) -> None:
    """Memory the owner registered (inside a HostMemory, shared in place, or its own numpy arrays) takes one-sided
    writes after the first push (its directory row names its tensors); once the owner unregistered it (which
    returns only when no write lands any more), a push fails with LLM_KV_CACHE_NOT_EXIST and the link goes on."""
    made = await pair.peer.call("register", blocks=True, num_tensors=TENSORS, shape=[BLOCKS, BLOCK],
                                blocks_key=[PROMPT, 0], **{where: True} if where != "own" else {})
    remote = int(made["cache_id"])
    cache = pair.dd.cache_manager.allocate_blocks_cache(_desc())
    fill_pattern(cache, 4)
    key = BlocksCacheKey(PROMPT, 0)
    for b in range(3):
        await pair.dd.cache_manager.push_blocks(key, cache, [b], [b])
    assert pair.one_sided == [True, True]  # the first push resolved the key through the owner
    for b in range(3):
        assert await pair.block(remote, b) == [_expected(4, t, b) for t in range(TENSORS)]
    assert await pair.block(remote, 3) == [bytes(BLOCK)] * TENSORS
    await pair.peer.call("release", cache_id=remote)
    with pytest.raises(LLMException) as caught:
        await pair.dd.cache_manager.push_blocks(key, cache, [5], [5])
    assert caught.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    other = await pair.allocate()
    await pair.dd.cache_manager.push_blocks(key, cache, [6], [7])
    assert await pair.block(other, 7) == [_expected(4, t, 6) for t in range(TENSORS)]


# -- two data planes in this process, connected over loopback TCP ------------------------------------------------

class Planes:
    def __init__(self, owner: NativeConnections, requester: NativeConnections, words: np.ndarray,
                 target: np.ndarray) -> None:
        self.owner, self.requester, self.words, self.target = owner, requester, words, target
        self.stamp = secrets.randbits(62) + 1
        row = words[:DIR_WORDS]
        row[DirWord.CACHE], row[DirWord.MODEL] = 7, 3
        row[DirWord.BASE], row[DirWord.SIZE] = target.ctypes.data, target.nbytes
        row[DirWord.STAMP] = self.stamp

    def write(self, data: np.ndarray, offset: int, *, stamp: int | None = None, cache_id: int = 7,
              model: int | None = 3, at: int | None = None) -> Any:
        base = self.target.ctypes.data if at is None else at
        zero = np.zeros(1, dtype=np.uint64)  # one run at offset 0 of one "tensor" on each side
        return self.requester.write(secrets.randbits(62), 0, self.stamp if stamp is None else stamp, cache_id, model,
                                    (np.array([base + offset], dtype=np.uint64), zero),
                                    np.array([data.nbytes], dtype=np.uint64),
                                    (np.array([data.ctypes.data], dtype=np.uint64), zero))


@pytest.fixture
async def planes() -> AsyncIterator[Planes]:
    loop = asyncio.get_running_loop()
    words = np.zeros(4 * DIR_WORDS, dtype=np.int64)
    target = np.zeros(1 << 20, dtype=np.uint8)

    def broken(_: LLMException) -> None:
        pass

    owner = NativeConnections("owner", loop, broken, (words.ctypes.data, 4))
    requester = NativeConnections("requester", loop, broken, None)
    with socket.create_server(("127.0.0.1", 0)) as server:
        for _ in range(2):
            client = socket.create_connection(server.getsockname())
            accepted, _ = server.accept()
            requester.attach(client)
            owner.attach(accepted)
    try:
        yield Planes(owner, requester, words, target)
    finally:
        error = LLMLinkError("test over")
        await requester.aclose(error)
        await owner.aclose(error)


async def test_refused_writes_write_nothing(planes: Planes) -> None:
    data = np.full(300 << 10, 0x5A, dtype=np.uint8)
    req = planes.requester
    await req.wait(planes.write(data, 4096))
    assert (planes.target[4096: 4096 + data.nbytes] == 0x5A).all()
    planes.target[:] = 0
    refusals: list[tuple[dict[str, Any], LLMStatusCode]] = [
        ({"stamp": planes.stamp + 1}, S.LLM_KV_CACHE_NOT_EXIST),  # another stamp
        ({"cache_id": 8}, S.LLM_KV_CACHE_NOT_EXIST),  # another cache
        ({"model": 4}, S.LLM_KV_CACHE_NOT_EXIST),  # re-keyed
        ({"at": planes.target.ctypes.data + planes.target.nbytes - 4096}, S.LLM_PARAM_INVALID),  # past its end
        ({"at": planes.target.ctypes.data - (1 << 20)}, S.LLM_PARAM_INVALID),  # before it
    ]
    for kwargs, code in refusals:
        with pytest.raises(LLMException) as caught:
            await req.wait(planes.write(data, 0, **kwargs))
        assert caught.value.status_code == code, kwargs
        assert not planes.target.any(), kwargs
    # frames of a transfer nobody receives are dropped, and the connections stay in sync
    plain = req.send(PUSH, secrets.randbits(62), (np.array([data.ctypes.data], dtype=np.uint64),
                                                  np.zeros(1, dtype=np.uint64)), np.array([data.nbytes], dtype=np.uint64))
    await req.wait(plain)
    # a fence of a transfer the owner never saw is acknowledged
    await req.wait(req.fence(PUSH, secrets.randbits(62)))
    assert not planes.target.any()
    # a withdrawn row (the cache was released) takes nothing any more
    lib = native_pool()
    assert lib is not None
    assert lib.adt_dir_withdraw(planes.words.ctypes.data, 0, 1000) == 0
    with pytest.raises(LLMException) as caught:
        await req.wait(planes.write(data, 0))
    assert caught.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    assert not planes.target.any()
    assert req.closed is None and planes.owner.closed is None
    accepted, nbytes, refused = planes.owner.served_writes()  # counted per WRITE frame by the owner's threads
    assert nbytes == data.nbytes and accepted >= 1 and refused >= 6


async def test_a_row_of_caller_memory_reaches_its_tensors_and_nothing_between(planes: Planes) -> None:
    """A directory row of memory the caller allocated names each tensor (a table of their starts, all of one size):
    WRITE spans inside a tensor, or running on into a tensor that starts right where it ends, land; spans that
    reach between tensors, before the first or past the last are refused and write nothing; a READ must name
    tensor starts and stay within a tensor's size, else it is refused and sends nothing."""
    size = 64 << 10
    target = planes.target
    at = target.ctypes.data
    starts = np.array([at, at + size, at + 4 * size, at + 8 * size], dtype=np.uint64)  # 0-1 touch, then gaps
    table = starts.copy()
    row = planes.words[:DIR_WORDS]
    row[DirWord.STAMP] = 0
    row[DirWord.BASE], row[DirWord.SIZE] = 0, size
    row[DirWord.TABLE], row[DirWord.TENSORS] = table.ctypes.data, len(table)
    row[DirWord.STAMP] = planes.stamp
    req = planes.requester
    data = np.random.default_rng(3).integers(1, 256, 3 * size, dtype=np.uint8)
    landed = [(0, size // 2), (size // 2, size), (4 * size + 100, 1000), (8 * size, size)]  # offset, bytes
    for offset, n in landed:
        await req.wait(planes.write(data[:n], offset, at=at))
        assert np.array_equal(target[offset:offset + n], data[:n]), offset
    expected = target.copy()
    refused = [(size + size // 2, size),  # runs past tensor 1 into the gap
               (2 * size, 10),  # in the gap
               (4 * size - 1, 2),  # from the gap into tensor 2
               (8 * size + size - 4, 8)]  # past the last tensor
    for offset, n in refused:
        with pytest.raises(LLMException) as caught:
            await req.wait(planes.write(data[:n], offset, at=at))
        assert caught.value.status_code == S.LLM_PARAM_INVALID, offset
        assert np.array_equal(target, expected), offset
    with pytest.raises(LLMException) as caught:  # before the first tensor
        await req.wait(planes.write(data[:8], 0, at=at - 4))
    assert caught.value.status_code == S.LLM_PARAM_INVALID
    assert np.array_equal(target, expected)

    async def read(bases: list[int], offset: int, n: int) -> np.ndarray:
        into = np.zeros(max(n, 1), dtype=np.uint8)
        zero = np.zeros(1, dtype=np.uint64)
        job = req.read(secrets.randbits(62), 0, planes.stamp, 7, 3, (np.array(bases, dtype=np.uint64),
                       np.array([offset], dtype=np.uint64)), np.array([n], dtype=np.uint64),
                       (np.full(len(bases), into.ctypes.data, dtype=np.uint64), zero))
        await req.wait(job)
        return into

    got = await read([int(starts[2])], 100, 1000)
    assert np.array_equal(got, target[4 * size + 100:4 * size + 1100])
    for bases, offset, n in [([int(starts[0]) + 64], 0, 64),  # not a tensor's start
                             ([int(starts[1])], size - 8, 16),  # past the tensor's size
                             ([at + 2 * size], 0, 64),  # a gap
                             ([int(starts[0]), at + 5 * size], 0, 64)]:  # one good base, one in a gap
        with pytest.raises(LLMException) as caught:
            await read(bases, offset, n)
        assert caught.value.status_code == S.LLM_PARAM_INVALID, bases
    assert req.closed is None and planes.owner.closed is None


def test_a_withdrawal_held_up_by_a_frame_is_bounded_and_retires_the_row(caplog: pytest.LogCaptureFixture) -> None:
    """A row some I/O thread still holds (a frame of a peer that stalled mid-frame) is withdrawn within the bound:
    its stamp is cleared at once, the call gives up after the bound with an error logged, and the row (with its
    table) is never published again; a row nobody holds is withdrawn at once and reused."""
    import time

    from aiodatadist.registry.publication import CacheDirectory

    lib = native_pool()
    assert lib is not None
    words = np.zeros(2 * DIR_WORDS, dtype=np.int64)
    words[DirWord.STAMP], words[DirWord.BUSY] = 5, 1
    started = time.monotonic()
    assert lib.adt_dir_withdraw(words.ctypes.data, 0, 50) == 1
    assert 0.04 < time.monotonic() - started < 5.0 and words[DirWord.STAMP] == 0  # its 50 ms, then withdrawn
    words[DirWord.BUSY] = 0
    assert lib.adt_dir_withdraw(words.ctypes.data, 0, 50) == 0

    directory = CacheDirectory(rows=2)
    try:
        tensors = np.array([1 << 20, 2 << 20], dtype=np.uint64)
        published = directory.publish(7, -1, 0, 4096, tensors=tensors)
        assert published is not None
        row, _ = published
        rows = directory._words.reshape(-1, DIR_WORDS)
        rows[row, DirWord.BUSY] = 1  # an I/O thread in the row
        from aiodatadist.registry import publication
        bound, publication.WITHDRAW_BOUND_MS = publication.WITHDRAW_BOUND_MS, 20
        try:
            with caplog.at_level("ERROR", logger="aiodatadist.cache"):
                directory.withdraw(row)
        finally:
            publication.WITHDRAW_BOUND_MS = bound
        assert "did not stop within 20 ms" in caplog.text
        assert rows[row, DirWord.STAMP] == 0 and rows[row, DirWord.TABLE] != 0  # its table stays alive
        other = directory.publish(8)
        assert other is not None and other[0] != row
        assert directory.publish(9) is None  # the held row is not handed out again
        directory.withdraw(other[0])  # nobody holds it: at once, and free again
        assert directory.publish(10) is not None
    finally:
        directory.close()
