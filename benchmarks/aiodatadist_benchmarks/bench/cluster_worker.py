"""The worker process of ``bench cluster`` (:mod:`aiodatadist_benchmarks.bench.cluster`): one ``LLMDataDist``.

Run as ``python -m aiodatadist_benchmarks.bench.cluster_worker`` by the driver, it answers JSON lines on its stdin
(``{"cmd", "args"}`` -> ``{"result"}`` or ``{"error"}``) on its stdout.  Here too: the models' KV geometry,
the byte pattern a prompt fills its pool with and a decoder checks every transfer against, the prompt-length
distributions and the request loops (closed, or Poisson arrivals).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import math
import os
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

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

__all__ = ["MODELS", "Lengths", "Model", "bad_blocks", "fill_blocks", "pattern_stream"]

SYNC_KV_TIMEOUT_MS = 120_000
LINK_TIMEOUT_MS = 20_000
Words = npt.NDArray[np.uint64]


# -- models and the byte pattern ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Model:
    """KV geometry of a model: one blocks-cache tensor per (layer, K or V)."""

    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int  # bytes per element (bf16: 2)

    @property
    def tensors(self) -> int:
        return 2 * self.layers

    def desc(self, blocks: int, block_tokens: int) -> CacheDesc:
        """A host blocks cache of ``blocks`` blocks of ``block_tokens`` tokens per tensor."""
        dtype = DataType.DT_BF16 if self.itemsize == 2 else DataType.DT_FLOAT
        shape = (blocks, block_tokens, self.kv_heads, self.head_dim)
        return CacheDesc(self.tensors, shape, dtype, Placement.HOST)

    def block_bytes(self, block_tokens: int) -> int:
        """Bytes of one block of one tensor."""
        return block_tokens * self.kv_heads * self.head_dim * self.itemsize


MODELS = {"llama3-8b": Model(32, 8, 128, 2), "tiny": Model(4, 4, 64, 2)}

def pattern_stream(seed: int, prompt: int, tensors: int, pool_blocks: int, words: int) -> Words:
    """The random words (every byte non-zero) whose windows are a prompt's blocks: block ``b`` of tensor ``t`` is
    ``stream[t * pool_blocks + b:][:words]``, so that neighbouring blocks and tensors all differ."""
    rng = np.random.default_rng([seed, prompt])
    nbytes = (tensors * pool_blocks + words) * 8
    stream: Words = rng.integers(1, 256, size=nbytes, dtype=np.uint8).view(np.uint64)
    return stream


def fill_blocks(view: Words, stream: Words, first: int) -> None:
    """Write the pattern into one tensor (``(blocks, words)``) whose block 0 is the window at ``first``."""
    blocks, words = view.shape
    np.copyto(view, sliding_window_view(stream, words)[first:first + blocks])


_libc = ctypes.CDLL(None)
_memcmp = _libc.memcmp
_memcmp.argtypes, _memcmp.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int


def bad_blocks(view: Words, dst: list[int], stream: Words, windows: list[int]) -> int:
    """How many blocks ``view[dst[i]]`` differ anywhere from the window of ``stream`` at ``windows[i]``.

    One ``memcmp`` per block (libc through ctypes, without the GIL: twice as fast here as a numpy compare, which
    allocates the expected and the boolean arrays)."""
    contiguous = view.flags.c_contiguous and stream.flags.c_contiguous
    if not (contiguous and view.dtype == stream.dtype == np.uint64):
        raise ValueError("bad_blocks takes C-contiguous uint64 arrays")
    nbytes = view.shape[1] * 8
    here, there = view.ctypes.data, stream.ctypes.data
    if max(windows, default=0) * 8 + nbytes > stream.nbytes or max(dst, default=0) >= len(view):
        raise ValueError("a block or window out of range")
    return sum(_memcmp(here + d * nbytes, there + w * 8, nbytes) != 0 for d, w in zip(dst, windows))


def _word_views(cache: Cache) -> list[Words]:
    """Each tensor of a host blocks cache as ``(blocks, words)`` uint64."""
    blocks = cache.cache_desc.shape[0]
    return [t.view(np.uint8).reshape(blocks, -1).view(np.uint64) for t in cache.tensors]


# -- request sizes -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Lengths:
    """A prompt-length distribution (tokens): ``lognormal``/``normal`` (mean, stddev), ``uniform`` (low, high) or
    ``fixed`` (n), clipped to ``[low, high]`` at draw time."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """``MEAN,STDDEV`` (lognormal), ``lognormal:MEAN,STDDEV``, ``normal:MEAN,STDDEV``, ``uniform:LO,HI`` or
        ``fixed:N``; raises ValueError."""
        kind, _, values = text.rpartition(":")
        kind = kind or "lognormal"
        numbers = [float(v) for v in values.split(",")]
        arity = 1 if kind == "fixed" else 2
        if kind not in ("lognormal", "normal", "uniform", "fixed") or len(numbers) != arity:
            raise ValueError(f"not a prompt-length distribution: {text!r}")
        if numbers[0] <= 0 or any(n < 0 for n in numbers):
            raise ValueError(f"prompt lengths must be positive: {text!r}")
        return cls(kind, *numbers)

    def draw(self, rng: np.random.Generator, low: int, high: int) -> int:
        """One length in tokens, within ``[low, high]``."""
        if self.kind == "lognormal":
            sigma2 = math.log1p((self.b / self.a) ** 2)
            value = rng.lognormal(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2))
        elif self.kind == "normal":
            value = rng.normal(self.a, self.b)
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        else:
            value = self.a
        return int(min(max(round(value), low), high))


# -- worker processes --------------------------------------------------------------------------------------
def _messages_sent(dd: LLMDataDist | None) -> int:
    """The control-plane messages ``dd`` sent so far (requests, replies, notifications), over every link."""
    return 0 if dd is None else sum(entry.total_sent for entry in dd.stats().messages)


def _memory_kib() -> dict[str, int]:
    """``VmRSS`` (resident, peers' mapped caches included; ``ru_maxrss`` would be the driver's, kept across
    ``execve``) and ``VmPTE`` (page tables) of this process, in KiB."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmPTE"):
                found[name] = int(value.split()[0])
    return found


