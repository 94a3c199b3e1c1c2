"""Serving-style prefill/decode pair: the decoder pulls each finished request's KV blocks from the prompt.

Run it with no arguments::

    python examples/serving_pair.py

This process is the **prompt** (prefill) server.  It allocates a paged KV cache
(``allocate_blocks_cache`` with ``BlocksCacheKey(PROMPT_ID, 0)``), listens, and starts a second process
running this file as the **decoder**.  The flow follows vllm-ascend's LLMDataDist connector (spec §11.1):

1. The decoder links to the prompt with ``link_clusters`` and says hello on a small *side channel* (plain
   asyncio streams carrying JSON lines; the aiodatadist control plane is not used for it).
2. The prompt "prefills" requests: it takes blocks from its own allocator, writes random KV bytes into them
   and, when a request is finished, tells the decoder its block ids (and a digest of its bytes) on the side
   channel.
   Its block pool is smaller than all requests together, so it has to wait for blocks to be freed.
3. The decoder pulls each finished request into blocks of its own cache with
   ``pull_blocks(BlocksCacheKey(PROMPT_ID, 0), cache, src_blocks, dst_blocks)`` (several requests at once),
   checks the bytes and tells the prompt "you may free request X".  The prompt then returns those blocks to
   its allocator; later requests reuse (overwrite) them, so a pull that came too late would be caught by the
   digest.
4. When every request is freed the prompt says "done"; the decoder unlinks and exits, the prompt finalizes.

Exit status 0 when every request arrived intact and every block came back to both allocators.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

from aiodatadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import free_port

PROMPT_ID, DECODER_ID = 1, 2
LAYERS = 8
TENSORS = 2 * LAYERS                      # K0, V0, K1, V1, ... (one blocks cache holds every layer's K and V)
BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 16, 4, 64   # one block of one tensor = 16 x 4 x 64 x fp16 = 8 KiB
PROMPT_BLOCKS = 48                        # fewer than all requests need: the prompt must reuse freed blocks
DECODER_BLOCKS = 64
REQUESTS = 16
SYNC_KV_TIMEOUT_MS = 3000
DEADLINE_S = 30.0                         # the whole example; it normally takes well under a second


def kv_desc(num_blocks: int) -> CacheDesc:
    shape = (num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    return CacheDesc(TENSORS, shape, DataType.DT_FLOAT16, Placement.HOST)


def block_bytes(cache: Cache) -> list[np.ndarray]:
    """Per tensor, a ``(num_blocks, bytes_per_block)`` uint8 view of the cache."""
    n = cache.cache_desc.shape[0]
    return [t.view(np.uint8).reshape(n, -1) for t in cache.tensors]


def digest(cache: Cache, blocks: list[int]) -> str:
    """A digest of the listed blocks (in order) of every tensor."""
    h = hashlib.blake2b(digest_size=16)
    for t in block_bytes(cache):
        h.update(np.ascontiguousarray(t[blocks]).tobytes())
    return h.hexdigest()


class BlockAllocator:
    """The block bookkeeping of one side: a free list; ``allocate`` waits until enough blocks are free."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        order = np.random.default_rng(seed).permutation(num_blocks).tolist()   # scattered, like a real pool
        self.num_blocks = num_blocks
        self._free: collections.deque[int] = collections.deque(order)
        self._changed = asyncio.Condition()

    @property
    def free_count(self) -> int:
        return len(self._free)

    async def allocate(self, n: int) -> list[int]:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._free) >= n)
            return [self._free.popleft() for _ in range(n)]

    async def free(self, blocks: list[int]) -> None:
        async with self._changed:
            self._free.extend(blocks)
            self._changed.notify_all()


async def send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()


async def receive(reader: asyncio.StreamReader) -> dict[str, Any]:
    line = await reader.readline()
    if not line:
        raise ConnectionError("side channel closed")
    message: dict[str, Any] = json.loads(line)
    return message


