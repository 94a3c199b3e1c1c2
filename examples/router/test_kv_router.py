"""Tests of the example router (``kv_router.py``), written as a user of aiodatadist would write them.

Real prompts in child processes (the ``aiodatadist`` pytest plugin's ``PromptServer``), real links over
127.0.0.1, random bytes checked byte for byte.  Every test runs on the module's event loop and under the
plugin's ``leak_check``: a test that leaves a link, a process, a thread or a descriptor behind fails.

Run it with ``pytest examples/router`` (``tests/integration/test_router_example.py`` runs it in CI).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from kv_router import KVRouter, Prompt

from aiodatadist import CacheDesc, DataType, LLMException, LLMLinkError, LLMStatusCode, Placement
from aiodatadist.testing import (
    FaultInjector,
    PromptServer,
    assert_blocks_landed,
    block_rows,
    new_cluster_id,
    tensor_bytes,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("leak_check")]

BLOCK = 1024  # bytes per block of each tensor, the same on both sides
PROMPT_DESC = CacheDesc(4, (32, BLOCK), DataType.DT_UINT8, Placement.HOST)
ROUTER_DESC = CacheDesc(4, (64, BLOCK), DataType.DT_UINT8, Placement.HOST)


# -- fixtures and helpers ------------------------------------------------------------------------------------
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def prompts() -> AsyncIterator[list[PromptServer]]:
    """Two prompts for the whole module (tests only read them)."""
    async with PromptServer.start(caches={"kv": PROMPT_DESC}) as a, \
            PromptServer.start(caches={"kv": PROMPT_DESC}) as b:
        yield [a, b]


@pytest_asyncio.fixture(loop_scope="module")
async def prompt_server(prompt_server_factory: Callable[..., Awaitable[PromptServer]]) -> PromptServer:
    """The plugin's ``prompt_server`` (which ``fault_injector`` stops and kills), over the ``tcp`` transport.

    On one host, pulls by ``BlocksCacheKey`` ask the prompt once and then copy straight from its memory, so a
    stopped prompt would go on serving them; over TCP the prompt's own threads serve every read."""
    return await prompt_server_factory(options={"llm.Transport": "tcp"})


@pytest_asyncio.fixture(loop_scope="module")
async def router() -> AsyncIterator[KVRouter]:
    """A fresh router per test (linked to nothing yet)."""
    async with KVRouter(new_cluster_id(), ROUTER_DESC) as r:
        yield r


def at(server: PromptServer) -> Prompt:
    host, port, cluster_id = server.address
    return Prompt(cluster_id, host, port)


def rows(router: KVRouter, blocks: list[int]) -> list[np.ndarray[Any, Any]]:
    return block_rows(tensor_bytes(router.cache), ROUTER_DESC.shape[0], blocks)


def assert_landed(router: KVRouter, server: PromptServer, src: list[int], dst: list[int]) -> None:
    assert_blocks_landed(router.cache, dst, server, src)


# -- the data path -------------------------------------------------------------------------------------------
async def test_a_fetch_lands_the_prompts_bytes(prompts: list[PromptServer], router: KVRouter) -> None:
    await router.fetch("r1", at(prompts[0]), [5, 0, 31], [10, 11, 12], timeout=5)
    assert_landed(router, prompts[0], [5, 0, 31], [10, 11, 12])
    assert router.linked() == [prompts[0].cluster_id]


async def test_32_concurrent_fetches_from_two_new_prompts(prompts: list[PromptServer], router: KVRouter) -> None:
    """32 requests arrive together for two prompts the router has not linked yet: each prompt is linked once,
    and every request gets its own bytes."""
    rng = random.Random()
    dst = rng.sample(range(64), 64)
    requests = []
    for i in range(32):
        server = prompts[i % 2]
        src = rng.sample(range(32), 2)
        requests.append((f"r{i}", server, src, dst[2 * i: 2 * i + 2]))
    await asyncio.gather(*(router.fetch(name, at(server), src, d, timeout=10)
                           for name, server, src, d in requests))
    for _, server, src, d in requests:
        assert_landed(router, server, src, d)
    assert sorted(router.linked()) == sorted(p.cluster_id for p in prompts)


# -- cancellation and timeouts -------------------------------------------------------------------------------
async def test_a_cancelled_fetch_writes_nothing_after_it_returned(prompt_server: PromptServer,
                                                                  fault_injector: FaultInjector,
                                                                  router: KVRouter) -> None:
    await router.fetch("warm-up", at(prompt_server), [0], [0], timeout=5)  # linked: the next fetch is a pull
    async with fault_injector.stopped():  # the prompt answers nothing: the pull waits
        fetch = asyncio.create_task(router.fetch("r1", at(prompt_server), [1, 2], [1, 2], timeout=10))
        await asyncio.sleep(0.1)
        assert not fetch.done()
        fetch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fetch
        at_return = rows(router, [1, 2])
    await asyncio.sleep(0.2)  # the prompt runs again and sees the abandoned request
    for later, then in zip(rows(router, [1, 2]), at_return, strict=True):
        np.testing.assert_array_equal(later, then)
    await router.fetch("r2", at(prompt_server), [1, 2], [1, 2], timeout=5)  # the blocks are free again
    assert_landed(router, prompt_server, [1, 2], [1, 2])


