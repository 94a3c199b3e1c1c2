"""``python -m aiodatadist soak``: random concurrent transfers for N seconds, every completed one verified.

A prompt runs in its own process (:class:`aiodatadist.testing.PeerProcess`) and a decoder in this one, linked
over ``--transport``.  ``--concurrency`` workers each loop over random transfers until the time is up:

* ``pull_blocks`` by ``BlocksCacheKey``: 1-16 distinct random blocks of the prompt's paged cache into 1-16
  distinct random blocks among the worker's own 16 blocks of the decoder's paged cache;
* ``pull_cache`` by ``CacheKeyByIdAndIndex``: a random batch slot of the prompt's contiguous cache into the
  worker's own slot of the decoder's contiguous cache;
* ``push_blocks``: random blocks of a decoder paged cache into random blocks of the worker's own paged cache in
  the prompt;
* ``push_cache``: a random slot of a decoder contiguous cache into the worker's own contiguous cache in the
  prompt.

40 % of them carry random layer ranges of equal length on both sides (``tensor_num_per_layer=2``).  Half of the
calls race a deadline: a quarter run under ``asyncio.timeout`` of a random 0.05-30 ms, a quarter are cancelled
after a random delay in the same range.  ``sync_kv_timeout`` (2000 ms) bounds every call.

**Verification.**  Every source holds :func:`~aiodatadist.testing.pattern` bytes that nothing writes, and each
worker owns its destinations (its rows of the decoder's caches, its own caches in the prompt), so concurrent
transfers never write the same bytes.  Before each transfer the worker poisons its destination (zeros; pattern
bytes are never 0).  After a completed transfer the whole destination must equal the image computed with numpy
from the source pattern: pattern bytes where the transfer was asked to write, zeros everywhere else.  So the
check also catches bytes written outside the request and late writes of an earlier, interrupted transfer (they
land after the poisoning).  Decoder-side destinations are compared in place, prompt-side ones through the
SHA-256 digest of every tensor (the agent's ``digest`` command).  A mismatch counts as a corrupted transfer.

**Figures.**  Transfers done per kind and per second, bytes moved, failures by status code name
(``CANCELLED``: the caller's own deadline or cancellation), corrupted transfers, the latency of every call
(p50/p99), how long calls outlived their deadline (the ``asyncio.timeout``, the moment of cancellation, or
``sync_kv_timeout``: the worst value and how many were over 100 ms late), the worst wake-up delay of this
process's event loop (which delays every return too, so it tells a busy machine from a slow cancellation),
and the resident memory (VmRSS) of both processes after a warm-up (5 % of the run, at least 2 s) and at the
end.  The exit status is 0 when the prompt process stayed up, at least one transfer completed, none was
corrupted, none failed other than by a deadline (``CANCELLED``, ``LLM_TIMEOUT``: nothing is released or
unlinked during the run), no call returned more than 100 ms after its deadline and neither process's RSS grew
by 5 % or more; otherwise 1 (a failed prompt process also ends the run early).  Each corrupted transfer (with
the worker's previous transfer), call over 100 ms late and unexpected exception is described on stderr, the
first ten of each kind.

**Chaos.**  ``--chaos`` runs the same workers and checks while the prompt process is killed and restarted,
stopped, and cut off through a fault proxy at random moments, the decoder relinking each time; it also checks
that the decoder's descriptors, threads, mappings and memfds do not grow (:mod:`aiodatadist_benchmarks.soak_chaos`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import sys
import traceback
from array import array
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np

from aiodatadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import PeerError, PeerProcess, cluster_info, fill_pattern, free_port, pattern

__all__ = ["run_soak"]

PROMPT, DECODER = 1, 2
LAYERS = 16
TENSORS = 2 * LAYERS  # K, V per layer: tensor_num_per_layer = 2
BLOCK_SHAPE = (16, 4, 128)  # fp16: 16 KiB per block
SLOT_SHAPE = (64, 4, 128)  # fp16: 64 KiB per batch slot
SOURCE_BLOCKS = 64  # blocks of each source paged cache
SOURCE_SLOTS = 8  # batch slots of each source contiguous cache
REGION_BLOCKS = 16  # blocks each worker owns in a destination paged cache (the most one transfer moves)
KINDS = ("pull_blocks", "pull_cache", "push_blocks", "push_cache")
MODES = ("plain", "timeout", "cancel")
MODE_WEIGHTS = (0.5, 0.25, 0.25)
LAYER_RANGE_SHARE = 0.4
INTERRUPT_RANGE_S = (5e-5, 3e-2)  # own timeouts and cancellation delays, drawn log-uniformly
SYNC_KV_TIMEOUT_MS = 2000
LATE_LIMIT_S = 0.1
EXPECTED_FAILURES = ("CANCELLED", "LLM_TIMEOUT")  # nothing is released or unlinked: any other failure is a bug
RSS_GROWTH_LIMIT_PCT = 5.0
PROGRESS_EVERY_S = 10.0
PEER_EXIT_WAIT_S = 5.0  # how long a failed agent command waits for the prompt process's exit status
LOOP_PROBE_S = 0.01  # how often the event loop's wake-up delay is sampled
REPORTED_PER_KIND = 10  # corrupted transfers, late calls, unexpected exceptions: each described at most 10 times

Progress = Callable[[str], None]


def _desc(rows: int, tail: tuple[int, ...]) -> CacheDesc:
    return CacheDesc(TENSORS, (rows, *tail), DataType.DT_FLOAT16, Placement.HOST)


def _row_views(cache: Cache) -> list[np.ndarray]:
    """Live ``uint8`` views of a cache's tensors, one row per block or batch slot."""
    rows = int(cache.cache_desc.shape[0])
    return [t.view(np.uint8).reshape(rows, -1) for t in cache.tensors]


