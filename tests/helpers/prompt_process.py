"""A prompt in its own OS process and a decoder in the test's process linked to it, for the tests that stop,
block or inspect the owner from outside (SIGSTOP, /proc/<pid>/mem, the agent's ``block`` command)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping

from aiodatadist import LLMConfig, LLMDataDist, LLMRole, LLMStatusCode
from aiodatadist.testing import PeerProcess, cluster_info, free_port


@contextlib.asynccontextmanager
async def prompt_process(cluster_id: int, transport: str, *, sync_kv_timeout_ms: int,
                         env: Mapping[str, str] | None = None) -> AsyncIterator[tuple[PeerProcess, int]]:
    """A prompt process listening on a free port of 127.0.0.1 and forcing ``transport``: (process, port)."""
    port = free_port()
    peer = await PeerProcess.start(env=dict(env) if env is not None else None)
    try:
        await peer.call("init", role="PROMPT", cluster_id=cluster_id,
                        options={"llm.listenIpInfo": f"127.0.0.1:{port}",
                                 "llm.SyncKvCacheWaitTime": str(sync_kv_timeout_ms), "llm.Transport": transport})
        yield peer, port
    finally:
        await peer.close()


@contextlib.asynccontextmanager
async def linked_decoder(cluster_id: int, prompt_id: int, port: int, transport: str, *,
                         sync_kv_timeout_ms: int) -> AsyncIterator[LLMDataDist]:
    """A decoder in this process, linked to the prompt at ``port``; the link must use ``transport``."""
    async with LLMDataDist(LLMRole.DECODER, cluster_id) as dd:
        cfg = LLMConfig()
        cfg.sync_kv_timeout = sync_kv_timeout_ms
        await dd.init(cfg.generate_options())
        code, _ = await dd.link_clusters([cluster_info(prompt_id, port)], timeout=5000)
        assert code == LLMStatusCode.LLM_SUCCESS
        assert dd.links()[0]["plane"] == transport
        yield dd
