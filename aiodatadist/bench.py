"""``python -m aiodatadist bench``: throughput and latency against the machine's own limits, same run.

Every figure is a median over repeats and is printed with the baseline measured in the same run: a
single-process ``np.copyto`` of the same number of bytes.  Workloads:

* ``local``: ``copy_blocks`` in one 64-tensor x 256-block x 32 KiB host cache, 128 scattered blocks per tensor
  (256 MiB moved);
* ``pull``: ``pull_blocks`` of the same 256 MiB from a prompt in another process;
* ``small``: a 2 MiB pull (1 block x 64 tensors), latency percentiles;
* ``concurrent``: 64 concurrent 4 MiB pulls (2 blocks x 64 tensors each), aggregate throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from .cache import Cache
from .config import LLMConfig
from .datadist import LLMDataDist
from .errors import LLMStatusCode
from .native import native_available
from .testing import PeerProcess, cluster_info, fill_pattern, free_port
from .types import BlocksCacheKey, CacheDesc, DataType, LLMRole, Placement

__all__ = ["main", "run_bench"]

MIB = 1 << 20
TENSORS = 64
BLOCKS = 256
BLOCK_BYTES = 32 << 10
MOVED_BLOCKS = 128


def _desc() -> CacheDesc:
    return CacheDesc(TENSORS, (BLOCKS, BLOCK_BYTES // 2), DataType.DT_FLOAT16, Placement.HOST)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


async def _median_seconds(fn: Callable[[], Awaitable[Any]], repeat: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        await fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return times


def copyto_baseline(nbytes: int, repeat: int) -> float:
    """Median GB/s of ``np.copyto`` of ``nbytes`` contiguous bytes (pre-faulted arrays)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return _gbps(nbytes, statistics.median(times))


def _scattered_blocks(rng: np.random.Generator) -> tuple[list[int], list[int]]:
    perm = rng.permutation(BLOCKS)
    return perm[:MOVED_BLOCKS].tolist(), perm[MOVED_BLOCKS:].tolist()


async def bench_local(repeat: int) -> dict[str, Any]:
    nbytes = TENSORS * MOVED_BLOCKS * BLOCK_BYTES
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({})
        cache = dd.cache_manager.allocate_blocks_cache(_desc())
        fill_pattern(cache, 1)
        src, dst = _scattered_blocks(np.random.default_rng(0))
        info = {s: [d] for s, d in zip(src, dst)}
        times = await _median_seconds(lambda: dd.cache_manager.copy_blocks(cache, info), repeat)
    baseline = copyto_baseline(nbytes, repeat)
    value = _gbps(nbytes, statistics.median(times))
    return {"workload": "local copy_blocks 256 MiB (64 x 128 scattered 32 KiB blocks)", "bytes": nbytes,
            "gbps": value, "baseline": "np.copyto 256 MiB", "baseline_gbps": baseline, "ratio": value / baseline}


class _RemotePrompt:
    """A prompt in its own process with a filled 64 x 256 x 32 KiB blocks cache (model_id 0)."""

    def __init__(self, peer: PeerProcess, port: int) -> None:
        self.peer = peer
        self.port = port

    @classmethod
    async def start(cls, transport: str) -> _RemotePrompt:
        port = free_port()
        peer = await PeerProcess.start()
        await peer.call("init", role="PROMPT", cluster_id=1, options={
            "llm.listenIpInfo": f"127.0.0.1:{port}", "llm.SyncKvCacheWaitTime": "60000", "llm.Transport": transport})
        reply = await peer.call("allocate", blocks=True, num_tensors=TENSORS, shape=[BLOCKS, BLOCK_BYTES],
                                blocks_key=[1, 0])
        await peer.call("fill", cache_id=reply["cache_id"], seed=3)
        return cls(peer, port)


async def _decoder(prompt: _RemotePrompt, transport: str) -> tuple[LLMDataDist, Cache]:
    dd = LLMDataDist(LLMRole.DECODER, 2)
    cfg = LLMConfig()
    cfg.sync_kv_timeout = 60000
    cfg.transport = transport
    await dd.init(cfg.generate_options())
    code, _ = await dd.link_clusters([cluster_info(1, prompt.port)], timeout=10000)
    if code != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"bench: link failed: {code}")
    return dd, dd.cache_manager.allocate_blocks_cache(_desc())


