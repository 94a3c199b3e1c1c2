"""A listen port that anything can reach: connection churn, garbage, half-finished handshakes held open and floods
of HELLOs, each from a hostile client in its own OS process (``aiodatadist_benchmarks.port_churn``).

After each, within a second, a new decoder links, pulls byte-exact and unlinks cleanly, and a decoder linked before
it still gets its requests answered and unlinks cleanly (the control socket answers).  The rule asserted is that
the instance keeps admitting and answering whatever else connected, not how fast the hostile client was.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

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
from aiodatadist._listen import LISTEN_BACKLOG
from aiodatadist.protocol.handshake import PROTOCOL_VERSION
from aiodatadist.testing import cluster_info, free_port

pytest.importorskip("aiodatadist_benchmarks.port_churn", reason="the hostile clients come with the benchmarks "
                    "distribution (pip install -e ./benchmarks)")

S = LLMStatusCode
DESC = CacheDesc(2, (8, 4096), DataType.DT_UINT8, Placement.HOST)
LINK_WITHIN_MS = 1000  # a legitimate link after the hostile client is done (a link takes milliseconds)
LINK_DURING_MS = 10_000  # a legitimate link during a flood: its HELLOs queue behind the flood's, as long as the
# machine takes to answer those (the rule is that it links, not how fast this machine answers a flood)
WAIT_S = 30.0  # generous bound for what happens in the background (the machine may be loaded)


async def _clients(kind: str, port: int, n: int) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiodatadist_benchmarks.port_churn", kind, str(port), str(n), str(PROTOCOL_VERSION),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)


async def _run_clients(kind: str, port: int, n: int) -> None:
    proc = await _clients(kind, port, n)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=300)
    assert proc.returncode == 0 and out.split()[-2:] == [b"done", str(n).encode()], out[-200:]


@contextlib.asynccontextmanager
async def _held(kind: str, port: int, n: int) -> AsyncIterator[None]:
    """``n`` connections of ``kind`` held open for the body."""
    proc = await _clients(kind, port, n)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=120)
        assert line.split() == [b"open", str(n).encode()], line
        yield
    finally:
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), timeout=60)


class World:
    """A prompt (cluster 1) with a blocks cache of random bytes, listening on 127.0.0.1, and a decoder (cluster 2)
    linked before anything hostile happens."""

    def __init__(self, server: LLMDataDist, early: LLMDataDist, port: int, data: list[np.ndarray],
                 options: dict[str, str]) -> None:
        self.server, self.early, self.port, self.data = server, early, port, data
        self.options = options  # a decoder's (its key, if any)

    async def pull_checked(self, dd: LLMDataDist, src: list[int], dst: list[int]) -> None:
        cache = dd.cache_manager.allocate_blocks_cache(DESC)
        try:
            await dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src, dst)
            for t in range(2):
                got = cache.tensors[t].reshape(8, -1)[dst]
                assert np.array_equal(got, self.data[t].reshape(8, -1)[src])
        finally:
            dd.cache_manager.deallocate_blocks_cache(cache)

    async def legitimate_peers_served(self, new_id: int = 3, link_within_ms: int = LINK_WITHIN_MS) -> None:
        """A new decoder links (within a second unless told), pulls and unlinks; the early decoder's link still
        answers."""
        async with LLMDataDist(LLMRole.DECODER, new_id) as late:
            await late.init(dict(self.options))
            code, per = await late.link_clusters([cluster_info(1, self.port)], timeout=link_within_ms)
            assert code == S.LLM_SUCCESS and per == [S.LLM_SUCCESS]
            await self.pull_checked(late, [6, 1], [0, 7])
            code, per = await late.unlink_clusters([cluster_info(1, self.port)], timeout=3000)
            assert code == S.LLM_SUCCESS and per == [S.LLM_SUCCESS]
        await self.pull_checked(self.early, [2, 5], [3, 4])
        await self.early.check_link_status(1)  # a round trip on the early link's control socket

    async def links_served(self) -> set[int]:
        return {link["remote_cluster_id"] for link in self.server.links()}

    async def wait_links(self, expected: set[int]) -> None:
        """The server's links become ``expected`` (hostile half-open links go by themselves)."""
        async with asyncio.timeout(WAIT_S):
            while await self.links_served() != expected:
                await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def world(auth_key: str | None = None) -> AsyncIterator[World]:
    port = free_port()
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    options = dict(cfg.generate_options())
    decoder_options: dict[str, str] = {}
    if auth_key is not None:
        options["llm.AuthKey"] = decoder_options["llm.AuthKey"] = auth_key
    async with LLMDataDist(LLMRole.PROMPT, 1) as server, LLMDataDist(LLMRole.DECODER, 2) as early:
        await server.init(options)
        await early.init(decoder_options)
        src = server.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        data = fill_pattern(src, 21)
        code, _ = await early.link_clusters([cluster_info(1, port)], timeout=5000)
        assert code == S.LLM_SUCCESS
        w = World(server, early, port, data, decoder_options)
        await w.pull_checked(early, [0, 1], [1, 0])
        yield w
        code, per = await early.unlink_clusters([cluster_info(1, port)], timeout=3000)
        assert code == S.LLM_SUCCESS and per == [S.LLM_SUCCESS], "the control socket no longer answers"


