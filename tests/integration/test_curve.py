"""ZeroMQ CURVE on the control plane (``llm.CurveSecretKey`` / ``llm.CurvePeerKeys``; docs/security.md): links
are encrypted and both ends authenticated by key, peers without CURVE or with another key are refused, and a
marker sent on the control plane is readable on the wire without CURVE and never with it (real sockets on
127.0.0.1)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
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
from aiodatadist.control.sockets import ZAP_DOMAIN, ZapHandler
from aiodatadist.protocol.handshake import PROTOCOL_VERSION
from aiodatadist.settings.curve_keys import CurveKeys
from aiodatadist.testing import cluster_info, free_port
from aiodatadist.testing.fault_proxy import FaultProxy

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

S = LLMStatusCode
DESC = CacheDesc(2, (4, 4096), DataType.DT_UINT8, Placement.HOST)
SERVER, CLIENT, OTHER = 1, 2, 3  # cluster ids
FAIL_MS = 1000  # links that cannot complete fail at their timeout: keep it short


def keypair() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


SERVER_KEYS, CLIENT_KEYS, OTHER_KEYS = keypair(), keypair(), keypair()


def options(secret: str | None = None, peers: str | None = None, *, port: int | None = None,
            transport: str = "auto", auth_key: str | None = None) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.transport = transport
    if secret is not None:
        cfg.curve_secret_key = secret
    if peers is not None:
        cfg.curve_peer_keys = peers
    if auth_key is not None:
        cfg.auth_key = auth_key
    if port is not None:
        cfg.listen_ip_info = f"127.0.0.1:{port}"
    return dict(cfg.generate_options())


def server_options(port: int, peers: str | None = f"{CLIENT}={CLIENT_KEYS[0]}", **kw: str) -> dict[str, str]:
    return options(SERVER_KEYS[1] if peers is not None else None, peers, port=port, **kw)


def client_options(peers: str | None = f"{SERVER}={SERVER_KEYS[0]}", **kw: str) -> dict[str, str]:
    return options(CLIENT_KEYS[1] if peers is not None else None, peers, **kw)


@asynccontextmanager
async def pair(server_opts: dict[str, str], client_opts: dict[str, str],
               port: int) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    async with LLMDataDist(LLMRole.PROMPT, SERVER) as server, LLMDataDist(LLMRole.DECODER, CLIENT) as client:
        await server.init(server_opts)
        await client.init(client_opts)
        yield server, client


async def assert_pull(server: LLMDataDist, client: LLMDataDist, seed: int) -> None:
    src = server.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(SERVER, seed))
    data = fill_pattern(src, seed)
    dst = client.cache_manager.allocate_blocks_cache(DESC)
    for _ in range(2):  # the first resolves through the owner, the second may be one-sided
        await client.cache_manager.pull_blocks(BlocksCacheKey(SERVER, seed), dst, [1, 2], [3, 0])
    for t in range(2):
        got = dst.tensors[t].view(np.uint8).reshape(4, -1)
        want = data[t].reshape(4, -1)
        assert np.array_equal(got[[3, 0]], want[[1, 2]])


async def _no_links_left(*instances: LLMDataDist) -> None:
    """No side keeps a link to the other: gone within 10 s (a side may let go a moment after the failure), and
    none is left 0.2 s later."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while any(dd.links() for dd in instances):
        assert loop.time() < deadline, [dd.links() for dd in instances]
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert all(dd.links() == [] for dd in instances)