def _pattern_rows(seed: int, rows: int, tail: tuple[int, ...]) -> list[np.ndarray]:
    """The bytes ``fill_pattern(cache, seed)`` writes into a ``_desc(rows, tail)`` cache, one row per block/slot."""
    nbytes = _desc(rows, tail).size
    return [pattern(seed, t, nbytes).reshape(rows, -1) for t in range(TENSORS)]


def _rss_kib(pid: int) -> int | None:
    """Resident memory of a process (``VmRSS`` of ``/proc/<pid>/status``) in KiB; None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return None  # gone, or a zombie (no VmRSS line)


def _distinct(rng: np.random.Generator, population: int, count: int) -> list[int]:
    return [int(x) for x in rng.choice(population, count, replace=False)]


def _random_layers(rng: np.random.Generator) -> tuple[dict[str, Any], dict[int, int]]:
    """Layer-range keyword arguments (none, or equally long random ranges on both sides) and the tensor map
    they imply: destination tensor -> source tensor."""
    if rng.random() >= LAYER_RANGE_SHARE:
        return {}, {t: t for t in range(TENSORS)}
    count = int(rng.integers(1, LAYERS + 1))
    src, dst = (int(rng.integers(0, LAYERS - count + 1)) for _ in range(2))
    layers = {"src_layer_range": range(src, src + count), "dst_layer_range": range(dst, dst + count),
              "tensor_num_per_layer": 2}
    return layers, {2 * dst + i: 2 * src + i for i in range(2 * count)}


@dataclass(frozen=True)
class _Move:
    """What a transfer must produce: for every destination tensor ``d`` in ``tensors`` (mapped to its source
    tensor ``s``), row ``src_rows[i]`` of ``source[s]`` in row ``dst_rows[i]`` of ``d``."""

    source: list[np.ndarray]
    tensors: dict[int, int]
    src_rows: list[int]
    dst_rows: list[int]

    @property
    def nbytes(self) -> int:
        return len(self.tensors) * len(self.src_rows) * int(self.source[0].shape[1])

    def image(self, tensor: int, rows: int) -> np.ndarray:
        """The expected bytes of destination tensor ``tensor`` (``rows`` rows), poisoned with zeros."""
        out = np.zeros((rows, self.source[0].shape[1]), dtype=np.uint8)
        src = self.tensors.get(tensor)
        if src is not None:
            out[self.dst_rows] = self.source[src][self.src_rows]
        return out


class _Destination(Protocol):
    """Bytes one worker owns: poisoned before each transfer, compared with the expected image after it."""

    async def poison(self) -> None: ...

    async def mismatches(self, move: _Move) -> list[int]:
        """The destination tensors that differ from ``move``'s image."""
        ...


