"""Hostile and malformed input against a live server (real ZeroMQ and TCP sockets on 127.0.0.1).

A raw client links like a peer would, then sends what hypothesis makes up: random bytes, messages of every kind
with fields of any type and size, and valid requests with one field made hostile.  Afterwards the server must
still answer, serve a well-behaved peer byte-exact, never have written outside its caches, and hold no lease
once the hostile peer is gone.  The TCP data port gets the same treatment.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio
from helpers.data import fill_pattern
from helpers.internals import registry_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
from aiodatadist.layout.plans import CacheGeometry
from aiodatadist.protocol.handshake import PROTOCOL_VERSION
from aiodatadist.protocol.messages import geometry_to_wire
from aiodatadist.testing import cluster_info, free_port
from aiodatadist.transport.tcp.frames import HEADER, MAGIC

S = LLMStatusCode
# scripts/fuzz_long.py raises it (with --hypothesis-seed) for long runs
CONTROL_EXAMPLES = int(os.environ.get("AIODATADIST_FUZZ_EXAMPLES", "60") or 60)
DESC = CacheDesc(2, (8, 4096), DataType.DT_UINT8, Placement.HOST)
GEOMETRY = geometry_to_wire(CacheGeometry(2, 8 * 4096, 8, True, DESC.data_type.value))
FIELDS = ["tid", "key", "peer", "known", "op", "api", "sb", "db", "sr", "dr", "n", "size", "slot", "ok", "confirm",
          "r", "code", "cluster", "to", "v", "role", "transport", "cn", "cp", "sn"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=16), st.binary(max_size=48))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                      max_leaves=12)
huge = st.one_of(st.just([1] * 100_000), st.just(list(range(-50, 50))), st.just("x" * 100_000),
                 st.integers(2**40, 2**64 - 1), st.just([["blocks", 0, 0]] * 1000))
kinds = st.sampled_from(["begin", "end", "abort", "ping", "hello", "reply", "nonsense", 7, None])
messages = st.fixed_dictionaries({"k": kinds, "i": st.integers(-5, 2**64 - 1)},
                                 optional={name: st.one_of(values, huge) for name in FIELDS})


def valid_begin(tid: int) -> dict[str, Any]:
    return {"k": "begin", "i": 10_000 + tid, "tid": tid, "key": ["blocks", 0, 0], "peer": GEOMETRY, "known": [],
            "op": "pull", "api": "blocks", "sb": [1], "db": [2], "sr": None, "dr": None, "n": 2, "size": -1,
            "slot": 0}


@st.composite
def hostile_begins(draw: st.DrawFn) -> dict[str, Any]:
    """A valid BEGIN with one or two fields replaced by anything (huge block indices, wrong types, ...)."""
    message = valid_begin(draw(st.integers(1, 2**32)))
    for name in draw(st.lists(st.sampled_from(sorted(message)), min_size=1, max_size=2)):
        message[name] = draw(st.one_of(values, huge, st.lists(st.integers(-(2**63), 2**64 - 1), max_size=4)))
    return message


frames = st.one_of(
    st.binary(max_size=300).map(lambda b: ("raw", b)),
    messages.map(lambda m: ("one", m)),
    st.lists(st.one_of(messages, hostile_begins()), min_size=1, max_size=6).map(lambda ms: ("batch", ms)),
    hostile_begins().map(lambda m: ("one", m)),
)


def pack(frame: tuple[str, Any]) -> bytes:
    kind, payload = frame
    if kind == "raw":
        return bytes(payload)
    try:
        return bytes(msgpack.packb(payload, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):
        return b"\xc1"  # never valid msgpack


async def _request(sock: zmq.asyncio.Socket, message: dict[str, Any], timeout: float = 3.0) -> dict[str, Any]:
    await sock.send(msgpack.packb(message))
    async with asyncio.timeout(timeout):
        while True:
            for reply in _replies(await sock.recv()):
                if reply.get("r") == message["i"]:
                    return reply


def _replies(data: bytes) -> list[dict[str, Any]]:
    decoded = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return [m for m in (decoded if isinstance(decoded, list) else [decoded]) if isinstance(m, dict)]


async def scenario(sent: list[tuple[str, Any]]) -> None:
    port = free_port()
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    async with LLMDataDist(LLMRole.PROMPT, 1) as server, LLMDataDist(LLMRole.DECODER, 2) as good:
        await server.init(dict(cfg.generate_options()))
        await good.init({})
        src = server.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        data = fill_pattern(src, 9)
        guard = server.cache_manager.allocate_blocks_cache(DESC)  # must never change
        guard_bytes = fill_pattern(guard, 10)
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        try:
            hello = {"k": "hello", "i": 1, "v": PROTOCOL_VERSION, "cluster": 77, "to": 1, "role": 0,
                     "transport": "auto"}
            assert (await _request(sock, hello))["code"] == 0
            for frame in sent:
                await sock.send(pack(frame))
            await asyncio.sleep(0.05)
            while await sock.poll(0):  # answers to the hostile requests (which may reuse the ping's id)
                await sock.recv()
            ping = await _request(sock, {"k": "ping", "i": 2**40})  # answered: linked or not, never silent
            assert ping["code"] in (0, int(S.LLM_NOT_YET_LINK))
            # A well-behaved peer is served byte-exact meanwhile.
            assert (await good.link_clusters([cluster_info(1, port)], timeout=3000))[0] == S.LLM_SUCCESS
            dst = good.cache_manager.allocate_blocks_cache(DESC)
            await good.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [3, 5], [0, 1])
            for t in range(2):
                assert np.array_equal(dst.tensors[t].reshape(8, -1)[[0, 1]], data[t].reshape(8, -1)[[3, 5]])
            await sock.send(msgpack.packb({"k": "bye", "i": 2**41}))
        finally:
            sock.close()
            ctx.term()
        for _ in range(100):  # the hostile peer is gone: nothing it started is held any more
            if 77 not in {link["remote_cluster_id"] for link in server.links()}:
                break
            await asyncio.sleep(0.02)
        assert all(entry.leases == 0 for entry in registry_of(server.cache_manager).entries())
        for t in range(2):
            assert np.array_equal(guard.tensors[t].reshape(-1), guard_bytes[t])
            assert np.array_equal(src.tensors[t].reshape(-1), data[t])


@settings(max_examples=CONTROL_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(frames, min_size=1, max_size=8))
def test_the_control_plane_survives_anything(sent: list[tuple[str, Any]]) -> None:
    asyncio.run(scenario(sent))


async def test_the_data_port_survives_anything() -> None:
    """Random bytes, wrong tokens and, with a valid token, malformed frames: the connection is closed (and the
    offending link dropped), the server keeps serving others over TCP."""
    port = free_port()
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    cfg.transport = "tcp"
    async with LLMDataDist(LLMRole.PROMPT, 1) as server, LLMDataDist(LLMRole.DECODER, 2) as victim, \
            LLMDataDist(LLMRole.DECODER, 3) as good:
        await server.init(dict(cfg.generate_options()))
        await victim.init({})
        await good.init({})
        src = server.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        data = fill_pattern(src, 11)
        assert (await victim.link_clusters([cluster_info(1, port)], timeout=3000))[0] == S.LLM_SUCCESS
        listener = server._links._accept.data_listener
        assert listener is not None
        data_port = listener.getsockname()[1]
        token = server._links.links[2].data_token
        rng = np.random.default_rng(5)

        def attack() -> list[bytes]:
            answers = []
            payloads = [rng.bytes(64), MAGIC.to_bytes(4, "little") + rng.bytes(16),
                        MAGIC.to_bytes(4, "little") + token + HEADER.pack(0xDEAD, 1, 1, 0, 10, 0, 0),
                        MAGIC.to_bytes(4, "little") + token + HEADER.pack(MAGIC, 2, 1, 1, 2**62, 0, 0),
                        MAGIC.to_bytes(4, "little") + token + HEADER.pack(MAGIC, 99, 1, 1, 0, 0, 0)]
            for payload in payloads:
                with socket.create_connection(("127.0.0.1", data_port)) as sock:
                    sock.sendall(payload)
                    sock.settimeout(5)
                    try:
                        answers.append(sock.recv(1 << 16))
                    except (ConnectionResetError, TimeoutError) as exc:
                        answers.append(type(exc).__name__.encode())
            return answers

        answers = await asyncio.to_thread(attack)
        assert all(a in (b"", b"ConnectionResetError") for a in answers), answers  # closed, nothing answered
        assert (await good.link_clusters([cluster_info(1, port)], timeout=3000))[0] == S.LLM_SUCCESS
        dst = good.cache_manager.allocate_blocks_cache(DESC)
        for _ in range(2):  # round trip, then one-sided
            await good.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [6], [7])
        assert np.array_equal(dst.tensors[0].reshape(8, -1)[7], data[0].reshape(8, -1)[6])