@pytest.mark.parametrize("auth_key", [None, "s3cret"], ids=["curve", "curve+hmac"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_curve_links_and_transfers_byte_exact(transport: str, auth_key: str | None) -> None:
    port = free_port()
    extra = {"transport": transport} | ({"auth_key": auth_key} if auth_key else {})
    async with pair(server_options(port, **extra), client_options(**extra), port) as (server, client):
        code, codes = await client.link_clusters([cluster_info(SERVER, port)], timeout=3000)
        assert (code, codes) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert client.links()[0]["plane"] == transport
        await assert_pull(server, client, 5)
        # push, notify and the server's own requests (pings) on the same link
        src = client.cache_manager.allocate_blocks_cache(DESC)
        data = fill_pattern(src, 9)
        dst = server.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(SERVER, 77))
        await client.cache_manager.push_blocks(BlocksCacheKey(SERVER, 77), src, [0, 1, 2, 3], [0, 1, 2, 3])
        assert all(np.array_equal(a, b.view(np.uint8).reshape(-1)) for a, b in zip(data, dst.tensors))
        await client.notify(SERVER, b"hello over curve")
        note = await server.get_notification(timeout=10)
        assert note is not None and note.message == b"hello over curve"
        await server.check_link_status(CLIENT)
        await client.check_link_status(SERVER)


async def test_a_shared_key_pair_for_every_instance_links() -> None:
    """The simplest deployment: one key pair for the whole cluster, its public key listed without an id."""
    port = free_port()
    shared = options(SERVER_KEYS[1], SERVER_KEYS[0], port=port)
    async with pair(shared, options(SERVER_KEYS[1], SERVER_KEYS[0]), port) as (server, client):
        assert (await client.link_clusters([cluster_info(SERVER, port)], timeout=3000))[0] == S.LLM_SUCCESS
        await assert_pull(server, client, 3)


async def _linked_to_third(client: LLMDataDist, client_key: str) -> None:
    """``client`` is still usable: it links to another CURVE server (cluster 3) it has the right key for."""
    port = free_port()
    async with LLMDataDist(LLMRole.PROMPT, OTHER) as third:
        await third.init(options(OTHER_KEYS[1], f"{CLIENT}={client_key}", port=port))
        assert (await client.link_clusters([cluster_info(OTHER, port)], timeout=3000))[0] == S.LLM_SUCCESS
        assert [link["remote_cluster_id"] for link in client.links()] == [OTHER]


async def _server_still_admits(port: int) -> None:
    """The server is still usable: a client with the right keys links."""
    async with LLMDataDist(LLMRole.DECODER, CLIENT) as good:
        await good.init(client_options())
        assert (await good.link_clusters([cluster_info(SERVER, port)], timeout=3000))[0] == S.LLM_SUCCESS


@pytest.mark.parametrize("case", ["wrong-server-key", "client-key-not-trusted", "key-bound-to-another-cluster",
                                  "no-key-for-that-cluster"])
async def test_a_wrong_key_fails_the_link_and_both_ends_stay_usable(case: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    server_peers = f"{CLIENT}={CLIENT_KEYS[0]}"
    client_peers = f"{SERVER}={SERVER_KEYS[0]},{OTHER}={OTHER_KEYS[0]}"
    if case == "wrong-server-key":
        client_peers = f"{SERVER}={keypair()[0]},{OTHER}={OTHER_KEYS[0]}"
    elif case == "client-key-not-trusted":
        server_peers = f"{CLIENT}={CLIENT_KEYS[0]},{keypair()[0]}"
    elif case == "key-bound-to-another-cluster":
        server_peers = f"{CLIENT}={CLIENT_KEYS[0]},42={OTHER_KEYS[0]}"
    elif case == "no-key-for-that-cluster":
        client_peers = f"{OTHER}={OTHER_KEYS[0]}"
    async with LLMDataDist(LLMRole.PROMPT, SERVER) as server, LLMDataDist(LLMRole.DECODER, CLIENT) as client:
        await server.init(server_options(port, server_peers))
        own = OTHER_KEYS if case == "key-bound-to-another-cluster" else CLIENT_KEYS
        if case == "client-key-not-trusted":
            own = keypair()  # the server lists some other key, not this client's
        await client.init(options(own[1], client_peers))
        caplog.set_level(logging.INFO, logger="aiodatadist")
        started = asyncio.get_running_loop().time()
        code, codes = await client.link_clusters([cluster_info(SERVER, port)], timeout=FAIL_MS)
        assert (code, codes) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        assert asyncio.get_running_loop().time() - started < FAIL_MS / 1000 + 3  # (its timeout, not a hang)
        await _no_links_left(client, server)
        logged = caplog.text
        if case == "client-key-not-trusted":
            assert "is not in llm.CurvePeerKeys" in logged  # the server's ZAP handler says why
        elif case == "key-bound-to-another-cluster":
            assert "is listed only for cluster(s) 42" in logged
        elif case == "no-key-for-that-cluster":
            assert f"no CURVE public key for cluster {SERVER}" in logged
        assert f"link {CLIENT} -> {SERVER}" in logged and "failed" in logged
        await _server_still_admits(port)
        await _linked_to_third(client, own[0])


async def test_a_plaintext_client_is_refused_by_a_curve_server() -> None:
    port = free_port()
    async with pair(server_options(port), client_options(peers=None), port) as (server, client):
        _, codes = await client.link_clusters([cluster_info(SERVER, port)], timeout=FAIL_MS)
        assert codes == [S.LLM_LINK_FAILED]
        await _no_links_left(client, server)
        await _server_still_admits(port)


async def test_a_curve_client_refuses_a_plaintext_server() -> None:
    port = free_port()
    async with pair(server_options(port, peers=None), client_options(), port) as (server, client):
        _, codes = await client.link_clusters([cluster_info(SERVER, port)], timeout=FAIL_MS)
        assert codes == [S.LLM_LINK_FAILED]
        await _no_links_left(client, server)
        async with LLMDataDist(LLMRole.DECODER, OTHER) as plain:  # the plaintext server still serves
            await plain.init(options())
            assert (await plain.link_clusters([cluster_info(SERVER, port)], timeout=3000))[0] == S.LLM_SUCCESS


@pytest.mark.parametrize("claimed", [42, 1, True, 42.0, [42], {"a": 1}, None, "42", -1, 2**64 - 1])
async def test_a_raw_curve_client_gets_only_the_cluster_its_key_is_bound_to(claimed: object) -> None:
    """A raw CURVE DEALER whose key the server lists as ``42=KEY`` is refused unless its HELLO claims 42 exactly
    (whatever it puts there), and the server keeps serving."""
    port = free_port()
    async with LLMDataDist(LLMRole.PROMPT, SERVER) as server:
        await server.init(server_options(port, f"{CLIENT}={CLIENT_KEYS[0]},42={OTHER_KEYS[0]}"))
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_secretkey, sock.curve_publickey = OTHER_KEYS[1].encode(), OTHER_KEYS[0].encode()
        sock.curve_serverkey = SERVER_KEYS[0].encode()
        sock.connect(f"tcp://127.0.0.1:{port}")
        try:
            await sock.send(msgpack.packb({"k": "hello", "i": 1, "v": PROTOCOL_VERSION, "cluster": claimed,
                                           "to": SERVER, "role": 0, "transport": "auto"}))
            reply = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 3))
            reply = reply[0] if isinstance(reply, list) else reply
            if claimed == 42 and type(claimed) is int:
                assert reply["code"] == 0  # admitted as cluster 42
            else:
                assert reply["code"] == int(S.LLM_LINK_FAILED)
                assert server.links() == []
        finally:
            sock.close()
            ctx.term()
        await _server_still_admits(port)


