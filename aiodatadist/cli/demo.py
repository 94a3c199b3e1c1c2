"""``python -m aiodatadist demo``: a prompt process and a decoder process move a paged KV cache.

The prompt allocates a paged KV cache (32 layers x K,V = 64 tensors), writes every request's blocks and
listens; the decoder links to it, pulls every request's blocks concurrently (``pull_blocks`` by
``BlocksCacheKey``, ``src_blocks -> dst_blocks``), checks every byte and prints a report.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import numpy as np

from ..config import LLMConfig
from ..datadist import LLMDataDist
from ..errors import LLMStatusCode
from ..testing import cluster_info, fill_pattern, free_port, pattern
from ..types import BlocksCacheKey, CacheDesc, DataType, LLMRole, Placement

__all__ = ["main"]

LAYERS = 32
TENSORS = 2 * LAYERS          # K0, V0, K1, V1, ...
BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 16, 4, 128   # one block = 16 tokens x 4 heads x 128 x fp16 = 16 KiB
PROMPT_ID, DECODER_ID = 1, 2
SEED = 2024


def _desc(num_blocks: int) -> CacheDesc:
    return CacheDesc(TENSORS, (num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM), DataType.DT_FLOAT16, Placement.HOST)


def block_tables(requests: int, blocks_per_request: int, num_blocks: int) -> tuple[list[list[int]], list[list[int]]]:
    """Where each request's blocks live on the prompt and where the decoder puts them (both scattered)."""
    rng = np.random.default_rng(SEED)
    need = requests * blocks_per_request
    src = rng.permutation(num_blocks)[:need].reshape(requests, blocks_per_request).tolist()
    dst = rng.permutation(num_blocks)[:need].reshape(requests, blocks_per_request).tolist()
    return src, dst


async def run_prompt(port: int, num_blocks: int) -> None:
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        cfg = LLMConfig()
        cfg.listen_ip_info = f"127.0.0.1:{port}"
        await dd.init(cfg.generate_options())
        cache = dd.cache_manager.allocate_blocks_cache(_desc(num_blocks), BlocksCacheKey(PROMPT_ID, 0))
        fill_pattern(cache, SEED)  # stands in for the prefill computing the KV cache
        print(f"[prompt  pid] KV cache ready: {TENSORS} tensors x {num_blocks} blocks x "
              f"{cache.cache_desc.size // num_blocks // 1024} KiB, listening on 127.0.0.1:{port}", flush=True)
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until the demo is over


async def run_decoder(port: int, num_blocks: int, requests: int, blocks_per_request: int) -> int:
    src_tables, dst_tables = block_tables(requests, blocks_per_request, num_blocks)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        cfg = LLMConfig()
        cfg.sync_kv_timeout = 30000
        await dd.init(cfg.generate_options())
        code, _ = await dd.link_clusters([cluster_info(PROMPT_ID, port)], timeout=5000)
        if code != LLMStatusCode.LLM_SUCCESS:
            print(f"[decoder] link failed: {code}")
            return 1
        link = dd.links()[0]
        print(f"[decoder] linked to cluster {PROMPT_ID} at {link['endpoint']}: {link['plane']} data plane, "
              f"{link['peer']}")
        cache = dd.cache_manager.allocate_blocks_cache(_desc(num_blocks))
        key = BlocksCacheKey(PROMPT_ID, 0)
        latencies: list[float] = []

        async def pull(i: int) -> None:
            start = time.perf_counter()
            await dd.cache_manager.pull_blocks(key, cache, src_tables[i], dst_tables[i])
            latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(pull(i) for i in range(requests)))
        elapsed = time.perf_counter() - start
        block_bytes = cache.cache_desc.size // num_blocks
        moved = requests * blocks_per_request * block_bytes * TENSORS
        bad = 0
        src_idx = np.asarray(src_tables).reshape(-1)
        dst_idx = np.asarray(dst_tables).reshape(-1)
        for t, tensor in enumerate(cache.tensors):
            expected = pattern(SEED, t, tensor.nbytes).reshape(num_blocks, -1)
            got = tensor.view(np.uint8).reshape(num_blocks, -1)
            bad += int((got[dst_idx] != expected[src_idx]).any(axis=1).sum())
        lat_ms = sorted(x * 1e3 for x in latencies)
        print(f"[decoder] requests: {requests} x {blocks_per_request} blocks x {TENSORS} tensors "
              f"(block {block_bytes // 1024} KiB)")
        print(f"[decoder] moved {moved / 2**20:.0f} MiB in {elapsed * 1e3:.1f} ms: {moved / elapsed / 1e9:.2f} GB/s")
        print(f"[decoder] per-request latency: p50 {statistics.median(lat_ms):.2f} ms, "
              f"p99 {lat_ms[max(0, int(len(lat_ms) * 0.99) - 1)]:.2f} ms")
        print(f"[decoder] verified every byte: {'OK' if bad == 0 else f'{bad} corrupted blocks'}")
        return 0 if bad == 0 else 1


async def orchestrate(requests: int, blocks_per_request: int, num_blocks: int) -> int:
    port = free_port()
    common = ["--port", str(port), "--num-blocks", str(num_blocks), "--requests", str(requests),
              "--blocks-per-request", str(blocks_per_request)]
    prompt = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiodatadist", "demo", "--role", "prompt", *common,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert prompt.stdout is not None and prompt.stdin is not None
    try:
        while True:
            line = (await prompt.stdout.readline()).decode()
            if not line:
                print("[demo] the prompt process exited early")
                return 1
            if line.strip() == "READY":
                break
            sys.stdout.write(line.replace("pid]", f"{prompt.pid}]"))
        decoder = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aiodatadist", "demo", "--role", "decoder", *common)
        return await decoder.wait()
    finally:
        prompt.stdin.close()
        await prompt.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiodatadist demo", description=__doc__)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--blocks-per-request", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--role", choices=["prompt", "decoder"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.requests * args.blocks_per_request > args.num_blocks:
        parser.error("requests x blocks-per-request must not exceed num-blocks")
    if args.role == "prompt":
        asyncio.run(run_prompt(args.port, args.num_blocks))
        return 0
    if args.role == "decoder":
        return asyncio.run(run_decoder(args.port, args.num_blocks, args.requests, args.blocks_per_request))
    print(f"[demo] prompt -> decoder KV-cache transfer: {args.requests} requests, {LAYERS} layers x K,V, "
          f"two processes on 127.0.0.1")
    return asyncio.run(orchestrate(args.requests, args.blocks_per_request, args.num_blocks))