def cluster_info(remote_cluster_id: int, port: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    return info


# -- prompt (this process) -----------------------------------------------------------------------------------

async def run_prompt() -> int:
    port, side_port = free_port(), free_port()
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 31))
    lengths = rng.integers(40, 160, size=REQUESTS).tolist()          # prompt tokens per request
    allocator = BlockAllocator(PROMPT_BLOCKS, seed)
    in_flight: dict[int, list[int]] = {}                              # req id -> its blocks, until freed
    all_freed = asyncio.Event()
    hello = asyncio.Event()
    conn: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
    freed = 0

    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        config = LLMConfig()
        config.listen_ip_info = f"127.0.0.1:{port}"                   # this instance is a server
        config.sync_kv_timeout = SYNC_KV_TIMEOUT_MS
        await dd.init(config.generate_options())
        cache = dd.cache_manager.allocate_blocks_cache(kv_desc(PROMPT_BLOCKS), BlocksCacheKey(PROMPT_ID, 0))
        kv = block_bytes(cache)
        print(f"[prompt ] pid {os.getpid()}: KV cache {TENSORS} tensors x {PROMPT_BLOCKS} blocks x "
              f"{kv[0].shape[1] // 1024} KiB, listening on 127.0.0.1:{port}; side channel on :{side_port}",
              flush=True)

        async def on_decoder(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal freed
            conn["decoder"] = (reader, writer)
            try:
                while True:
                    message = await receive(reader)
                    if message["type"] == "hello":
                        hello.set()
                    elif message["type"] == "free":
                        req = int(message["req"])
                        blocks = in_flight.pop(req)
                        await allocator.free(blocks)
                        freed += 1
                        print(f"[prompt ] req {req:2d}: decoder is done with it, freed blocks {blocks} "
                              f"({allocator.free_count}/{PROMPT_BLOCKS} free)", flush=True)
                        if freed == REQUESTS:
                            all_freed.set()
                    elif message["type"] == "bye":
                        return
            except ConnectionError:
                return

        side = await asyncio.start_server(on_decoder, "127.0.0.1", side_port)
        decoder = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "decoder", "--port", str(port), "--side-port", str(side_port))

        async def serve() -> None:
            await hello.wait()
            _, writer = conn["decoder"]

            async def prefill(req: int, tokens: int) -> None:
                n = -(-tokens // BLOCK_TOKENS)
                blocks = await allocator.allocate(n)                      # may wait for frees
                await asyncio.sleep(float(rng.uniform(0.002, 0.02)))      # "compute" the KV cache ...
                for t in kv:                                              # ... and write it
                    t[blocks] = rng.integers(1, 256, size=(n, t.shape[1]), dtype=np.uint8)
                in_flight[req] = blocks
                print(f"[prompt ] req {req:2d}: prefilled {tokens} tokens into blocks {blocks}", flush=True)
                await send(writer, {"type": "finished", "req": req, "blocks": blocks, "tokens": tokens,
                                    "digest": digest(cache, blocks)})

            async with asyncio.TaskGroup() as tg:        # requests arrive over time and overlap
                for req, tokens in enumerate(lengths):
                    tg.create_task(prefill(req, tokens))
                    await asyncio.sleep(0.005)
            await all_freed.wait()
            await send(writer, {"type": "done"})

        waiter = asyncio.ensure_future(decoder.wait())
        work = asyncio.ensure_future(serve())
        try:
            async with asyncio.timeout(DEADLINE_S):
                await asyncio.wait([waiter, work], return_when=asyncio.FIRST_COMPLETED)
                if not work.done():
                    raise RuntimeError(f"the decoder exited early with {waiter.result()}")
                work.result()                            # raises if serving failed
                rc = await waiter
        except Exception as exc:  # noqa: BLE001 - TimeoutError, RuntimeError, ConnectionError...
            print(f"[prompt ] FAILED: {exc!r}", flush=True)
            work.cancel()
            if decoder.returncode is None:
                decoder.kill()
            await decoder.wait()
            return 1
        finally:
            side.close()
            if "decoder" in conn:
                conn["decoder"][1].close()
        ok = rc == 0 and not in_flight and allocator.free_count == PROMPT_BLOCKS
        print(f"[prompt ] decoder exited with {rc}; {freed}/{REQUESTS} requests freed, "
              f"{allocator.free_count}/{PROMPT_BLOCKS} blocks free -> {'OK' if ok else 'FAILED'}", flush=True)
        return 0 if ok else 1


# -- decoder (the child process) -----------------------------------------------------------------------------

async def run_decoder(port: int, side_port: int) -> int:
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        config = LLMConfig()
        config.sync_kv_timeout = SYNC_KV_TIMEOUT_MS                   # bounds every pull_blocks
        await dd.init(config.generate_options())
        cache = dd.cache_manager.allocate_blocks_cache(kv_desc(DECODER_BLOCKS))   # caches first, then link
        prompt = cluster_info(PROMPT_ID, port)
        code, per_cluster = await dd.link_clusters([prompt], timeout=3000)
        if code != LLMStatusCode.LLM_SUCCESS:
            print(f"[decoder] link_clusters failed: {code} {per_cluster}", flush=True)
            return 1
        link = dd.links()[0]
        print(f"[decoder] pid {os.getpid()}: linked to cluster {PROMPT_ID} at {link['endpoint']} "
              f"({link['plane']} data plane)", flush=True)
        allocator = BlockAllocator(DECODER_BLOCKS, seed=os.getpid())
        key = BlocksCacheKey(PROMPT_ID, 0)                            # the prompt's cache, model_id 0
        reader, writer = await asyncio.open_connection("127.0.0.1", side_port)
        await send(writer, {"type": "hello"})
        bad: list[int] = []

        async def load(req: int, src_blocks: list[int], expected: str) -> None:
            dst_blocks = await allocator.allocate(len(src_blocks))
            start = time.perf_counter()
            try:
                await dd.cache_manager.pull_blocks(key, cache, src_blocks, dst_blocks)
            except LLMException as exc:
                print(f"[decoder] req {req:2d}: pull_blocks failed: {exc!r}", flush=True)
                bad.append(req)
                await send(writer, {"type": "free", "req": req})      # give up on it; the prompt frees it
                await allocator.free(dst_blocks)
                return
            ms = (time.perf_counter() - start) * 1e3
            ok = digest(cache, dst_blocks) == expected
            if not ok:
                bad.append(req)
            nbytes = len(src_blocks) * TENSORS * (cache.cache_desc.size // DECODER_BLOCKS)
            print(f"[decoder] req {req:2d}: pulled P{src_blocks} -> D{dst_blocks} ({nbytes // 1024} KiB) in "
                  f"{ms:.2f} ms, bytes {'OK' if ok else 'MISMATCH'}", flush=True)
            await send(writer, {"type": "free", "req": req})          # the prompt may reuse the blocks now
            await allocator.free(dst_blocks)                          # (the decode step would run here)

        received = 0
        async with asyncio.TaskGroup() as tg:
            while True:
                message = await receive(reader)
                if message["type"] == "done":
                    break
                received += 1
                tg.create_task(load(int(message["req"]), list(message["blocks"]), str(message["digest"])))
        await send(writer, {"type": "bye"})
        writer.close()
        await dd.unlink_clusters([prompt])                            # the pulling side finishes first
        ok = not bad and received == REQUESTS and allocator.free_count == DECODER_BLOCKS
        print(f"[decoder] {received - len(bad)}/{received} requests verified"
              + (f", bad: {bad}" if bad else ""), flush=True)
        return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", choices=["decoder"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--side-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "decoder":
        return asyncio.run(run_decoder(args.port, args.side_port))
    start = time.perf_counter()
    rc = asyncio.run(run_prompt())
    print(f"[prompt ] {'PASS' if rc == 0 else 'FAIL'} in {time.perf_counter() - start:.2f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