class _LocalRows:
    """A worker's rows ``first .. first + count - 1`` of every tensor of a decoder cache, compared in place."""

    def __init__(self, views: list[np.ndarray], first: int, count: int) -> None:
        self._views = [v[first:first + count] for v in views]

    async def poison(self) -> None:
        for view in self._views:
            view[...] = 0

    async def mismatches(self, move: _Move) -> list[int]:
        return await asyncio.to_thread(self._compare, move)

    def _compare(self, move: _Move) -> list[int]:
        return [t for t, view in enumerate(self._views) if not np.array_equal(view, move.image(t, len(view)))]


class _Agent(Protocol):
    """What runs the prompt's agent commands: a :class:`PeerProcess` (or, in a chaos soak, whichever one is current)."""

    async def call(self, cmd: str, **args: Any) -> Any: ...


class _PromptCache:
    """A worker's own cache in the prompt process, compared through the SHA-256 digest of every tensor."""

    def __init__(self, peer: _Agent, cache_id: int, rows: int) -> None:
        self._peer, self._cache_id, self._rows = peer, cache_id, rows

    async def poison(self) -> None:
        await self._peer.call("poison", cache_id=self._cache_id)

    async def mismatches(self, move: _Move) -> list[int]:
        got = await self._peer.call("digest", cache_id=self._cache_id)
        want = await asyncio.to_thread(self._digests, move)
        return [t for t, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]

    def _digests(self, move: _Move) -> list[str]:
        return [hashlib.sha256(move.image(t, self._rows).data).hexdigest() for t in range(TENSORS)]


@dataclass(frozen=True)
class _Transfer:
    """One random transfer: the call, what it must produce, where, and a description for reports."""

    kind: str
    call: Callable[[], Coroutine[Any, Any, None]]
    move: _Move
    destination: _Destination
    detail: str


@dataclass(frozen=True)
class _PromptCaches:
    """Cache ids in the prompt process: the contiguous source, and each worker's push destinations."""

    source_slots: int
    target_blocks: list[int]  # worker w's paged cache answers to BlocksCacheKey(PROMPT, 1 + w)
    target_slots: list[int]


async def _start_prompt(peer: PeerProcess, port: int, transport: str, workers: int, seed: int) -> _PromptCaches:
    """Initialize the prompt in ``peer``: listening, with pattern-filled sources and zeroed push destinations."""
    await peer.call("init", role="PROMPT", cluster_id=PROMPT, options={
        "llm.listenIpInfo": f"127.0.0.1:{port}", "llm.SyncKvCacheWaitTime": str(SYNC_KV_TIMEOUT_MS),
        "llm.Transport": transport})

    async def allocate(rows: int, tail: tuple[int, ...], blocks_key: int | None = None) -> int:
        reply = await peer.call("allocate", num_tensors=TENSORS, shape=[rows, *tail], dtype="DT_FLOAT16",
                                blocks=blocks_key is not None,
                                blocks_key=None if blocks_key is None else [PROMPT, blocks_key])
        return int(reply["cache_id"])

    await peer.call("fill", cache_id=await allocate(SOURCE_BLOCKS, BLOCK_SHAPE, 0), seed=seed + 1)
    source_slots = await allocate(SOURCE_SLOTS, SLOT_SHAPE)
    await peer.call("fill", cache_id=source_slots, seed=seed + 2)
    target_blocks = [await allocate(REGION_BLOCKS, BLOCK_SHAPE, 1 + w) for w in range(workers)]
    target_slots = [await allocate(1, SLOT_SHAPE) for _ in range(workers)]
    return _PromptCaches(source_slots, target_blocks, target_slots)