async def test_a_fetch_from_a_stopped_prompt_times_out_on_time(prompt_server: PromptServer,
                                                                fault_injector: FaultInjector,
                                                                router: KVRouter) -> None:
    await router.fetch("warm-up", at(prompt_server), [0], [0], timeout=5)
    loop = asyncio.get_running_loop()
    async with fault_injector.stopped():
        started = loop.time()
        with pytest.raises(TimeoutError):
            await router.fetch("r1", at(prompt_server), [3], [3], timeout=0.3)
        assert 0.3 <= loop.time() - started < 0.6
    await router.fetch("r2", at(prompt_server), [3], [3], timeout=5)
    assert_landed(router, prompt_server, [3], [3])


async def test_a_destination_block_belongs_to_one_request(prompt_server: PromptServer,
                                                          fault_injector: FaultInjector,
                                                          router: KVRouter) -> None:
    await router.fetch("warm-up", at(prompt_server), [0], [0], timeout=5)
    async with fault_injector.stopped():
        first = asyncio.create_task(router.fetch("r1", at(prompt_server), [4, 5], [7, 8], timeout=10))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match=r"dst_blocks \[8\] are being written by another request"):
            await router.fetch("r2", at(prompt_server), [6], [8], timeout=5)
    await first
    assert_landed(router, prompt_server, [4, 5], [7, 8])


# -- a prompt that dies --------------------------------------------------------------------------------------
async def test_a_killed_prompt_fails_fetches_and_its_restart_serves_them(prompt_server: PromptServer,
                                                                         router: KVRouter) -> None:
    await router.fetch("r1", at(prompt_server), [1], [1], timeout=5)
    await prompt_server.kill()
    # The link drops and relinking is refused (LLMLinkError), or the call runs into its deadline
    # (TimeoutError): never a hang, never success.
    with pytest.raises((LLMException, TimeoutError)):
        await router.fetch("r2", at(prompt_server), [2], [2], timeout=1)
    await prompt_server.restart()  # same cluster, same port, same bytes
    await router.fetch("r3", at(prompt_server), [2, 3], [2, 3], timeout=5)  # the router links again by itself
    assert_landed(router, prompt_server, [2, 3], [2, 3])


async def test_a_prompt_restarted_on_another_port(prompt_server: PromptServer, router: KVRouter) -> None:
    await router.fetch("r1", at(prompt_server), [1], [1], timeout=5)
    old = at(prompt_server)
    await prompt_server.restart(port=0)
    assert at(prompt_server).port != old.port
    await router.fetch("r2", at(prompt_server), [9], [9], timeout=5)
    assert_landed(router, prompt_server, [9], [9])
    assert router.linked() == [prompt_server.cluster_id]


# -- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("request_id", "src", "dst", "timeout", "error", "match"), [
    ("", [1], [1], 5, ValueError, "request must be a non-empty str"),
    ("r", [1], [1], 0, ValueError, "timeout must be > 0"),
    ("r", [1, 2], [1], 5, ValueError, "as long as each other"),
    ("r", [], [], 5, ValueError, "non-empty"),
    ("r", [1], [64], 5, ValueError, r"dst_blocks \[64\] are outside the router's cache of 64 blocks"),
    ("r", [1, 2], [3, 3], 5, ValueError, "lists a block twice"),
    ("r", [32], [1], 5, LLMException, "src_blocks has block index 32 >= num_blocks 32"),
])
async def test_bad_input_is_refused_and_the_router_goes_on(prompts: list[PromptServer], router: KVRouter,
                                                            request_id: str, src: list[int], dst: list[int],
                                                            timeout: float, error: type[Exception],
                                                            match: str) -> None:
    with pytest.raises(error, match=match):
        await router.fetch(request_id, at(prompts[0]), src, dst, timeout=timeout)
    await router.fetch("next", at(prompts[0]), [6], [1], timeout=5)
    assert_landed(router, prompts[0], [6], [1])


async def test_a_wrong_model_id_or_cluster_id_is_refused(prompts: list[PromptServer], router: KVRouter) -> None:
    with pytest.raises(LLMException) as info:
        await router.fetch("r1", at(prompts[0])._replace(model_id=3), [1], [1], timeout=5)
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    with pytest.raises(LLMLinkError):  # another cluster's id at this address: the prompt refuses the link
        stranger = at(prompts[0])._replace(cluster_id=prompts[0].cluster_id + 99)
        await router.fetch("r2", stranger, [1], [1], timeout=5)
