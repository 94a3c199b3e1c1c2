"""A small KV router: one decoder that links to prompt clusters on demand and serves many concurrent requests.

``docs/testing.md`` shows it with its test suite (``test_kv_router.py``, next to it)::

    async with KVRouter(cluster_id=7, cache_desc=desc) as router:
        prompt = Prompt(cluster_id=1, host="10.0.0.5", port=26000)
        await router.fetch("req-1", prompt, src_blocks=[4, 9], dst_blocks=[0, 1], timeout=2.0)
        ...  # router.cache holds the request's KV blocks in blocks 0 and 1

``fetch`` pulls blocks ``src_blocks`` of a prompt's paged KV cache (``BlocksCacheKey(prompt.cluster_id,
prompt.model_id)``) into ``dst_blocks`` of the router's cache.  It links to the prompt first if needed (once for
all the requests that arrive together), relinks after the prompt restarted, and keeps the whole call (link and
pull) within ``timeout`` seconds.  A destination block belongs to one request at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from types import TracebackType
from typing import NamedTuple, Self, cast

from aiodatadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    cluster_info_for,
)

__all__ = ["KVRouter", "Prompt"]

log = logging.getLogger("kv_router")

LINKED = (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK)


class Prompt(NamedTuple):
    """A prompt cluster: its id, where it listens, and the model id of its blocks cache."""

    cluster_id: int
    host: str
    port: int
    model_id: int = 0


class KVRouter:
    """One decoder ``LLMDataDist`` with one blocks cache (``cache_desc``), serving :meth:`fetch` requests."""

    def __init__(self, cluster_id: int, cache_desc: CacheDesc, *, config: LLMConfig | None = None) -> None:
        self._dd = LLMDataDist(LLMRole.DECODER, cluster_id)
        self._desc = cache_desc
        self._config = config or LLMConfig()
        self._cache: Cache | None = None
        self._where: dict[int, tuple[str, int]] = {}  # cluster id -> the address its link was made to
        self._linking: dict[int, asyncio.Lock] = {}  # cluster id -> held while linking to it
        self._busy: set[int] = set()  # destination blocks of the requests in flight

    async def __aenter__(self) -> Self:
        await self._dd.init(self._config.generate_options())
        try:
            self._cache = self._dd.cache_manager.allocate_blocks_cache(self._desc)
        except BaseException:
            await self._dd.finalize()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._dd.finalize()  # ends the requests in flight (they fail) and unlinks every prompt

    @property
    def cache(self) -> Cache:
        """The router's blocks cache: where :meth:`fetch` writes."""
        if self._cache is None:
            raise RuntimeError("use the router inside 'async with'")
        return self._cache

    def linked(self) -> list[int]:
        """The prompt clusters linked now."""
        return [cast(int, link["remote_cluster_id"]) for link in self._dd.links()]

    async def fetch(self, request: str, prompt: Prompt, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                    timeout: float) -> None:
        """Pull ``src_blocks`` of ``prompt``'s cache into ``dst_blocks`` of :attr:`cache`, linking first if
        needed, all within ``timeout`` seconds.

        Raises ``ValueError`` for bad input (checked before anything else), ``TimeoutError`` when the deadline
        passed, and ``LLMException`` when the prompt refused (e.g. ``LLM_PARAM_INVALID`` for a source block it
        does not have) or could not be reached (``LLM_LINK_FAILED``, or a link that dropped: the next call
        links again).  After a failure, a timeout or a cancellation the destination blocks hold unspecified
        bytes, and nothing writes them once this has returned (aiodatadist's guarantee): they are free for the
        next request.
        """
        src, dst = self._check(request, src_blocks, dst_blocks, timeout)
        self._busy.update(dst)
        try:
            async with asyncio.timeout(timeout) as deadline:
                await self._link(prompt, deadline.when())
                await self._dd.cache_manager.pull_blocks(BlocksCacheKey(prompt.cluster_id, prompt.model_id),
                                                         self.cache, src, dst)
        finally:
            self._busy.difference_update(dst)
        log.debug("request %s: %d blocks from cluster %d", request, len(dst), prompt.cluster_id)

    def _check(self, request: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
               timeout: float) -> tuple[list[int], list[int]]:
        if not isinstance(request, str) or not request:
            raise ValueError(f"request must be a non-empty str, not {request!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, not {timeout!r}")
        src, dst = [int(b) for b in src_blocks], [int(b) for b in dst_blocks]
        if not dst or len(src) != len(dst):
            raise ValueError(f"request {request}: src_blocks and dst_blocks must be non-empty and as long as "
                             f"each other ({len(src)} and {len(dst)})")
        blocks = int(self._desc.shape[0])
        wrong = [b for b in dst if not 0 <= b < blocks]
        if wrong:
            raise ValueError(f"request {request}: dst_blocks {wrong} are outside the router's cache of "
                             f"{blocks} blocks")
        if len(set(dst)) != len(dst):
            raise ValueError(f"request {request}: dst_blocks lists a block twice")
        taken = sorted(self._busy.intersection(dst))
        if taken:
            raise ValueError(f"request {request}: dst_blocks {taken} are being written by another request")
        return src, dst

    async def _link(self, prompt: Prompt, deadline: float | None) -> None:
        """Link to ``prompt`` unless linked to it at that address already (by ``deadline``, loop time).

        Concurrent ``link_clusters`` calls for one cluster share the link attempt in progress (aiodatadist), so
        requests for one new prompt would link once without help; the per-cluster lock is for a prompt that
        moved: its old link is dropped and the new one made once, not raced by the requests that noticed.
        """
        if self._is_linked(prompt):
            return
        async with self._linking.setdefault(prompt.cluster_id, asyncio.Lock()):
            if self._is_linked(prompt):
                return
            await self._forget(prompt.cluster_id)
            info = cluster_info_for(prompt.cluster_id, prompt.host, prompt.port)
            _, codes = await self._dd.link_clusters([info], timeout=_link_timeout_ms(deadline))
            if codes[0] not in LINKED:
                raise LLMException(f"cannot link to prompt cluster {prompt.cluster_id} at {prompt.host}:"
                                   f"{prompt.port}: {codes[0].name}", status_code=codes[0])
            self._where[prompt.cluster_id] = (prompt.host, prompt.port)

    def _is_linked(self, prompt: Prompt) -> bool:
        return self._where.get(prompt.cluster_id) == (prompt.host, prompt.port) \
            and prompt.cluster_id in self.linked()

    async def _forget(self, cluster_id: int) -> None:
        """Drop a link to ``cluster_id`` made to another address (the prompt moved), if it is still there."""
        self._where.pop(cluster_id, None)
        if cluster_id in self.linked():
            info = cluster_info_for(cluster_id, "127.0.0.1", 1)  # unlink needs only the cluster id
            with contextlib.suppress(LLMException):
                await self._dd.unlink_clusters([info], timeout=1000, force=True)


def _link_timeout_ms(deadline: float | None) -> int:
    """The link's own timeout: a little beyond the caller's deadline, so that the deadline (the
    ``asyncio.timeout`` of :meth:`KVRouter.fetch`, which cancels the link) is what a slow link runs into."""
    if deadline is None:
        return 3000
    return max(1, int((deadline - asyncio.get_running_loop().time() + 1.0) * 1000))
