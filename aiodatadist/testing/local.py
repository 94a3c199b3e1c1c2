"""In-process instances for tests: a listening prompt alone (:func:`local_prompt`), or a prompt and a decoder
linked to it (:func:`linked_pair`), in the running event loop; finalized on exit.

Both listen on port 0 of 127.0.0.1 (the port bound is ``prompt.listen_address[1]``): no race for a free port.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from ..config import LLMConfig
from ..datadist import LLMDataDist
from ..errors import LLMException, LLMStatusCode
from ..types import LLMRole
from .addresses import cluster_info_for

__all__ = ["linked_pair", "local_prompt"]


def _prompt_options(config: LLMConfig | None, host: str, sync_kv_timeout: int) -> dict[str, str]:
    options = dict((config or LLMConfig()).generate_options())
    options["llm.listenIpInfo"] = f"{host}:0"
    options["llm.SyncKvCacheWaitTime"] = str(sync_kv_timeout)
    return options


@contextlib.asynccontextmanager
async def local_prompt(cluster_id: int = 1, *, sync_kv_timeout: int = 5000, config: LLMConfig | None = None,
                       host: str = "127.0.0.1") -> AsyncIterator[LLMDataDist]:
    """An initialized PROMPT instance listening on a free port of ``host`` (``listen_address`` tells which);
    ``config`` is used for its options, with ``llm.listenIpInfo`` and ``sync_kv_timeout`` replaced."""
    async with LLMDataDist(LLMRole.PROMPT, cluster_id) as prompt:
        await prompt.init(_prompt_options(config, host, sync_kv_timeout))
        yield prompt


@contextlib.asynccontextmanager
async def linked_pair(prompt_id: int = 1, decoder_id: int = 2, *, sync_kv_timeout: int = 5000,
                      config: LLMConfig | None = None) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    """A listening prompt and a decoder linked to it, both in this event loop; finalized on exit.

    ``config`` is used, and modified, for the prompt; only its ``transport`` is copied to the decoder."""
    client_cfg = LLMConfig()
    client_cfg.sync_kv_timeout = sync_kv_timeout
    if config is not None:
        client_cfg.transport = config.transport
    async with local_prompt(prompt_id, sync_kv_timeout=sync_kv_timeout, config=config) as prompt, \
            LLMDataDist(LLMRole.DECODER, decoder_id) as decoder:
        await decoder.init(dict(client_cfg.generate_options()))
        address = prompt.listen_address
        assert address is not None
        code, _ = await decoder.link_clusters([cluster_info_for(prompt_id, *address)], timeout=5000)
        if code != LLMStatusCode.LLM_SUCCESS:
            raise LLMException(f"linked_pair: link failed with {code}", status_code=code)
        yield prompt, decoder
