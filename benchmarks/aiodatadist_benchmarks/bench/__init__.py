"""``python -m aiodatadist bench``: throughput and latency against the machine's own limits, same run.

Every figure is a median over ``--repeat`` runs, printed with a baseline measured in the same run: a
single-process ``np.copyto`` of the same bytes for the same-host plane (``shm``), the TCP ceiling for ``tcp``:
native streams of the same bytes between two processes over as many loopback connections as the link's data
plane uses, one round after each run of the workload (:mod:`.tcp_ceiling`; a Python fallback, named as such,
without a C compiler).  Same-host throughput rows are also compared with the machine's
copy limit (:class:`.baselines.StreamCopy`), measured in turn with the workload, one copy after each of its
runs: on buffers of its own, and within the local cache's own memory (its first 256 MiB onto the next), since on
a VM two buffers of one process can differ in bandwidth by a third.  The prompt runs in its own process.
Workloads:

* ``local``: ``copy_blocks`` in one 64-tensor x 256-block x 32 KiB host cache, 128 scattered blocks per tensor
  (256 MiB moved), no link;
* ``paged``: ``pull_blocks`` / ``push_blocks`` of 64 tensors x 128 scattered 32 KiB blocks (256 MiB);
* ``whole``: ``pull_cache`` / ``push_cache`` of a 64 x 4 MiB contiguous cache (256 MiB);
* ``small``: a 2 MiB transfer (1 block x 64 tensors), latency percentiles, back to back and then with the event
  loop idle for :data:`SPACED_S` before each call (as a serving engine's transfers come: the copy threads have
  stopped spinning for work by then, and a VM's idle vCPUs have halted);
* ``concurrent``: ``--concurrency`` (64) concurrent 4 MiB ``pull_blocks`` / ``push_blocks``, aggregate throughput
  against the single paged figure;
* ``calls``: what a call costs around its bytes: ``pull_blocks`` / ``push_blocks`` of tiny 64-byte blocks of a
  64-tensor cache, 1 block (64 spans) and 128 scattered blocks (8192 spans), then both sizes again with other
  blocks each call (a new plan each call, as a serving engine's requests have), called in turn, and, measured
  apart after them, for pulls, ``pull_cache`` of a 64 x 64-byte slot by ``CacheKey`` (a request key the owner
  releases: one control round trip every call), then, both ways, 128 other blocks each call of memory the peer registered
  (an engine's KV: caller-owned, reached with ``process_vm_readv``/``writev`` on one host, its directory row a
  table of its tensors); per-call p50/p99, and the marginal cost of a span.

``--peers`` also runs NIXL (extra ``peers``) on the same workloads in the same run and prints the ratio
aiodatadist / NIXL: ``shm`` against NIXL's default UCX backend, ``tcp`` against UCX restricted to TCP.

``--transport nixl`` runs the workloads on aiodatadist's nixl plane (extra ``nixl``), and always the raw NIXL
harness (:mod:`.peers`, UCX defaults, prepared descriptor lists) on the same workloads in the same run beside it:
``vs nixl-ucx`` is aiodatadist-on-NIXL / raw NIXL.  Both ends' caches are then *registered* numpy memory, as the
harness's (an engine's tensors; numpy asks for transparent huge pages), not ``allocate_*`` caches (memfd shared
memory in 4 KiB pages, which UCX's ``process_vm_readv`` reads about 15 % slower here).

``bench cluster`` runs N prompt and M decoder processes under a request stream (:mod:`.cluster`).

``bench vllm`` (vLLM installed: ``scripts/vllm_tests.sh``) is another benchmark with its own options: prefill and
decode vLLM engines with NixlConnector and with aiodatadist's connector (:mod:`.vllm_pd`).  ``bench sglang``
(SGLang installed: ``scripts/sglang_tests.sh``) does the same for SGLang's transfer backends (:mod:`.sglang_pd`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np

from aiodatadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import PeerProcess, cluster_info, fill_pattern, free_port, probes

from .baselines import StreamCopy, copyto_gbps
from .baselines import gbps as _gbps
from .tcp_ceiling import TcpCeiling
from .timing import interleaved_times, stderr_progress
from .timing import times as _times

__all__ = ["main", "run_bench"]

MIB = 1 << 20
TENSORS = 64
BLOCKS = 256
BLOCK_BYTES = 32 << 10
MOVED_BLOCKS = 128
SLOT_BYTES = 4 * MIB
BIG = TENSORS * MOVED_BLOCKS * BLOCK_BYTES  # 256 MiB
WORKLOADS = ("local", "paged", "whole", "small", "concurrent", "calls")
TINY_BYTES = 64  # the calls workload: blocks this small measure the call, not the copy
CALL_SPANS = (64, 8192)
SPACED_S = 1e-3  # the spaced small row: the loop idles this long before each call
ALIASES = {"pull": "paged"}  # the name of the paged workload in earlier versions
PROMPT, DECODER = 1, 2
COUNTERPART = {"shm": "nixl-ucx", "tcp": "nixl-ucx-tcp", "nixl": "nixl-ucx"}  # the NIXL harness each is compared to
SAME_HOST = ("shm", "-", "nixl")  # rows whose bytes move within this machine's memory (nixl: cma reads here)

Progress = Callable[[str], None]


def _blocks_desc() -> CacheDesc:
    return CacheDesc(TENSORS, (BLOCKS, BLOCK_BYTES), DataType.DT_UINT8, Placement.HOST)


def _tiny_desc() -> CacheDesc:
    return CacheDesc(TENSORS, (BLOCKS, TINY_BYTES), DataType.DT_UINT8, Placement.HOST)


def _keyed_desc(slots: int) -> CacheDesc:
    """A contiguous cache of ``slots`` tiny slots (one per request key) for pulls by ``CacheKey``."""
    return CacheDesc(TENSORS, (slots, TINY_BYTES), DataType.DT_UINT8, Placement.HOST)


def _slot_desc() -> CacheDesc:
    return CacheDesc(TENSORS, (1, SLOT_BYTES), DataType.DT_UINT8, Placement.HOST)


def _scattered(rng: np.random.Generator) -> tuple[list[int], list[int]]:
    perm = rng.permutation(BLOCKS)
    return perm[:MOVED_BLOCKS].tolist(), perm[MOVED_BLOCKS:].tolist()


def _within(cache: Cache, nbytes: int) -> StreamCopy | None:
    """The streaming-copy limit on a cache's own memory: its first ``nbytes`` copied onto the next ``nbytes``
    (None where the cache's tensors do not follow each other in memory, or are too small)."""
    addrs = cache.tensor_addrs
    size = cache.cache_desc.size
    if not size or any(b - a != size for a, b in itertools.pairwise(addrs)) or size * len(addrs) < 2 * nbytes:
        return None
    return StreamCopy.create(nbytes, probes.copy_threads(), (addrs[0] + nbytes, addrs[0]),
                             f"streaming copy {nbytes >> 20} MiB within the local cache")


class Instrument(Protocol):
    """A limit measured in turn with a workload: ``nbytes`` moved once per :meth:`seconds` call."""

    name: str
    nbytes: int

    def seconds(self) -> float: ...


async def _with_limit(fn: Callable[[], Awaitable[Any]], nbytes: int, repeat: int, limit: Instrument | None,
                      same_memory: Instrument | None = None) -> tuple[float, dict[str, Any]]:
    """GB/s of ``fn`` (``nbytes`` a call, median of ``repeat`` calls after one), and the fields of the row that
    compare it with ``limit`` (the streaming-copy limit, or the TCP ceiling) and (``same_memory``) the same copy
    within the local cache's own memory, each measured in turn with it (none without them)."""
    await fn()
    work: list[float] = []
    bounds: list[list[float]] = [[], []]
    for _ in range(repeat):
        start = time.perf_counter()
        await fn()
        work.append(time.perf_counter() - start)
        for instrument, samples in zip((limit, same_memory), bounds):
            if instrument is not None:
                samples.append(instrument.seconds())
    value = _gbps(nbytes, statistics.median(work))
    fields: dict[str, Any] = {}
    for instrument, samples, key in zip((limit, same_memory), bounds, ("limit", "same_memory")):
        if instrument is not None:
            gbps = _gbps(instrument.nbytes, statistics.median(samples))
            fields.update({key: instrument.name, f"{key}_gbps": gbps, f"{key}_ratio": value / gbps})
    return value, fields


async def bench_local(repeat: int, baseline: float, limit: StreamCopy | None = None) -> dict[str, Any]:
    async with LLMDataDist(LLMRole.PROMPT, PROMPT) as dd:
        await dd.init({})
        cache = dd.cache_manager.allocate_blocks_cache(_blocks_desc())
        fill_pattern(cache, 1)
        src, dst = _scattered(np.random.default_rng(0))
        info = {s: [d] for s, d in zip(src, dst)}
        value, limits = await _with_limit(lambda: dd.cache_manager.copy_blocks(cache, info), BIG, repeat, limit,
                                          _within(cache, BIG) if limit is not None else None)
    return {"workload": "local", "transport": "-", "direction": "-", "bytes": BIG, "gbps": value,
            "baseline": "np.copyto 256 MiB", "baseline_gbps": baseline, "ratio": value / baseline, **limits}


class _Session:
    """A prompt process and a decoder here, linked over one transport, with paged and contiguous caches."""

    def __init__(self, peer: PeerProcess, dd: LLMDataDist, blocks: Cache, slots: Cache, remote_slots: int,
                 buffers: list[np.ndarray], tiny: Cache, keyed: Cache, make: str) -> None:
        self.peer, self.dd, self.blocks, self.slots, self.remote_slots = peer, dd, blocks, slots, remote_slots
        self.tiny = tiny  # 64-byte blocks (the calls workload)
        self.keyed = keyed  # one tiny slot that pulls by CacheKey land in
        self.buffers = buffers  # registered memory (nixl): alive as long as the caches
        self.make = make  # how the peer makes its caches: "allocate", or "register" (nixl)
        self._next_req_id = 0  # request keys bound so far (pulls by CacheKey)
        self._registered = False  # the peer registered its tiny blocks cache of its own memory

    @classmethod
    async def start(cls, transport: str) -> _Session:
        port = free_port()
        peer = await PeerProcess.start()
        try:
            await peer.call("init", role="PROMPT", cluster_id=PROMPT, options={
                "llm.listenIpInfo": f"127.0.0.1:{port}", "llm.SyncKvCacheWaitTime": "120000",
                "llm.Transport": transport})
            make = "register" if transport == "nixl" else "allocate"  # registered: as the raw NIXL harness
            blocks = await peer.call(make, blocks=True, num_tensors=TENSORS, shape=[BLOCKS, BLOCK_BYTES],
                                     blocks_key=[PROMPT, 0])
            await peer.call("fill", cache_id=blocks["cache_id"], seed=3)
            slots = await peer.call(make, num_tensors=TENSORS, shape=[1, SLOT_BYTES])
            await peer.call("fill", cache_id=slots["cache_id"], seed=4)
            tiny = await peer.call(make, blocks=True, num_tensors=TENSORS, shape=[BLOCKS, TINY_BYTES],
                                   blocks_key=[PROMPT, 1])
            await peer.call("fill", cache_id=tiny["cache_id"], seed=7)
            dd = LLMDataDist(LLMRole.DECODER, DECODER)
            cfg = LLMConfig()
            cfg.sync_kv_timeout = 120000
            cfg.transport = transport
            await dd.init(cfg.generate_options())
            code, _ = await dd.link_clusters([cluster_info(PROMPT, port)], timeout=20000)
            if code != LLMStatusCode.LLM_SUCCESS:
                await dd.finalize()
                raise RuntimeError(f"bench: link failed: {code}")
        except BaseException:
            await peer.close()
            raise
        cm = dd.cache_manager
        buffers: list[np.ndarray] = []
        if transport == "nixl":
            buffers = [np.zeros(d.size, dtype=np.uint8)
                       for d in (_blocks_desc(), _slot_desc(), _tiny_desc(), _keyed_desc(1)) for _ in range(TENSORS)]
            addrs = [int(b.ctypes.data) for b in buffers]
            local_blocks = cm.register_blocks_cache(_blocks_desc(), addrs[:TENSORS], BlocksCacheKey(DECODER, 0))
            local_slots = cm.register_cache(_slot_desc(), addrs[TENSORS:2 * TENSORS])
            local_tiny = cm.register_blocks_cache(_tiny_desc(), addrs[2 * TENSORS:3 * TENSORS],
                                                  BlocksCacheKey(DECODER, 1))
            local_keyed = cm.register_cache(_keyed_desc(1), addrs[3 * TENSORS:])
        else:
            local_blocks = cm.allocate_blocks_cache(_blocks_desc(), BlocksCacheKey(DECODER, 0))
            local_slots = cm.allocate_cache(_slot_desc())
            local_tiny = cm.allocate_blocks_cache(_tiny_desc(), BlocksCacheKey(DECODER, 1))
            local_keyed = cm.allocate_cache(_keyed_desc(1))
        fill_pattern(local_tiny, 8)
        fill_pattern(local_blocks, 5)
        fill_pattern(local_slots, 6)
        return cls(peer, dd, local_blocks, local_slots, int(slots["cache_id"]), buffers, local_tiny, local_keyed,
                   make)

    def paged(self, direction: str, src: list[int], dst: list[int]) -> Awaitable[None]:
        cm, key = self.dd.cache_manager, BlocksCacheKey(PROMPT, 0)
        if direction == "pull":
            return cm.pull_blocks(key, self.blocks, src, dst)
        return cm.push_blocks(key, self.blocks, src, dst)

    def call(self, direction: str, src: list[int], dst: list[int]) -> Awaitable[None]:
        """A transfer of tiny blocks: its time is the call's, not the copy's."""
        cm, key = self.dd.cache_manager, BlocksCacheKey(PROMPT, 1)
        if direction == "pull":
            return cm.pull_blocks(key, self.tiny, src, dst)
        return cm.push_blocks(key, self.tiny, src, dst)

    async def request_keys(self, count: int) -> Callable[[], Awaitable[None]]:
        """A call per key: ``pull_cache`` by ``CacheKey`` of one of ``count`` request keys the peer binds now (to
        the slots of a tiny contiguous cache), each pulled once, as a decoder pulls a finished prefill (through
        the owner, which releases the key before the call returns)."""
        first = self._next_req_id
        self._next_req_id += count
        keyed = await self.peer.call(self.make, num_tensors=TENSORS, shape=[count, TINY_BYTES],
                                     keys=[[PROMPT, first + i] for i in range(count)])
        await self.peer.call("fill", cache_id=keyed["cache_id"], seed=9)
        req_ids = iter(range(first, first + count))
        cm = self.dd.cache_manager

        def pull() -> Awaitable[None]:
            return cm.pull_cache(CacheKey(PROMPT, next(req_ids)), self.keyed, 0)
        return pull

    async def registered_calls(self, direction: str, count: int, runs: int) -> Callable[[], Awaitable[None]]:
        """A call per pull or push of ``count`` other blocks each call (random, distinct on each side) of a tiny
        blocks cache the peer registered from its own memory (numpy arrays), as an engine's KV is."""
        if not self._registered:
            await self.peer.call("register", blocks=True, num_tensors=TENSORS, shape=[BLOCKS, TINY_BYTES],
                                 blocks_key=[PROMPT, 2])
            self._registered = True
        rng = np.random.default_rng(12)
        picks = iter([(rng.choice(BLOCKS, count, replace=False).tolist(),
                       rng.choice(BLOCKS, count, replace=False).tolist()) for _ in range(runs)])
        cm, key = self.dd.cache_manager, BlocksCacheKey(PROMPT, 2)
        if direction == "pull":
            return lambda: cm.pull_blocks(key, self.tiny, *next(picks))
        return lambda: cm.push_blocks(key, self.tiny, *next(picks))

    def whole(self, direction: str) -> Awaitable[None]:
        key = CacheKeyByIdAndIndex(PROMPT, self.remote_slots, 0)
        if direction == "pull":
            return self.dd.cache_manager.pull_cache(key, self.slots, 0)
        return self.dd.cache_manager.push_cache(key, self.slots, 0)

    async def close(self) -> None:
        try:
            await self.dd.finalize()
        finally:
            await self.peer.close()


async def bench_transport(transport: str, directions: list[str], workloads: set[str], repeat: int,
                          concurrency: int, baseline: tuple[str, float] | None, progress: Progress,
                          limit: StreamCopy | None = None) -> list[dict[str, Any]]:
    """Measure ``workloads`` on one linked pair over ``transport``; the throughput rows are compared with
    ``baseline`` (None: the TCP ceiling over the link's own data connections, :func:`tcp_baseline`), and the
    same-host ones with ``limit`` too, measured in turn with them."""
    session = await _Session.start(transport)
    rows: list[dict[str, Any]] = []
    ceiling = None
    try:
        if baseline is None:
            ceiling = await tcp_ceiling_of(session.dd, progress)
        rng = np.random.default_rng(1)
        for direction in directions:
            rows.extend(await _measure(session, direction, workloads, repeat, concurrency, baseline, rng, progress,
                                       ceiling or limit))
    finally:
        if ceiling is not None:
            ceiling.close()
        await session.close()
    return rows


async def tcp_ceiling_of(dd: LLMDataDist, progress: Progress) -> TcpCeiling:
    """The TCP ceiling of the rows of ``dd``'s (only) link, started: native streams of the same bytes between
    two processes over as many connections as the link's data plane opened, with their congestion control
    (:mod:`.tcp_ceiling`), measured in turn with each workload."""
    link = dd.links()[0]
    connections = max(1, int(str(link["data_connections"])))
    congestion = link["data_congestion"]
    progress(f"baseline: native TCP streams 256 MiB between two processes over {connections} connections (the "
             f"link's data connections, congestion control {congestion or 'of the system'}), measured in turn "
             "with each workload")
    return await asyncio.to_thread(TcpCeiling.start, BIG, connections,
                                   None if congestion is None else str(congestion), progress)


def _as_baseline(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields of a row's limit measured in turn with it (the TCP ceiling), as the row's baseline."""
    return {"baseline": fields["limit"], "baseline_gbps": fields["limit_gbps"], "ratio": fields["limit_ratio"]}


async def _measure(session: _Session, direction: str, workloads: set[str], repeat: int, concurrency: int,
                   baseline: tuple[str, float] | None, rng: np.random.Generator, progress: Progress,
                   limit: Instrument | None = None) -> list[dict[str, Any]]:
    """The rows of one direction.  The throughput rows are compared with ``baseline``; without one (tcp),
    ``limit`` is the TCP ceiling, measured in turn with them and printed as their baseline.  Otherwise a
    same-host row is also compared with ``limit``, the streaming-copy limit, measured in turn with it."""
    plane = session.dd.links()[0]["plane"]
    if baseline is not None and plane not in SAME_HOST:
        limit = None
    same_memory = _within(session.blocks, BIG) if limit is not None and baseline is not None else None
    rows: list[dict[str, Any]] = []

    def row(workload: str, nbytes: int, **values: Any) -> None:
        rows.append({"workload": workload, "transport": plane, "direction": direction, "bytes": nbytes, **values})

    async def throughput(workload: str, fn: Callable[[], Awaitable[Any]]) -> float:
        value, limits = await _with_limit(fn, BIG, repeat, limit, same_memory)
        if baseline is None:
            row(workload, BIG, gbps=value, **_as_baseline(limits))
        else:
            row(workload, BIG, gbps=value, baseline=baseline[0], baseline_gbps=baseline[1],
                ratio=value / baseline[1], **limits)
        return value

    single = None
    if workloads & {"paged", "concurrent"}:
        progress(f"{plane} {direction} paged 256 MiB")
        src, dst = _scattered(rng)
        single = await throughput("paged", lambda: session.paged(direction, src, dst))
    if "whole" in workloads:
        progress(f"{plane} {direction} whole cache 256 MiB")
        await throughput("whole", lambda: session.whole(direction))
    if "small" in workloads:
        runs = max(200, repeat * 20)
        progress(f"{plane} {direction} 2 MiB x {runs}, back to back, then {SPACED_S * 1e3:g} ms apart")
        for spaced in (None, SPACED_S):
            lat = sorted(t * 1e3 for t in await _times(lambda: session.paged(direction, [7], [9]), runs, 5,
                                                       idle=spaced))
            row("small", TENSORS * BLOCK_BYTES, p50_ms=statistics.median(lat),
                p99_ms=lat[max(0, int(len(lat) * 0.99) - 1)], runs=runs,
                **({} if spaced is None else {"spaced_ms": spaced * 1e3}))
    if "calls" in workloads:
        rows.extend(await _measure_calls(session, str(plane), direction, repeat, progress))
    if "concurrent" in workloads and single is not None:
        progress(f"{plane} {direction} {concurrency} concurrent 4 MiB")
        pairs = [rng.permutation(BLOCKS)[:2].tolist() for _ in range(concurrency)]
        per = 2 * TENSORS * BLOCK_BYTES

        async def burst() -> None:
            await asyncio.gather(*(session.paged(direction, p, p) for p in pairs))

        agg = _gbps(per * concurrency, statistics.median(await _times(burst, repeat)))
        row("concurrent", per * concurrency, gbps=agg, baseline="single paged transfer", baseline_gbps=single,
            ratio=agg / single, concurrency=concurrency)
    return rows


async def _measure_calls(session: _Session, plane: str, direction: str, repeat: int,
                         progress: Progress) -> list[dict[str, Any]]:
    """Per-call latency of 64 and 8192 spans of 64 bytes, then of both sizes with other blocks each call (a new
    plan each time, as a serving engine's requests have: random blocks, distinct on each side), called in turn,
    then, for pulls, of ``pull_cache`` by ``CacheKey`` (a request key pulled once: through the owner, a round trip
    every call), then of 8192 spans of other blocks each call of memory the peer registered; the 8192-span row also
    gives the marginal cost of a span (its p50 minus the 64-span p50, per extra span)."""
    runs = max(500, repeat * 100)
    sizes = ' and '.join(map(str, CALL_SPANS))
    progress(f"{plane} {direction} calls of {sizes} spans, and of {sizes} spans of other blocks each call, in turn "
             f"x {runs}" + (", then by request key" if direction == "pull" else "") + ", then of registered memory")
    calls = [functools.partial(session.call, direction, blocks, blocks)
             for blocks in (list(range(0, 2 * (spans // TENSORS), 2)) for spans in CALL_SPANS)]  # no coalescing
    rng = np.random.default_rng(11)

    def new_blocks(count: int) -> Callable[[], Awaitable[None]]:
        picks = iter([(rng.choice(BLOCKS, count, replace=False).tolist(), rng.choice(BLOCKS, count, replace=False)
                       .tolist()) for _ in range(runs + 40)])
        return lambda: session.call(direction, *next(picks))

    times = await interleaved_times([*calls, *(new_blocks(spans // TENSORS) for spans in CALL_SPANS)], runs, 20)
    rows: list[dict[str, Any]] = []
    for new, (spans, seconds) in enumerate(zip(CALL_SPANS * 2, times)):
        row = _call_row(plane, direction, spans, seconds)
        if new >= len(CALL_SPANS):
            row["new_blocks"] = True
        elif spans != CALL_SPANS[0]:
            row["ns_per_extra_span"] = (row["p50_us"] - rows[0]["p50_us"]) * 1e3 / (spans - CALL_SPANS[0])
        rows.append(row)
    if direction == "pull":  # apart, after them: what the owner still does once such a call returned (the key's
        # release, the END) would otherwise fall on the next call in turn
        keyed = await _times(await session.request_keys(runs + 20), runs, 20)
        rows.append({**_call_row(plane, direction, TENSORS, keyed), "by_key": True})
    spans = CALL_SPANS[-1]
    registered = await _times(await session.registered_calls(direction, spans // TENSORS, runs + 20), runs, 20)
    rows.append({**_call_row(plane, direction, spans, registered), "new_blocks": True, "registered": True})
    return rows


def _call_row(plane: str, direction: str, spans: int, seconds: list[float]) -> dict[str, Any]:
    lat = sorted(t * 1e6 for t in seconds)
    return {"workload": "calls", "transport": plane, "direction": direction, "bytes": spans * TINY_BYTES,
            "spans": spans, "p50_us": statistics.median(lat), "p99_us": lat[max(0, int(len(lat) * 0.99) - 1)],
            "runs": len(lat)}


def _compare_with_peers(rows: list[dict[str, Any]], peers: list[dict[str, Any]]) -> None:
    """Add ``vs_<library>`` ratios (aiodatadist / NIXL) to our pull rows: throughput ratio for GB/s workloads
    (> 1: we are faster), p50 ratio for ``small`` (< 1: we are faster)."""
    for r in rows:
        library = COUNTERPART.get(r["transport"])
        theirs = next((p for p in peers if p["library"] == library and p["workload"] == r["workload"]), None)
        if theirs is None or r["direction"] != "pull" or "spaced_ms" in r:
            continue
        if "gbps" in r and "gbps" in theirs:
            r["peer"], r["peer_gbps"], r["vs_peer"] = library, theirs["gbps"], r["gbps"] / theirs["gbps"]
        elif "p50_ms" in r and "p50_ms" in theirs:
            r["peer"], r["peer_p50_ms"], r["vs_peer"] = library, theirs["p50_ms"], r["p50_ms"] / theirs["p50_ms"]


async def run_bench(workloads: set[str], repeat: int, transports: list[str], directions: list[str], *,
                    concurrency: int = 64, peers: bool = False, progress: Progress = lambda _: None
                    ) -> list[dict[str, Any]]:
    """Measure ``workloads`` on ``transports`` (``shm``/``tcp``) and ``directions`` (``pull``/``push``)."""
    rows: list[dict[str, Any]] = []
    remote = workloads - {"local"}
    limit = None
    if "local" in workloads or (remote & {"paged", "whole"} and set(SAME_HOST) & set(transports)):
        threads = probes.copy_threads()
        progress(f"baseline: streaming copy 256 MiB, {threads} threads (measured in turn with each workload)")
        limit = StreamCopy.create(BIG, threads)
    copy_base = None
    if "local" in workloads or (remote and {"shm", "nixl"} & set(transports)):
        progress("baseline: np.copyto 256 MiB")
        copy_base = copyto_gbps(BIG, repeat)
    if "local" in workloads:
        progress("local copy_blocks 256 MiB")
        assert copy_base is not None
        rows.append(await bench_local(repeat, copy_base, limit))
    for transport in transports if remote else []:
        # tcp: the ceiling over the link's own data connections, measured once it is up (nixl: on one host UCX
        # reads with process_vm_readv, so the copy baseline)
        baseline: tuple[str, float] | None = None
        if transport != "tcp":
            assert copy_base is not None
            baseline = ("np.copyto 256 MiB", copy_base)
        rows.extend(await bench_transport(transport, directions, remote, repeat, concurrency, baseline, progress,
                                          limit))
    if limit is not None:
        limit.check()
        del limit  # its 512 MiB, before the peers' runs
    compared = [t for t in transports if peers or t == "nixl"]
    if compared and remote & {"paged", "whole", "small"}:
        from .peers import run_nixl

        peer_rows: list[dict[str, Any]] = []
        wanted = remote & {"paged", "whole", "small"}
        for variant in dict.fromkeys(COUNTERPART[t] for t in compared):
            progress(f"NIXL ({variant})")
            peer_rows.extend(await asyncio.to_thread(run_nixl, wanted, repeat, variant, progress))
        _compare_with_peers(rows, peer_rows)
        rows.extend(peer_rows)
    return rows


def _format(r: dict[str, Any]) -> str:
    name = r.get("library", "aiodatadist")
    head = f"{name:<13} {r['workload']:<10} {r.get('transport', '-'):<4} {r.get('direction', 'pull'):<5}"
    if "gbps" in r:
        text = f"{head} {r['gbps']:7.2f} GB/s"
        if "baseline" in r:
            text += f"   {r['baseline']}: {r['baseline_gbps']:6.2f} GB/s   ratio {r['ratio']:.2f}"
        for key in ("limit", "same_memory"):
            if key in r:
                text += f"   {r[key]}: {r[f'{key}_gbps']:6.2f} GB/s   ratio {r[f'{key}_ratio']:.2f}"
    elif "p50_us" in r:
        text = f"{head} {r['spans']:>5} spans  p50 {r['p50_us']:7.1f} us  p99 {r['p99_us']:7.1f} us ({r['runs']} runs)"
        if r.get("new_blocks"):
            text += "   other blocks each call"
        if r.get("registered"):
            text += ", memory the peer registered"
        if r.get("by_key"):
            text += "   pull_cache by CacheKey (through the owner)"
        if "ns_per_extra_span" in r:
            text += f"   {r['ns_per_extra_span']:.1f} ns per extra span"
    else:
        text = f"{head} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms ({r['runs']} runs)"
        if "spaced_ms" in r:
            text += f"   {r['spaced_ms']:g} ms apart (the loop idle in between)"
    if "vs_peer" in r:
        text += f"   vs {r['peer']}: {r['vs_peer']:.2f}" + (" (p50 ratio, < 1 is faster)" if "p50_ms" in r else "")
    return text


def _device_main(ordinal: int, repeat: int, quiet: bool, json_path: str | None, tcp: bool = False) -> int:
    from aiodatadist import LLMException

    from .device import print_rows, run_device_bench
    from .device_tcp import run_device_tcp_bench

    try:
        device = probes.gpu(ordinal)
    except LLMException as exc:
        sys.stderr.write(f"bench --device: {exc}\n")
        return 2
    progress = stderr_progress(quiet)

    sys.stdout.write(f"aiodatadist bench --device: {device.name} ({probes.cuda_status()}, {device.driver.path}), "
                     f"repeat={repeat}{', over a TCP link' if tcp else ''}; medians, baselines measured in this run\n")
    rows = asyncio.run((run_device_tcp_bench if tcp else run_device_bench)(repeat, ordinal, progress))
    print_rows(rows)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": device.name, "repeat": repeat, "results": rows}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["vllm"]:  # P/D through vLLM KV connectors: its own options (bench vllm --help)
        from .vllm_pd import main as vllm_main

        return vllm_main(given[1:])
    if given[:1] == ["sglang"]:  # P/D through SGLang's transfer backends: its own options (bench sglang --help)
        from .sglang_pd import main as sglang_main

        return sglang_main(given[1:])
    if given[:1] == ["cluster"]:  # many prompt and decoder processes: its own options (bench cluster --help)
        from .cluster import main as cluster_main

        return cluster_main(given[1:])
    parser = argparse.ArgumentParser(prog="python -m aiodatadist bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                        help=f"{', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--repeat", type=int, default=7, help="repeats per figure (median reported)")
    parser.add_argument("--transport", default="shm,tcp",
                        help="shm, tcp, nixl, comma-separated (default: shm,tcp); nixl also runs raw NIXL beside it")
    parser.add_argument("--direction", default="pull,push", help="pull, push or both (default: both)")
    parser.add_argument("--concurrency", type=int, default=64, help="transfers of the concurrent workload")
    parser.add_argument("--peers", action="store_true", help="also run NIXL (extra 'peers') in the same run")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--device", nargs="?", const=0, type=int, metavar="ORDINAL",
                        help="run the GPU workloads instead (CUDA device ORDINAL, default 0): cross-process "
                             "device pulls/pushes and swap_blocks, against the GPU's own cuMemcpy; with "
                             "--transport tcp, device caches over a TCP link against the host-memory TCP plane")
    args = parser.parse_args(argv)
    if args.device is not None:
        return _device_main(args.device, args.repeat, args.quiet, args.json, tcp=args.transport == "tcp")
    names = [ALIASES.get(w, w) for w in args.workloads]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {list(WORKLOADS)}")
    transports = _choices(parser, "--transport", args.transport, ("shm", "tcp", "nixl"))
    directions = _choices(parser, "--direction", args.direction, ("pull", "push"))
    if args.repeat < 1 or args.concurrency < 1:
        parser.error("--repeat and --concurrency must be >= 1")
    if args.peers or "nixl" in transports:
        from .peers import nixl_available

        if not nixl_available():
            parser.error("--peers and --transport nixl need NIXL: pip install 'aiodatadist[nixl]'")
    progress = stderr_progress(args.quiet)

    native = "yes" if probes.native_available() else "no"
    sys.stdout.write(f"aiodatadist bench: repeat={args.repeat}, native helper={native}; medians, baselines measured "
                     "in this run\n")
    results = asyncio.run(run_bench(set(names or WORKLOADS), args.repeat, transports, directions,
                                    concurrency=args.concurrency, peers=args.peers, progress=progress))
    for r in results:
        sys.stdout.write(_format(r) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _choices(parser: argparse.ArgumentParser, option: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    if not chosen or set(chosen) - set(allowed):
        parser.error(f"{option} takes {', '.join(allowed)} (comma-separated), not {value!r}")
    return [a for a in allowed if a in chosen]