@pytest.mark.parametrize(("kind", "count"), [("zmq", 2500), ("raw", 1500), ("greeting", 1500), ("msgpack", 1000)])
async def test_churn_on_the_listen_port_leaves_links_admitted(kind: str, count: int) -> None:
    async with world() as w:
        await _run_clients(kind, w.port, count)
        await w.legitimate_peers_served()
        assert await w.links_served() == {2}


async def test_half_finished_handshakes_held_open_do_not_stop_admission() -> None:
    async with world() as w, _held("hold", w.port, 300):
        await w.legitimate_peers_served()
        assert await w.links_served() == {2}


async def test_hellos_from_clients_that_vanish_leave_no_links() -> None:
    """Without a key each well-formed HELLO is a link; one whose client is gone goes at once, so that more of them
    than the link limit never fill it."""
    async with world() as w:
        await _run_clients("hello", w.port, 700)  # more than MAX_LINKS (512)
        await w.wait_links({2})
        await w.legitimate_peers_served()


async def test_hellos_from_clients_that_stay_are_links_until_they_go() -> None:
    async with world() as w:
        async with _held("hello-open", w.port, 50):
            async with asyncio.timeout(WAIT_S):
                while len(await w.links_served()) < 51:
                    await asyncio.sleep(0.02)
            await w.legitimate_peers_served()
        await w.wait_links({2})


async def test_a_hello_flood_against_a_keyed_instance_costs_bounded_state() -> None:
    """With ``llm.AuthKey`` a HELLO without the key's proof is answered with a challenge and nothing else; the
    pending challenges stay bounded and a legitimate handshake during the flood links (its challenge is not pushed
    out)."""
    from aiodatadist.protocol.auth import MAX_PENDING

    async with world(auth_key="churn-test-key") as w:
        challenges = w.server._links._accept.challenges
        flood = asyncio.ensure_future(_run_clients("hello", w.port, 5000))
        try:
            async with asyncio.timeout(WAIT_S):
                while len(challenges) < 50 and not flood.done():  # the flood is under way
                    await asyncio.sleep(0.005)
            for new_id in (3, 4, 5):  # during the flood
                await w.legitimate_peers_served(new_id, LINK_DURING_MS)
                assert len(challenges) <= MAX_PENDING
        finally:
            await flood
        assert await w.links_served() == {2}
        await w.legitimate_peers_served(6)


def _listen_queue(port: int) -> int | None:
    """The accept queue's length of the socket listening on 127.0.0.1:``port`` (``ss``), or None without ``ss``."""
    ss = shutil.which("ss")
    if ss is None:
        return None
    out = subprocess.run([ss, "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[2])


async def test_the_listen_ports_queue_a_burst_of_connections() -> None:
    """Both listening sockets (control and data) queue a burst as large as the kernel allows: a short queue drops
    SYNs under a burst, and each dropped SYN costs a legitimate client a 1 s retransmission."""
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to read a listening socket's queue length")
    wanted = min(int(Path("/proc/sys/net/core/somaxconn").read_text()), LISTEN_BACKLOG)
    async with world() as w:
        data_port = w.server._links._accept.data_listener.getsockname()[1]
        assert _listen_queue(w.port) == wanted
        assert _listen_queue(data_port) == wanted
