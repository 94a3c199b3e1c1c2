"""Push: the prompt writes KV blocks straight into the decoder's paged cache with ``push_blocks``.

Run it with no arguments::

    python examples/push_blocks.py

This process is the **decoder**: it allocates a paged KV cache registered as
``BlocksCacheKey(DECODER_ID, 0)``, zeroes it and listens.  It starts a second process running this file as
the **prompt**, which links to the decoder (``link_clusters``), fills its own blocks cache with random bytes
and pushes three requests:

* ``A``: whole blocks, every layer:
  ``push_blocks(BlocksCacheKey(DECODER_ID, 0), cache, src_blocks, dst_blocks)``;
* ``B``: layer by layer, as a prefill would finish them: one ``push_blocks`` per layer with
  ``src_layer_range=range(l, l + 1), dst_layer_range=range(l, l + 1), tensor_num_per_layer=2`` (K and V);
* ``C``: only layers 1 and 2 (``range(1, 3)``), e.g. the part of the model one pipeline stage owns;

and then one push to a block the decoder does not have, which must fail with ``LLM_PARAM_INVALID`` without
touching the decoder's cache.  After the prompt has unlinked and exited (when the prompt pushes, the
decoder must outlive it), the decoder checks every byte of its cache: the pushed blocks and layers hold the
prompt's bytes and everything else is still zero.

Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass

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
LAYERS = 4
N = 2                                     # tensor_num_per_layer: K and V
TENSORS = N * LAYERS                      # K0, V0, K1, V1, ...
BLOCK_SHAPE = (16, 2, 64)                 # tokens x kv heads x head dim, fp16: 4 KiB per block and tensor
PROMPT_BLOCKS, DECODER_BLOCKS = 24, 32
SYNC_KV_TIMEOUT_MS = 3000
DEADLINE_S = 30.0


@dataclass(frozen=True)
class Push:
    name: str
    src_blocks: list[int]
    dst_blocks: list[int]
    layers: range | None                  # None: every layer, in one call
    layer_wise: bool = False              # one push_blocks per layer


PUSHES = [
    Push("A", [3, 4, 5, 9], [10, 11, 12, 20], None),
    Push("B", [12, 13, 14], [0, 1, 7], range(LAYERS), layer_wise=True),
    Push("C", [20, 21], [25, 26], range(1, 3)),
]
BAD_DST_BLOCK = DECODER_BLOCKS + 8        # the decoder has no such block


def kv_desc(num_blocks: int) -> CacheDesc:
    return CacheDesc(TENSORS, (num_blocks, *BLOCK_SHAPE), DataType.DT_FLOAT16, Placement.HOST)


def block_bytes(cache: Cache) -> list[np.ndarray]:
    """Per tensor, a ``(num_blocks, bytes_per_block)`` uint8 view of the cache."""
    n = cache.cache_desc.shape[0]
    return [t.view(np.uint8).reshape(n, -1) for t in cache.tensors]


def prompt_bytes(seed: int) -> np.ndarray:
    """The prompt's KV bytes, ``(tensors, blocks, bytes_per_block)``: random, never 0."""
    nbytes = kv_desc(PROMPT_BLOCKS).size // PROMPT_BLOCKS
    return np.random.default_rng(seed).integers(1, 256, size=(TENSORS, PROMPT_BLOCKS, nbytes), dtype=np.uint8)


def tensors_of(layers: range | None) -> range:
    layers = layers if layers is not None else range(LAYERS)
    return range(layers.start * N, layers.stop * N)


def cluster_info(remote_cluster_id: int, port: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    return info


def config(listen_port: int | None = None) -> LLMConfig:
    cfg = LLMConfig()
    cfg.sync_kv_timeout = SYNC_KV_TIMEOUT_MS          # bounds every push_blocks call
    cfg.enable_remote_cache_accessible = True         # push needs it (on both ends in the reference)
    if listen_port is not None:
        cfg.listen_ip_info = f"127.0.0.1:{listen_port}"
    return cfg


# -- decoder (this process, the server) ----------------------------------------------------------------------

async def run_decoder() -> int:
    port = free_port()
    seed = int(np.random.default_rng().integers(1 << 31))
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(config(listen_port=port).generate_options())
        cache = dd.cache_manager.allocate_blocks_cache(kv_desc(DECODER_BLOCKS), BlocksCacheKey(DECODER_ID, 0))
        kv = block_bytes(cache)
        for tensor in kv:
            tensor[:] = 0
        print(f"[decoder] pid {os.getpid()}: KV cache {TENSORS} tensors ({LAYERS} layers x K,V) x "
              f"{DECODER_BLOCKS} blocks x {kv[0].shape[1] // 1024} KiB, zeroed, "
              f"listening on 127.0.0.1:{port}",
              flush=True)
        prompt = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "prompt", "--port", str(port), "--seed", str(seed))
        try:
            rc = await asyncio.wait_for(prompt.wait(), DEADLINE_S)
        except TimeoutError:
            print(f"[decoder] FAILED: the prompt did not finish in {DEADLINE_S} s", flush=True)
            prompt.kill()
            await prompt.wait()
            return 1
        print(f"[decoder] the prompt exited with {rc}; checking every byte of the cache", flush=True)

        source = prompt_bytes(seed)
        expected = np.zeros((TENSORS, *kv[0].shape), dtype=np.uint8)
        failures = 0
        for push in PUSHES:
            for t in tensors_of(push.layers):
                expected[t, push.dst_blocks] = source[t, push.src_blocks]
            got = np.stack([kv[t][push.dst_blocks] for t in range(TENSORS)])
            ok = np.array_equal(got, expected[:, push.dst_blocks])
            failures += not ok
            layers = tensors_of(push.layers)
            print(f"[decoder] push {push.name}: blocks D{push.dst_blocks} hold P{push.src_blocks} in layers "
                  f"{layers.start // N}..{layers.stop // N - 1}, zeros elsewhere: "
                  f"{'OK' if ok else 'MISMATCH'}",
                  flush=True)
        untouched = [b for b in range(DECODER_BLOCKS) if all(b not in p.dst_blocks for p in PUSHES)]
        clean = all(not kv[t][untouched].any() for t in range(TENSORS))
        whole = all(np.array_equal(kv[t], expected[t]) for t in range(TENSORS))
        print(f"[decoder] {len(untouched)} blocks nobody pushed to are still zero: "
              f"{'OK' if clean else 'NO'}; "
              f"whole cache as expected: {'OK' if whole else 'NO'}", flush=True)
        return 0 if rc == 0 and failures == 0 and clean and whole else 1