class _Rig:
    """The decoder's caches and the expected bytes of every source; builds random transfers."""

    def __init__(self, peer: _Agent, dd: LLMDataDist, prompt: _PromptCaches, seed: int) -> None:
        cm = dd.cache_manager
        workers = len(prompt.target_blocks)
        self._cm, self._prompt = cm, prompt
        self._prompt_blocks = _pattern_rows(seed + 1, SOURCE_BLOCKS, BLOCK_SHAPE)
        self._prompt_slots = _pattern_rows(seed + 2, SOURCE_SLOTS, SLOT_SHAPE)
        self._src_blocks = cm.allocate_blocks_cache(_desc(SOURCE_BLOCKS, BLOCK_SHAPE))
        self._own_blocks = [d.reshape(SOURCE_BLOCKS, -1) for d in fill_pattern(self._src_blocks, seed + 3)]
        self._src_slots = cm.allocate_cache(_desc(SOURCE_SLOTS, SLOT_SHAPE))
        self._own_slots = [d.reshape(SOURCE_SLOTS, -1) for d in fill_pattern(self._src_slots, seed + 4)]
        self._dst_blocks = cm.allocate_blocks_cache(_desc(workers * REGION_BLOCKS, BLOCK_SHAPE))
        self._dst_slots = cm.allocate_cache(_desc(workers, SLOT_SHAPE))
        block_rows, slot_rows = _row_views(self._dst_blocks), _row_views(self._dst_slots)
        self._destinations: dict[str, list[_Destination]] = {
            "pull_blocks": [_LocalRows(block_rows, w * REGION_BLOCKS, REGION_BLOCKS) for w in range(workers)],
            "pull_cache": [_LocalRows(slot_rows, w, 1) for w in range(workers)],
            "push_blocks": [_PromptCache(peer, c, REGION_BLOCKS) for c in prompt.target_blocks],
            "push_cache": [_PromptCache(peer, c, 1) for c in prompt.target_slots],
        }

    def random_transfer(self, worker: int, rng: np.random.Generator) -> _Transfer:
        kind = KINDS[int(rng.integers(len(KINDS)))]
        layers, tensors = _random_layers(rng)
        if kind.endswith("blocks"):
            count = int(rng.integers(1, REGION_BLOCKS + 1))
            src_rows, dst_rows = _distinct(rng, SOURCE_BLOCKS, count), _distinct(rng, REGION_BLOCKS, count)
        else:
            src_rows, dst_rows = [int(rng.integers(SOURCE_SLOTS))], [0]
        call, source = self._call(kind, worker, src_rows, dst_rows, layers)
        ranges = f", layers {layers['src_layer_range']} -> {layers['dst_layer_range']}" if layers else ""
        detail = f"{kind} by worker {worker}: rows {src_rows} -> {dst_rows} of its destination{ranges}"
        return _Transfer(kind, call, _Move(source, tensors, src_rows, dst_rows),
                         self._destinations[kind][worker], detail)

    def _call(self, kind: str, worker: int, src_rows: list[int], dst_rows: list[int], layers: dict[str, Any]
              ) -> tuple[Callable[[], Coroutine[Any, Any, None]], list[np.ndarray]]:
        """The transfer call of ``kind`` and the expected bytes of its source, one row per block or slot."""
        cm, prompt = self._cm, self._prompt
        if kind == "pull_blocks":
            dst_blocks = [worker * REGION_BLOCKS + r for r in dst_rows]
            return partial(cm.pull_blocks, BlocksCacheKey(PROMPT, 0), self._dst_blocks, src_rows, dst_blocks,
                           **layers), self._prompt_blocks
        if kind == "pull_cache":
            key = CacheKeyByIdAndIndex(PROMPT, prompt.source_slots, src_rows[0])
            return partial(cm.pull_cache, key, self._dst_slots, worker, **layers), self._prompt_slots
        if kind == "push_blocks":
            return partial(cm.push_blocks, BlocksCacheKey(PROMPT, 1 + worker), self._src_blocks, src_rows,
                           dst_rows, **layers), self._own_blocks
        key = CacheKeyByIdAndIndex(PROMPT, prompt.target_slots[worker], 0)
        return partial(cm.push_cache, key, self._src_slots, src_rows[0], **layers), self._own_slots


