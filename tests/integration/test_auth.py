"""Authenticated links: a shared key proven both ways before anything is served (real sockets on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from helpers.data import fill_pattern
from helpers.internals import registry_of
from helpers.marks import NIXL

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.protocol import auth
from aiodatadist.protocol.handshake import PROTOCOL_VERSION
from aiodatadist.testing import cluster_info, free_port

S = LLMStatusCode
DESC = CacheDesc(2, (4, 4096), DataType.DT_UINT8, Placement.HOST)


def options(key: str | None, transport: str = "auto", port: int | None = None) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.transport = transport
    if key is not None:
        cfg.auth_key = key
    if port is not None:
        cfg.listen_ip_info = f"127.0.0.1:{port}"
    return dict(cfg.generate_options())


@asynccontextmanager
async def instances(server_key: str | None, client_key: str | None,
                    transport: str = "auto") -> AsyncIterator[tuple[LLMDataDist, LLMDataDist, int]]:
    port = free_port()
    async with LLMDataDist(LLMRole.PROMPT, 1) as server, LLMDataDist(LLMRole.DECODER, 2) as client:
        await server.init(options(server_key, transport, port))
        await client.init(options(client_key, transport))
        yield server, client, port


@pytest.mark.parametrize("transport", ["shm", "tcp", pytest.param("nixl", marks=NIXL)])
async def test_the_same_key_links_and_transfers(transport: str) -> None:
    async with instances("s3cret", "s3cret", transport) as (server, client, port):
        code, codes = await client.link_clusters([cluster_info(1, port)], timeout=3000)
        assert (code, codes) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        src = server.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        data = fill_pattern(src, 5)
        dst = client.cache_manager.allocate_blocks_cache(DESC)
        for _ in range(2):  # the first resolves through the owner, the second is one-sided
            await client.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1, 2], [3, 0])
        for t in range(2):
            got = dst.tensors[t].view(np.uint8).reshape(4, -1)
            want = data[t].reshape(4, -1)
            assert np.array_equal(got[[3, 0]], want[[1, 2]])
        assert client.links()[0]["plane"] == transport
        if transport == "tcp":
            assert client.links()[0]["data_connections"] >= 1


@pytest.mark.parametrize("server_key, client_key", [("s3cret", None), (None, "s3cret"), ("s3cret", "other")],
                         ids=["client-without-key", "server-without-key", "wrong-key"])
async def test_a_missing_or_wrong_key_fails_the_link_on_both_sides(server_key: str | None,
                                                                   client_key: str | None) -> None:
    async with instances(server_key, client_key) as (server, client, port):
        _, codes = await client.link_clusters([cluster_info(1, port)], timeout=3000)
        assert codes == [S.LLM_LINK_FAILED]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10  # a side may let go of its half of the link a moment after the failure
        while client.links() or server.links():
            assert loop.time() < deadline, (client.links(), server.links())
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert client.links() == [] and server.links() == []  # (and none came back)
        # Both ends stay usable: the right configuration links afterwards.
        if server_key is None:
            return
        async with LLMDataDist(LLMRole.DECODER, 3) as good:
            await good.init(options(server_key))
            assert (await good.link_clusters([cluster_info(1, port)], timeout=3000))[0] == S.LLM_SUCCESS


async def _raw_request(sock: zmq.asyncio.Socket, message: dict[str, object]) -> dict[str, object]:
    await sock.send(msgpack.packb(message))
    reply = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 3))
    return reply[0] if isinstance(reply, list) else reply


@pytest.mark.parametrize("transport", ["auto", pytest.param("nixl", marks=NIXL)])
async def test_an_unauthenticated_peer_is_served_nothing(transport: str) -> None:
    """A raw ZeroMQ client that skips or forges the proof gets LLM_LINK_FAILED / LLM_NOT_YET_LINK, and every
    request it sends is refused: the server never resolves a key or starts a transfer for it (on the nixl
    plane: it never gets the NIXL metadata, which only BEGIN replies carry)."""
    async with instances("s3cret", None, transport) as (server, _client, port):
        src = server.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        fill_pattern(src, 7)
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        try:
            hello = {"k": "hello", "i": 1, "v": PROTOCOL_VERSION, "cluster": 9, "to": 1, "role": 0,
                     "transport": "auto", "cn": auth.new_nonce()}
            challenge = await _raw_request(sock, hello)
            assert challenge.get("code") == 0 and isinstance(challenge.get("challenge"), bytes)
            forged = await _raw_request(sock, {**hello, "i": 2, "sn": challenge["challenge"],
                                               "cp": auth.proof(auth.derive_key("guess"), "client", hello["cn"],
                                                                challenge["challenge"], 9, 1)})
            assert forged["code"] == int(S.LLM_LINK_FAILED)
            replayed = await _raw_request(sock, {**hello, "i": 3, "sn": challenge["challenge"], "cp": b"x" * 32})
            assert replayed["code"] == int(S.LLM_LINK_FAILED)  # a challenge is single use
            begin = await _raw_request(sock, {"k": "begin", "i": 4, "tid": 1, "key": ["blocks", 0, 0]})
            assert begin["code"] == int(S.LLM_NOT_YET_LINK)
            assert server.links() == []
            assert all(e.leases == 0 for e in registry_of(server.cache_manager).entries())
        finally:
            sock.close()
            ctx.term()


async def test_data_connections_need_the_derived_token() -> None:
    """On an authenticated TCP link the data-connection token is derived from the handshake, never sent; a
    connection presenting anything else is closed without being attached."""
    async with instances("s3cret", "s3cret", "tcp") as (server, client, port):
        assert (await client.link_clusters([cluster_info(1, port)], timeout=3000))[0] == S.LLM_SUCCESS
        link = server._links.links[2]
        before = link.plane.connections
        listener = server._links._accept.data_listener
        assert listener is not None

        def intrude() -> bytes:  # in a thread: the server runs in this event loop
            with socket.create_connection(("127.0.0.1", listener.getsockname()[1])) as intruder:
                intruder.sendall(b"\xa4\xf4\xd7\xad" + bytes(16))  # the right magic, a wrong token
                intruder.settimeout(3)
                return intruder.recv(1)

        assert await asyncio.to_thread(intrude) == b""  # closed by the server
        assert link.plane.connections == before


async def test_data_frames_and_reads_need_an_agreed_transfer() -> None:
    """Data connections are admitted only as many times as the handshake agreed (the token is then retired), and
    even the linked peer gets nothing the control plane did not agree: DATA frames under guessed transfer ids are
    dropped (a running push still lands byte-exact), and one-sided READs that guess a published cache's stamp are
    refused.  Ids and stamps are random 62-bit numbers, never 1, 2, 3, ... as they were."""
    from aiodatadist.transport.base import PUSH
    from aiodatadist.transport.tcp.frames import DATA_HELLO, MAGIC

    big = CacheDesc(2, (64, 65536), DataType.DT_UINT8, Placement.HOST)  # 8 MiB per push
    async with instances("s3cret", "s3cret", "tcp") as (server, client, port):
        assert (await client.link_clusters([cluster_info(1, port)], timeout=3000))[0] == S.LLM_SUCCESS
        dst = server.cache_manager.allocate_blocks_cache(big, BlocksCacheKey(1, 0))
        src = client.cache_manager.allocate_blocks_cache(big)
        data = fill_pattern(src, 5)
        fill_pattern(dst, 6)
        listener = server._links._accept.data_listener
        assert listener is not None
        server_link = server._links.links[2]
        assert server_link.data_token is not None and server_link.offered is not None
        before = server_link.offered.connections

        def late_connection() -> bytes:
            with socket.create_connection(("127.0.0.1", listener.getsockname()[1])) as sock:
                sock.sendall(DATA_HELLO.pack(MAGIC, server_link.data_token))  # the real token, once too often
                sock.settimeout(3)
                return sock.recv(1)

        assert await asyncio.to_thread(late_connection) == b""
        assert server_link.offered.connections == before

        link = client._links.links[1]
        conns = link.plane.conns  # the TCP plane's data connections
        garbage = client.cache_manager.allocate_blocks_cache(big)
        fill_pattern(garbage, 7)
        grid = (np.array(garbage.tensor_addrs, dtype=np.uint64), np.zeros(1, dtype=np.uint64))  # each whole tensor
        for _ in range(4):
            forged = [conns.send(PUSH, tid, grid, np.array([big.size], dtype=np.uint64)) for tid in range(1, 9)]
            await client.cache_manager.push_blocks(BlocksCacheKey(1, 0), src, list(range(64)), list(range(64)))
            for job in forged:
                await conns.wait(job)
            assert all(np.array_equal(a, b.reshape(-1)) for a, b in zip(data, dst.tensors))

        # Grids as READ names them: tensors' bases and runs' offsets on each side, the runs' lengths.
        local = (np.array([src.tensor_addrs[0]], dtype=np.uint64), np.zeros(1, dtype=np.uint64))
        remote = (np.array([dst.tensor_addrs[0]], dtype=np.uint64), np.zeros(1, dtype=np.uint64))
        lengths = np.array([4096], dtype=np.uint64)
        mine = src.tensors[0].copy()
        for row in range(4):
            for stamp in range(1, 17):
                job = conns.read(10_000 + stamp, row, stamp, dst.cache_id, None, remote, lengths, local)
                with pytest.raises(LLMException) as info:
                    await conns.wait(job)
                assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
        assert np.array_equal(mine, src.tensors[0])
        out = client.cache_manager.allocate_blocks_cache(big)
        await client.cache_manager.pull_blocks(BlocksCacheKey(1, 0), out, [3], [3])  # the link still serves
        assert np.array_equal(out.tensors[1][3], data[1].reshape(64, -1)[3])