# -- prompt (the child process, the client) ------------------------------------------------------------------

async def run_prompt(port: int, seed: int) -> int:
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        await dd.init(config().generate_options())
        cache = dd.cache_manager.allocate_blocks_cache(kv_desc(PROMPT_BLOCKS))   # caches first, then link
        kv = block_bytes(cache)
        source = prompt_bytes(seed)
        layer_wise = {b for p in PUSHES if p.layer_wise for b in p.src_blocks}
        for t, tensor in enumerate(kv):          # "prefill" everything but the layer-wise request's blocks
            rows = [b for b in range(PROMPT_BLOCKS) if b not in layer_wise]
            tensor[rows] = source[t, rows]
        decoder = cluster_info(DECODER_ID, port)
        code, per_cluster = await dd.link_clusters([decoder], timeout=3000)
        if code != LLMStatusCode.LLM_SUCCESS:
            print(f"[prompt ] link_clusters failed: {code} {per_cluster}", flush=True)
            return 1
        print(f"[prompt ] pid {os.getpid()}: linked to decoder cluster {DECODER_ID} at 127.0.0.1:{port}",
              flush=True)
        key = BlocksCacheKey(DECODER_ID, 0)                 # the decoder's cache, model_id 0
        manager = dd.cache_manager

        for push in PUSHES:
            start = time.perf_counter()
            if push.layers is None:
                await manager.push_blocks(key, cache, push.src_blocks, push.dst_blocks)
                how = "all layers, one call"
            elif push.layer_wise:
                for layer in push.layers:
                    for t in tensors_of(range(layer, layer + 1)):       # layer `layer` is computed ...
                        kv[t][push.src_blocks] = source[t, push.src_blocks]
                    await manager.push_blocks(key, cache, push.src_blocks, push.dst_blocks,   # ... and sent
                                              src_layer_range=range(layer, layer + 1),
                                              dst_layer_range=range(layer, layer + 1), tensor_num_per_layer=N)
                how = f"{len(push.layers)} calls, src/dst_layer_range=range(l, l + 1)"
            else:
                await manager.push_blocks(key, cache, push.src_blocks, push.dst_blocks,
                                          src_layer_range=push.layers, dst_layer_range=push.layers,
                                          tensor_num_per_layer=N)
                how = f"src/dst_layer_range={push.layers}"
            ms = (time.perf_counter() - start) * 1e3
            print(f"[prompt ] push {push.name}: P{push.src_blocks} -> D{push.dst_blocks} ({how}) "
                  f"in {ms:.2f} ms", flush=True)

        try:
            await manager.push_blocks(key, cache, [0], [BAD_DST_BLOCK])
            print(f"[prompt ] push to block {BAD_DST_BLOCK}: unexpectedly succeeded", flush=True)
            return 1
        except LLMException as exc:
            if exc.status_code != LLMStatusCode.LLM_PARAM_INVALID:
                print(f"[prompt ] push to block {BAD_DST_BLOCK}: wrong error {exc!r}", flush=True)
                return 1
            print(f"[prompt ] push to block {BAD_DST_BLOCK} rejected as expected: {exc.status_code}: {exc}",
                  flush=True)
        code, _ = await dd.unlink_clusters([decoder])
        print(f"[prompt ] unlinked: {code}", flush=True)
        return 0 if code == LLMStatusCode.LLM_SUCCESS else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", choices=["prompt"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "prompt":
        return asyncio.run(run_prompt(args.port, args.seed))
    start = time.perf_counter()
    rc = asyncio.run(run_decoder())
    print(f"[decoder] {'PASS' if rc == 0 else 'FAIL'} in {time.perf_counter() - start:.2f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