def _cluster(ip: str, cluster_id: int, peer_ip: str, port: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info(ip, 0)
    info.append_remote_ip_info(peer_ip, port)
    return info


def _usage(messages: int) -> dict[str, Any]:
    """This process's CPU time (all threads), threads, descriptors, resident memory and messages sent so far."""
    ru, memory = resource.getrusage(resource.RUSAGE_SELF), _memory_kib()
    return {"t": time.monotonic(), "user_s": ru.ru_utime, "sys_s": ru.ru_stime,
            "rss_mib": memory.get("VmRSS", 0) / 1024, "page_tables_kib": memory.get("VmPTE", 0),
            "threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "messages": messages}


class _Requests:
    """A decoder's request stream: sizes, prompt choice, block ids, transfers and checks."""

    def __init__(self, dd: LLMDataDist, cache: Cache, a: dict[str, Any]) -> None:
        self.dd, self.cache = dd, cache
        self.views = _word_views(cache)
        self.prompts, self.index = a["prompts"], a["index"]
        self.prompt_blocks, self.block_tokens = a["prompt_blocks"], a["block_tokens"]
        words = self.views[0].shape[1]
        self.streams = {p: pattern_stream(a["seed"], p, len(self.views), self.prompt_blocks, words)
                        for p in self.prompts}
        self.lengths = Lengths.parse(a["prompt_len"])
        self.max_blocks = min(self.prompt_blocks, len(self.views[0]) // a["inflight"])
        self.rng = np.random.default_rng([a["seed"], a["index"]])
        self.random_pick = a["pick"] == "random"
        self.free = deque(int(b) for b in self.rng.permutation(len(self.views[0])))
        self.picked = 0
        self.latencies: list[float] = []
        self.queued: list[float] = []
        self.nbytes = self.requests = self.bad_blocks = self.bad_requests = 0
        self.errors: dict[str, int] = {}
        self.check_cpu = 0.0

    def draw(self) -> tuple[int, list[int]]:
        """The next request: its prompt's cluster id and source blocks."""
        tokens = self.lengths.draw(self.rng, self.block_tokens, self.max_blocks * self.block_tokens)
        count = -(-tokens // self.block_tokens)
        src = self.rng.choice(self.prompt_blocks, count, replace=False).tolist()
        if self.random_pick:
            prompt = self.prompts[int(self.rng.integers(len(self.prompts)))]
        else:
            prompt = self.prompts[(self.index + self.picked) % len(self.prompts)]
            self.picked += 1
        return prompt, src

    async def transfer(self, prompt: int, src: list[int], arrived: float | None = None) -> None:
        """Pull ``src`` of ``prompt`` into free blocks, then check every byte (outside the latency)."""
        dst = [self.free.popleft() for _ in src]
        try:
            started = time.perf_counter()
            if arrived is not None:
                self.queued.append(started - arrived)
            try:
                await self.dd.cache_manager.pull_blocks(BlocksCacheKey(prompt, 0), self.cache, src, dst)
            except LLMException as exc:
                self.errors[exc.status_code.name] = self.errors.get(exc.status_code.name, 0) + 1
                return
            self.latencies.append(time.perf_counter() - started)
            self.requests += 1
            self.nbytes += len(src) * sum(v.shape[1] * 8 for v in self.views)
            bad, cpu = await asyncio.to_thread(self.check, prompt, src, dst)
            self.check_cpu += cpu
            self.bad_blocks += bad
            self.bad_requests += bad > 0
        finally:
            self.free.extend(dst)

    def check(self, prompt: int, src: list[int], dst: list[int]) -> tuple[int, float]:
        """Bad (tensor, block) pairs of one transfer, and this thread's CPU seconds for it.  The first and last
        word of every ``dst`` block are zeroed afterwards (the pattern has no zero byte), so that a later transfer
        into it that writes nothing, or stops short, fails the check even if it pulls the same block again."""
        started = time.thread_time()
        stream, bad = self.streams[prompt], 0
        for t, view in enumerate(self.views):
            first = t * self.prompt_blocks
            bad += bad_blocks(view, dst, stream, [first + s for s in src])
            view[dst, 0] = view[dst, -1] = 0
        return bad, time.thread_time() - started

    def report(self) -> dict[str, Any]:
        return {"requests": self.requests, "bytes": self.nbytes, "latency_s": self.latencies,
                "queued_s": self.queued, "bad_blocks": self.bad_blocks, "bad_requests": self.bad_requests,
                "errors": self.errors, "check_cpu_s": self.check_cpu}


async def _closed_loop(req: _Requests, inflight: int, deadline: float) -> int:
    async def lane() -> None:
        while time.monotonic() < deadline:
            await req.transfer(*req.draw())

    await asyncio.gather(*(lane() for _ in range(inflight)))
    return 0


async def _open_loop(req: _Requests, rate: float, inflight: int, deadline: float) -> int:
    """Poisson arrivals until ``deadline``; returns how many were still waiting for a lane then (not served)."""
    lanes = asyncio.Semaphore(inflight)
    waiting = 0
    stopped = False

    async def one(prompt: int, src: list[int], arrived: float) -> None:
        nonlocal waiting
        waiting += 1
        async with lanes:
            waiting -= 1
            if not stopped:
                await req.transfer(prompt, src, arrived)

    tasks = []
    next_at = time.monotonic()
    while True:
        next_at += req.rng.exponential(1 / rate)
        if next_at >= deadline:
            break
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        tasks.append(asyncio.ensure_future(one(*req.draw(), time.perf_counter())))
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    stopped, unserved = True, waiting
    await asyncio.gather(*tasks)
    return unserved


class _Worker:
    """One instance in a worker process: the commands the driver sends (``_cmd_<name>``)."""

    def __init__(self) -> None:
        self.dd: LLMDataDist | None = None
        self.cache: Cache | None = None

    def _options(self, a: dict[str, Any]) -> dict[str, str]:
        cfg = LLMConfig()
        cfg.sync_kv_timeout = SYNC_KV_TIMEOUT_MS
        cfg.transport = a["transport"]
        if a["role"] == "prompt":
            cfg.listen_ip_info = f"{a['ip']}:0"
        return dict(cfg.generate_options())

    async def _cmd_start(self, a: dict[str, Any]) -> dict[str, Any]:
        """Init, allocate (and, for a prompt, fill) the pool, and link a decoder to every prompt."""
        prompt = a["role"] == "prompt"
        self.dd = dd = LLMDataDist(LLMRole.PROMPT if prompt else LLMRole.DECODER, a["cluster_id"])
        await dd.init(self._options(a))
        model = MODELS[a["model"]]
        desc = model.desc(a["pool_blocks"], a["block_tokens"])
        key = BlocksCacheKey(a["cluster_id"], 0) if prompt else None
        self.cache = dd.cache_manager.allocate_blocks_cache(desc, key)
        if prompt:
            started = time.perf_counter()
            views = _word_views(self.cache)
            words = views[0].shape[1]
            stream = pattern_stream(a["seed"], a["cluster_id"], len(views), a["pool_blocks"], words)
            for t, view in enumerate(views):
                fill_blocks(view, stream, t * a["pool_blocks"])
            address = dd.listen_address
            assert address is not None
            return {"port": address[1], "pid": os.getpid(), "fill_s": time.perf_counter() - started}
        infos = [_cluster(a["ip"], *peer) for peer in a["peers"]]
        calls = [infos] if a["link_all"] else [[info] for info in infos]
        return {"pid": os.getpid(), "link_s": [await self._link(call) for call in calls]}

    async def _link(self, infos: list[LLMClusterInfo]) -> float:
        """One ``link_clusters`` call; its duration."""
        assert self.dd is not None
        started = time.perf_counter()
        code, codes = await self.dd.link_clusters(infos, timeout=LINK_TIMEOUT_MS)
        if code != LLMStatusCode.LLM_SUCCESS:
            failed = [f"{info.remote_cluster_id}: {c.name}" for info, c in zip(infos, codes)
                      if c != LLMStatusCode.LLM_SUCCESS]
            raise RuntimeError(f"link_clusters failed ({', '.join(failed)})")
        return time.perf_counter() - started

    async def _cmd_warmup(self, a: dict[str, Any]) -> dict[str, Any]:
        """One checked one-block pull from every prompt (resolves the key; the first transfer maps memory)."""
        req = self._requests(a)
        for prompt in a["prompts"]:
            await req.transfer(prompt, [int(req.rng.integers(a["prompt_blocks"]))])
        return req.report()

    def _requests(self, a: dict[str, Any]) -> _Requests:
        assert self.dd is not None and self.cache is not None
        return _Requests(self.dd, self.cache, a)

    async def _cmd_run(self, a: dict[str, Any]) -> dict[str, Any]:
        """The timed phase, from ``start_at`` (monotonic clock, common to every process) for ``duration`` s."""
        assert self.dd is not None
        req = self._requests(a)
        await asyncio.sleep(max(0.0, a["start_at"] - time.monotonic()))
        before, stats_before = _usage(_messages_sent(self.dd)), self.dd.stats().total_bytes
        deadline = before["t"] + a["duration"]
        if a["rate"] > 0:
            unserved = await _open_loop(req, a["rate"], a["inflight"], deadline)
        else:
            unserved = await _closed_loop(req, a["inflight"], deadline)
        after = _usage(_messages_sent(self.dd))
        planes = sorted({str(link["plane"]) for link in self.dd.links()})
        return {**req.report(), "unserved": unserved, "usage": [before, after], "links": len(self.dd.links()),
                "planes": planes, "stats_bytes": self.dd.stats().total_bytes - stats_before}

    async def _cmd_usage(self, a: dict[str, Any]) -> dict[str, Any]:
        return _usage(_messages_sent(self.dd))

    async def close(self) -> None:
        if self.dd is not None:
            await self.dd.finalize()


async def _serve(out: IO[str]) -> None:
    """Answer the driver's JSON lines (``{"cmd", "args"}`` -> ``{"result"}`` or ``{"error"}``) until ``stop`` or
    end of input."""
    worker = _Worker()
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return
            msg = json.loads(line)
            if msg["cmd"] == "stop":
                break
            try:
                reply: dict[str, Any] = {"result": await getattr(worker, f"_cmd_{msg['cmd']}")(msg["args"])}
            except Exception as exc:  # noqa: BLE001 - reported to the driver, which stops the run
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        await worker.close()
    out.write(json.dumps({"result": _usage(_messages_sent(worker.dd))}) + "\n")
    out.flush()


def _worker_main() -> int:
    """A worker process: replies go to the original stdout, anything else printed goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    asyncio.run(_serve(out))
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