async def bench_remote(repeat: int, transport: str, workloads: set[str]) -> list[dict[str, Any]]:
    prompt = await _RemotePrompt.start(transport)
    results: list[dict[str, Any]] = []
    try:
        dd, cache = await _decoder(prompt, transport)
        try:
            cm = dd.cache_manager
            key = BlocksCacheKey(1, 0)
            rng = np.random.default_rng(1)
            big = TENSORS * MOVED_BLOCKS * BLOCK_BYTES
            baseline = copyto_baseline(big, repeat)
            plane = dd.links()[0]["plane"]
            single = None
            if workloads & {"pull", "concurrent"}:
                src, dst = _scattered_blocks(rng)
                times = await _median_seconds(lambda: cm.pull_blocks(key, cache, src, dst), repeat)
                single = _gbps(big, statistics.median(times))
                results.append({"workload": f"pull_blocks 256 MiB, other process ({plane})", "bytes": big,
                                "gbps": single, "baseline": "np.copyto 256 MiB", "baseline_gbps": baseline,
                                "ratio": single / baseline})
            if "small" in workloads:
                lat = await _median_seconds(lambda: cm.pull_blocks(key, cache, [7], [9]), max(200, repeat * 20))
                lat_ms = sorted(t * 1e3 for t in lat)
                results.append({"workload": f"pull_blocks 2 MiB (1 block x 64 tensors, {plane})",
                                "bytes": TENSORS * BLOCK_BYTES, "p50_ms": statistics.median(lat_ms),
                                "p99_ms": lat_ms[int(len(lat_ms) * 0.99) - 1], "runs": len(lat_ms)})
            if "concurrent" in workloads and single is not None:
                pairs = rng.permutation(BLOCKS)[:MOVED_BLOCKS].reshape(64, 2).tolist()

                async def burst() -> None:
                    await asyncio.gather(*(cm.pull_blocks(key, cache, p, p) for p in pairs))

                times = await _median_seconds(burst, repeat)
                agg = _gbps(big, statistics.median(times))
                results.append({"workload": f"64 concurrent pull_blocks of 4 MiB ({plane})", "bytes": big,
                                "gbps": agg, "baseline": "single 256 MiB pull_blocks", "baseline_gbps": single,
                                "ratio": agg / single})
        finally:
            await dd.finalize()
    finally:
        await prompt.peer.close()
    return results


async def run_bench(workloads: set[str], repeat: int, transport: str = "auto") -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    if "local" in workloads:
        results.append(await bench_local(repeat))
    if workloads & {"pull", "small", "concurrent"}:
        results.extend(await bench_remote(repeat, transport, workloads))
    return results


def _print(results: list[dict[str, Any]], out: Any) -> None:
    for r in results:
        if "gbps" in r:
            out.write(f"{r['workload']:<62} {r['gbps']:7.2f} GB/s   {r['baseline']}: {r['baseline_gbps']:6.2f} GB/s"
                      f"   ratio {r['ratio']:.2f}\n")
        else:
            out.write(f"{r['workload']:<62} p50 {r['p50_ms']:.3f} ms   p99 {r['p99_ms']:.3f} ms"
                      f"   ({r['runs']} runs)\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiodatadist bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                        help="local, pull, small, concurrent (default: all)")
    parser.add_argument("--repeat", type=int, default=7, help="repeats per figure (median reported)")
    parser.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp"])
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    known = ["local", "pull", "small", "concurrent"]
    unknown = set(args.workloads) - set(known)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {known}")
    workloads = set(args.workloads or known)
    sys.stdout.write(f"aiodatadist bench: repeat={args.repeat}, native copier={'yes' if native_available() else 'no'}\n")
    results = asyncio.run(run_bench(workloads, args.repeat, args.transport))
    _print(results, sys.stdout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