@dataclass
class _Tally:
    """What happened, summed over every worker."""

    done: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    modes: Counter[str] = field(default_factory=Counter)
    corrupted: int = 0
    bytes_moved: int = 0
    latencies_ms: array[float] = field(default_factory=lambda: array("d"))
    worst_late_s: float = 0.0
    late_calls: int = 0
    worst_loop_lag_s: float = 0.0
    reported: Counter[str] = field(default_factory=Counter)

    def record_call(self, mode: str, latency_s: float, late_s: float, failure: str | None) -> None:
        self.modes[mode] += 1
        self.latencies_ms.append(latency_s * 1e3)
        if failure is not None:
            self.failures[failure] += 1
        self.worst_late_s = max(self.worst_late_s, late_s)
        self.late_calls += late_s > LATE_LIMIT_S

    def report_problem(self, kind: str, text: str) -> None:
        """Describe a problem of ``kind`` (CORRUPTED, LATE, UNEXPECTED) on stderr, the first few of each kind."""
        self.reported[kind] += 1
        if self.reported[kind] <= REPORTED_PER_KIND:
            sys.stderr.write(f"{kind}: {text.rstrip()}\n")
            sys.stderr.flush()


async def _cancel_after(call: Callable[[], Coroutine[Any, Any, None]], delay: float
                        ) -> tuple[asyncio.Task[None], float]:
    """Start ``call()`` in its own task and cancel it after ``delay`` s unless it is done by then.

    Returns the task and the loop time of the cancellation (``inf`` if it finished first)."""
    task = asyncio.ensure_future(call())
    try:
        done, _ = await asyncio.wait({task}, timeout=delay)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        return task, math.inf
    task.cancel()
    return task, asyncio.get_running_loop().time()