@pytest.mark.parametrize("curve", [False, True], ids=["plaintext", "curve"])
async def test_control_plane_bytes_are_encrypted_only_with_curve(curve: bool) -> None:
    """Through a proxy that records the control connection: a notification's marker, the HELLO's field names and
    the peer's cluster directory are readable on the wire without CURVE and never with it."""
    marker = b"SECRET-MARKER-" + bytes(np.random.default_rng().integers(65, 91, 16, dtype=np.uint8))
    port = free_port()
    forwarded = bytearray()
    proxy = FaultProxy(port, on_forward=forwarded.extend)
    await proxy.start()
    try:
        server_opts = server_options(port) if curve else options(port=port)
        client_opts = client_options() if curve else options()
        async with pair(server_opts, client_opts, port) as (server, client):
            assert (await client.link_clusters([cluster_info(SERVER, proxy.port)], timeout=3000))[0] == S.LLM_SUCCESS
            await client.notify(SERVER, marker)
            note = await server.get_notification(timeout=10)
            assert note is not None and note.message == marker
            await server.notify(CLIENT, marker[::-1])
            back = await client.get_notification(timeout=10)
            assert back is not None and back.message == marker[::-1]
            await assert_pull(server, client, 4)
            await asyncio.sleep(0.1)
            seen = bytes(forwarded)
    finally:
        await proxy.close()
    assert len(seen) > 200
    readable = [marker in seen, marker[::-1] in seen, b"transport" in seen]
    assert readable == ([False] * 3 if curve else [True] * 3)
    if curve:
        assert b"CURVE" in seen[:128]  # the ZMTP greeting names the mechanism; everything after it is sealed


def _zap(peers: str) -> ZapHandler:
    from aiodatadist.settings.curve_keys import parse_curve_peer_keys

    handler = object.__new__(ZapHandler)  # sans-IO: answer() only
    handler.curve = CurveKeys(SERVER_KEYS[1].encode(), SERVER_KEYS[0].encode(), parse_curve_peer_keys(peers))
    return handler


def test_the_zap_handler_admits_only_listed_curve_keys() -> None:
    handler = _zap(f"{CLIENT}={CLIENT_KEYS[0]}")
    raw = zmq.utils.z85.decode(CLIENT_KEYS[0])
    base = [b"1.0", b"7", ZAP_DOMAIN, b"10.0.0.1", b""]
    assert handler.answer([*base, b"CURVE", raw]) == [b"1.0", b"7", b"200", b"OK", CLIENT_KEYS[0].encode(), b""]
    assert handler.answer([*base, b"CURVE", zmq.utils.z85.decode(OTHER_KEYS[0])])[2] == b"400"
    assert handler.answer([*base, b"NULL"])[2] == b"400"
    assert handler.answer([*base, b"PLAIN", b"user", b"pass"])[2] == b"400"
    assert handler.answer([b"1.0", b"7", b"other-domain", b"10.0.0.1", b"", b"CURVE", raw])[2] == b"400"
    assert handler.answer([*base, b"CURVE", raw[:31]])[2] == b"400"
    assert handler.answer([b"2.0", b"7"])[2] == b"500"
    assert handler.answer([])[2] == b"500"