class _Soak:
    """The workers, the progress lines and the memory samples of one run."""

    def __init__(self, rig: _Rig, peer: PeerProcess, concurrency: int, seed: int, progress: Progress) -> None:
        self._rig, self._peer, self._concurrency, self._seed = rig, peer, concurrency, seed
        self._progress = progress
        self.tally = _Tally()
        self.rss_start: dict[str, int] = {}
        self.aborted: str | None = None  # why the run stopped early

    def rss(self) -> dict[str, int]:
        """Resident memory of both processes (of those still running), in KiB."""
        pids = {"decoder": os.getpid(), "prompt": self._peer.pid}
        return {name: kib for name, pid in pids.items() if (kib := _rss_kib(pid)) is not None}

    async def run(self, seconds: float) -> float:
        """Run the workers for ``seconds``; returns the duration (until the last call returned)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        end = started + seconds
        warmup = min(max(2.0, 0.05 * seconds), seconds / 2)
        reporters = [asyncio.ensure_future(self._sample_rss_after(warmup)),
                     asyncio.ensure_future(self._report_progress(started)),
                     asyncio.ensure_future(self._watch_loop())]
        try:
            async with asyncio.TaskGroup() as group:
                for w in range(self._concurrency):
                    group.create_task(self._worker(w, np.random.default_rng([self._seed, w]), end))
        except* (PeerError, OSError) as failed:  # from the agent's commands: the prompt process is broken
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._peer.proc.wait(), PEER_EXIT_WAIT_S)
            self.aborted = (f"the prompt process failed ({failed.exceptions[0]!r}; exit status "
                            f"{self._peer.proc.returncode})")
            self._progress(f"stopped: {self.aborted}")
        finally:
            for task in reporters:
                task.cancel()
        return loop.time() - started

    async def _sample_rss_after(self, warmup: float) -> None:
        await asyncio.sleep(warmup)
        self.rss_start = self.rss()

    async def _watch_loop(self) -> None:
        """Track how late this event loop wakes up (it also delays every call's return)."""
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(LOOP_PROBE_S)
            self.tally.worst_loop_lag_s = max(self.tally.worst_loop_lag_s, loop.time() - before - LOOP_PROBE_S)

    async def _report_progress(self, started: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            elapsed = loop.time() - started
            t, rss = self.tally, self.rss()
            done = sum(t.done.values())
            self._progress(f"{elapsed:.0f} s: {done} transfers ({done / elapsed:.0f}/s), failures "
                           f"{_counts(t.failures)}, corrupted {t.corrupted}, worst late {t.worst_late_s * 1e3:.1f} ms, RSS "
                           + ", ".join(f"{name} {kib / 1024:.0f} MiB" for name, kib in rss.items()))

    async def _worker(self, worker: int, rng: np.random.Generator, end: float) -> None:
        loop = asyncio.get_running_loop()
        previous = "none"
        while loop.time() < end:
            transfer = self._rig.random_transfer(worker, rng)
            await transfer.destination.poison()
            mode = MODES[int(rng.choice(len(MODES), p=MODE_WEIGHTS))]
            limit = math.exp(rng.uniform(*np.log(INTERRUPT_RANGE_S)))
            how = f"{transfer.detail} ({mode}{f' after {limit * 1e3:.2f} ms' if mode != 'plain' else ''})"
            failure = await self._attempt(transfer.call, mode, limit, how)
            if failure is None:
                await self._verify(transfer, how, previous)
            previous = f"{how}: {failure or 'completed'}"
            await asyncio.sleep(0)  # a loop of failing calls must not starve the event loop

    async def _attempt(self, call: Callable[[], Coroutine[Any, Any, None]], mode: str, limit: float, how: str
                       ) -> str | None:
        """Make the call (``mode``: plain, under ``asyncio.timeout(limit)``, or cancelled after ``limit``);
        records its latency and lateness (``how`` describes it) and returns the failure (None: completed)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + SYNC_KV_TIMEOUT_MS / 1000
        failure: str | None = None
        try:
            if mode == "timeout":
                deadline = min(deadline, start + limit)
                async with asyncio.timeout_at(start + limit):
                    await call()
            elif mode == "cancel":
                task, cancelled_at = await _cancel_after(call, limit)
                deadline = min(deadline, cancelled_at)
                await task
            else:
                await call()
        except LLMException as exc:
            failure = exc.status_code.name
        except (TimeoutError, asyncio.CancelledError) as exc:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this worker is being cancelled, not just the call
            failure = "CANCELLED" if mode != "plain" else type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - a bug: count it, describe it, keep going
            failure = type(exc).__name__
            self.tally.report_problem("UNEXPECTED", f"{failure}: {how}:\n{traceback.format_exc()}")
        end = loop.time()
        self.tally.record_call(mode, end - start, end - deadline, failure)
        if end - deadline > LATE_LIMIT_S:
            self.tally.report_problem("LATE", f"{how} returned {(end - deadline) * 1e3:.1f} ms after its deadline "
                                      f"({failure or 'completed'}, {(end - start) * 1e3:.1f} ms after the call)")
        return failure

    async def _verify(self, transfer: _Transfer, how: str, previous: str) -> None:
        bad = await transfer.destination.mismatches(transfer.move)
        if not bad:
            self.tally.done[transfer.kind] += 1
            self.tally.bytes_moved += transfer.move.nbytes
            return
        self.tally.corrupted += 1
        self.tally.report_problem("CORRUPTED", f"{how}: tensors {bad} differ; "
                                  f"this worker's previous transfer: {previous}")



def _counts(counter: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counter.items())) or "none"


def _library_stats(dd: LLMDataDist) -> dict[str, dict[str, Any]]:
    """The decoder's own transfer statistics per direction (``dd.stats()``), to compare with the tally."""
    return {s.direction: {"operations": s.operations, "succeeded": s.succeeded, "bytes": s.bytes,
                          "failures": dict(s.failures)} for s in dd.stats().links}


def _memory(start: dict[str, int], end: dict[str, int]) -> dict[str, dict[str, float]]:
    return {name: {"start_kib": start[name], "end_kib": end[name],
                   "growth_pct": (end[name] - start[name]) / start[name] * 100} for name in end if name in start}


def _problems(figures: dict[str, Any], expected: tuple[str, ...] = EXPECTED_FAILURES) -> list[str]:
    """Why the run failed (empty: it passed); ``expected``: the failure codes that are no problem."""
    problems = [figures["aborted"]] if figures["aborted"] else []
    if figures["done_total"] == 0:
        problems.append("no transfer completed")
    if figures["corrupted"]:
        problems.append(f"{figures['corrupted']} corrupted transfers")
    unexpected = {name: n for name, n in figures["failures"].items() if name not in expected}
    if unexpected:
        problems.append(f"unexpected failures: {_counts(unexpected)}")
    if figures["late_over_100ms"]:
        problems.append(f"{figures['late_over_100ms']} calls returned > 100 ms after their deadline")
    problems.extend(f"{name} RSS grew {m['growth_pct']:.1f} %" for name, m in figures["rss"].items()
                    if m["growth_pct"] >= RSS_GROWTH_LIMIT_PCT)
    return problems


def _figures(soak: _Soak, duration: float, rss_end: dict[str, int], settings: dict[str, Any]) -> dict[str, Any]:
    t = soak.tally
    latencies = np.frombuffer(t.latencies_ms, dtype=np.float64) if t.latencies_ms else np.zeros(1)
    done = sum(t.done.values())
    figures: dict[str, Any] = {
        **settings, "duration_s": duration, "done": dict(t.done), "done_total": done,
        "transfers_per_s": done / duration, "bytes_moved": t.bytes_moved, "calls": sum(t.modes.values()),
        "modes": dict(t.modes), "failures": dict(t.failures), "corrupted": t.corrupted,
        "late_worst_ms": t.worst_late_s * 1e3, "late_over_100ms": t.late_calls,
        "loop_lag_worst_ms": t.worst_loop_lag_s * 1e3,
        "latency_p50_ms": float(np.percentile(latencies, 50)), "latency_p99_ms": float(np.percentile(latencies, 99)),
        "rss": _memory(soak.rss_start or rss_end, rss_end), "aborted": soak.aborted,
    }
    figures["problems"] = _problems(figures)
    figures["ok"] = not figures["problems"]
    return figures


async def run_soak(seconds: float, *, concurrency: int = 16, transport: str = "auto", seed: int = 1,
                   progress: Progress = lambda _: None) -> dict[str, Any]:
    """Run the soak (see the module docstring) and return its figures."""
    port = free_port()
    peer = await PeerProcess.start()
    try:
        prompt = await _start_prompt(peer, port, transport, concurrency, 16 * seed)
        async with LLMDataDist(LLMRole.DECODER, DECODER) as dd:
            cfg = LLMConfig()
            cfg.sync_kv_timeout = SYNC_KV_TIMEOUT_MS
            cfg.transport = transport
            await dd.init(cfg.generate_options())
            code, _ = await dd.link_clusters([cluster_info(PROMPT, port)], timeout=20000)
            if code != LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"soak: link failed: {code}")
            plane = dd.links()[0]["plane"]
            soak = _Soak(_Rig(peer, dd, prompt, 16 * seed), peer, concurrency, seed, progress)
            progress(f"prompt pid {peer.pid} linked over {plane}; {concurrency} workers for {seconds:g} s")
            duration = await soak.run(seconds)
            rss_end = soak.rss()
            library = _library_stats(dd)
    finally:
        await peer.close()
    settings = {"seconds": seconds, "concurrency": concurrency, "transport": transport, "plane": plane, "seed": seed}
    return {**_figures(soak, duration, rss_end, settings), "library_stats": library}


def _summary(f: dict[str, Any]) -> list[str]:
    rss = [f"RSS {name:<8}       {m['start_kib'] / 1024:.1f} MiB after warm-up -> {m['end_kib'] / 1024:.1f} MiB "
           f"at the end ({m['growth_pct']:+.2f} %)" for name, m in f["rss"].items()]
    library = [f"library stats      {d}: {s['operations']} operations, {s['succeeded']} succeeded, failures "
               f"{_counts(s['failures'])}" for d, s in sorted(f["library_stats"].items())]
    return [
        (f"aiodatadist soak: {f['seconds']:g} s, {f['concurrency']} workers, transport {f['transport']} "
         f"(plane {f['plane']}), seed {f['seed']}"),
        f"duration           {f['duration_s']:.1f} s",
        f"transfers done     {f['done_total']} ({_counts(f['done'])}): {f['transfers_per_s']:.1f}/s",
        f"bytes moved        {f['bytes_moved'] / 2**30:.2f} GiB ({f['bytes_moved'] / f['duration_s'] / 1e9:.2f} GB/s)",
        f"calls              {f['calls']} ({_counts(f['modes'])})",
        f"failures           {_counts(f['failures'])}",
        f"corrupted          {f['corrupted']}",
        (f"late calls         worst {f['late_worst_ms']:.1f} ms beyond a deadline, {f['late_over_100ms']} > 100 ms "
         f"(this event loop woke up at worst {f['loop_lag_worst_ms']:.1f} ms late)"),
        f"latency            p50 {f['latency_p50_ms']:.2f} ms, p99 {f['latency_p99_ms']:.2f} ms (every call)",
        *rss,
        *library,
        f"result             {'PASS' if f['ok'] else 'FAIL: ' + '; '.join(f['problems'])}",
    ]
