"""``bench --device``: GPU figures against the same GPU's own copy limits, measured in the same run.

* ``d2d pull`` / ``d2d push``: a decoder in this process pulls (pushes) 64 tensors x 128 scattered 32 KiB blocks
  (256 MiB) from (to) a prompt in another process, both caches in device memory, through CUDA IPC; baseline: a
  same-process ``cuMemcpyDtoD`` of 256 MiB.
* ``d2d pull, 2 calls in flight``: two such pulls at once, into the two halves of the destination cache (512 MiB
  a round): the GPU copies one while the host prepares or finishes the other, as an engine's concurrent requests
  overlap; against the same ``cuMemcpyDtoD`` rate.
* ``swap h2d`` / ``swap d2h``: ``swap_blocks`` of the same 256 MiB between a host blocks cache and a device one;
  baselines: ``cuMemcpyHtoD`` / ``cuMemcpyDtoH`` of 256 MiB from / to page-locked host memory.
* ``host->dev pull``: the decoder's device cache pulls the blocks from the prompt's *host* cache (no baseline
  ratio target; shown against the pinned host-to-device copy).
* ``d2d pull 2 MiB``: what a call costs around a small device copy: one block of each of the 64 tensors, pulled
  from the prompt's device cache, p50/p99 over ``max(200, 20 x repeat)`` calls, and where its time goes (phases);
  ``d2d pull 2 MiB, new blocks``: the same with other blocks each call, as a serving engine's requests have (a
  new plan and launch every call).
* ``d2d pull`` / ``d2d push: kernel alone``: the same 256 MiB calls with timed events around the copy: the
  kernel's own rate against ``cuMemcpyDtoD``, and the phases of the call around it.
* ``kernel T x N/SM``: the copy kernel alone on 8192 scattered 32 KiB spans, one launch at a time, with T threads
  per CTA and N CTAs per SM (the first row is the shipped geometry).

GB/s = bytes copied / second; medians over ``--repeat``.  Every transfer is checked byte-exact once.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import numpy as np

from aiodatadist import BlocksCacheKey, LLMDataDist
from aiodatadist.testing import PeerProcess, probes, tensor_bytes

from .device_pair import BLOCK_BYTES, BLOCKS, MOVED, MOVED_BYTES, TENSORS, device_pair
from .timing import times as _times

__all__ = ["run_device_bench"]



def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def rate_row(name: str, gbps: float, baseline: str, baseline_gbps: float) -> dict[str, Any]:
    """A rate's row: the figure, its baseline of the same run and their ratio."""
    return {"name": name, "gbps": gbps, "baseline": baseline, "baseline_gbps": baseline_gbps,
            "ratio": gbps / baseline_gbps}


def _median_time(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def _median_async(fn: Callable[[], Awaitable[Any]], repeat: int) -> float:
    await fn()  # warm-up (opens IPC handles, page-locks host caches)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def baselines(ordinal: int, repeat: int) -> dict[str, float]:
    """Same-process copies of 256 MiB: device to device, and page-locked host to / from device (GB/s)."""
    device = probes.gpu(ordinal)
    a, b = device.alloc(MOVED_BYTES), device.alloc(MOVED_BYTES)
    host = device.alloc_pinned(MOVED_BYTES)
    try:
        device.memset(a, 7, MOVED_BYTES)
        return {
            "d2d": _gbps(MOVED_BYTES, _median_time(lambda: device.copy_dtod(b, a, MOVED_BYTES), repeat)),
            "h2d": _gbps(MOVED_BYTES, _median_time(lambda: device.copy_htod(b, host, MOVED_BYTES), repeat)),
            "d2h": _gbps(MOVED_BYTES, _median_time(lambda: device.copy_dtoh(host, a, MOVED_BYTES), repeat)),
        }
    finally:
        device.free(a)
        device.free(b)
        device.free_pinned(host)


class Figures:
    """A device bench's rows, with the copy baselines of its run (:meth:`start` measures them first)."""

    def __init__(self, base: dict[str, float], progress: Callable[[str], None], digits: int) -> None:
        self.rows: list[dict[str, Any]] = []
        self.base = base
        self._progress = progress
        self._digits = digits

    @classmethod
    async def start(cls, ordinal: int, repeat: int, progress: Callable[[str], None], digits: int) -> Figures:
        progress("baselines: cuMemcpy device-to-device and page-locked host<->device, 256 MiB")
        return cls(await asyncio.to_thread(baselines, ordinal, repeat), progress, digits)

    def rate(self, name: str, gbps: float, baseline: str) -> None:
        """A rate's row against one of the run's baselines, and its progress line."""
        self.rows.append(rate_row(name, gbps, baseline, self.base[baseline]))
        self._progress(f"{name}: {gbps:.{self._digits}f} GB/s ({gbps / self.base[baseline]:.2f}x {baseline})")


async def run_device_bench(repeat: int, ordinal: int = 0,
                           progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Run the device workloads; returns one row per figure (``name``, ``gbps``, ``baseline``, ``ratio``)."""
    figures = await Figures.start(ordinal, repeat, progress, 1)
    rows, row, base = figures.rows, figures.rate, figures.base

    async with device_pair(ordinal) as pair:
        prompt, decoder, dev_src, host_src = pair.prompt, pair.decoder, pair.dev_src, pair.host_src
        dst, host, src_blocks, dst_blocks, rng = pair.dev, pair.host, pair.src_blocks, pair.dst_blocks, pair.rng
        cm = decoder.cache_manager

        async def pull(model: int) -> None:
            await cm.pull_blocks(BlocksCacheKey(1, model), dst, src_blocks, dst_blocks)

        progress("d2d pull: 64 x 128 scattered 32 KiB blocks from another process's device cache")
        row("d2d pull", _gbps(MOVED_BYTES, await _median_async(lambda: pull(0), repeat)), "d2d")
        await _check(prompt, dev_src, dst, src_blocks, dst_blocks)
        taken = set(dst_blocks)
        other_dst = [b for b in reversed(range(BLOCKS)) if b not in taken]  # the other 128 blocks

        async def two_in_flight() -> None:
            await asyncio.gather(pull(0), cm.pull_blocks(BlocksCacheKey(1, 0), dst, src_blocks, other_dst))

        progress("d2d pull, 2 calls in flight: the same 256 MiB into both halves of the destination at once")
        row("d2d pull, 2 calls in flight", _gbps(2 * MOVED_BYTES, await _median_async(two_in_flight, repeat)),
            "d2d")
        await _check(prompt, dev_src, dst, src_blocks, other_dst)
        runs = max(200, 20 * repeat)
        progress(f"d2d pull 2 MiB x {runs}: one block of each tensor")
        one = ([src_blocks[0]], [dst_blocks[0]])
        call = functools.partial(cm.pull_blocks, BlocksCacheKey(1, 0), dst, *one)
        lat = sorted(t * 1e6 for t in await _times(call, runs, warmup=10))
        rows.append({"name": "d2d pull 2 MiB", "p50_us": statistics.median(lat),
                     "p99_us": lat[max(0, int(len(lat) * 0.99) - 1)], "runs": runs})
        rows.extend(await _phases(decoder, call, runs, "2 MiB"))
        progress(f"d2d pull 2 MiB x {runs}, other blocks each call")
        picks = iter(rng.integers(0, BLOCKS, (runs * 2 + 20, 2)).tolist())

        def other_blocks() -> Awaitable[None]:
            s, d = next(picks)
            return cm.pull_blocks(BlocksCacheKey(1, 0), dst, [s], [d])

        lat = sorted(t * 1e6 for t in await _times(other_blocks, runs, warmup=10))
        rows.append({"name": "d2d pull 2 MiB, new blocks", "p50_us": statistics.median(lat),
                     "p99_us": lat[max(0, int(len(lat) * 0.99) - 1)], "runs": runs})
        rows.extend(await _phases(decoder, other_blocks, runs, "new blocks"))

        async def push() -> None:
            await cm.push_blocks(BlocksCacheKey(1, 0), dst, dst_blocks, src_blocks)

        row("d2d push", _gbps(MOVED_BYTES, await _median_async(push, repeat)), "d2d")
        await _check(prompt, dev_src, dst, src_blocks, dst_blocks)

        rows.extend(await _big_phases(decoder, lambda: pull(0), "d2d pull", repeat, base["d2d"]))
        rows.extend(await _big_phases(decoder, push, "d2d push", repeat, base["d2d"]))

        mapping = dict(zip(src_blocks, dst_blocks))
        reverse = dict(zip(dst_blocks, src_blocks))
        progress("swap_blocks between a host blocks cache and a device blocks cache")
        row("swap h2d", _gbps(MOVED_BYTES, await _median_async(lambda: cm.swap_blocks(host, dst, mapping),
                                                               repeat)), "h2d")
        row("swap d2h", _gbps(MOVED_BYTES, await _median_async(lambda: cm.swap_blocks(dst, host, reverse),
                                                               repeat)), "d2h")
        row("host->dev pull", _gbps(MOVED_BYTES, await _median_async(lambda: pull(1), repeat)), "h2d")
        await _check(prompt, host_src, dst, src_blocks, dst_blocks)
        progress("the copy kernel alone, 8192 scattered 32 KiB spans, by launch geometry")
        rows.extend(await asyncio.to_thread(kernel_sweep, decoder, ordinal, repeat, base["d2d"]))
    return rows


async def _phases(dd: LLMDataDist, call: Callable[[], Awaitable[Any]], runs: int, label: str
                  ) -> list[dict[str, Any]]:
    """Where a 2 MiB pull's time goes, from the GPU executor's timestamps of each call's copy: host time from the
    call to the copy's first driver call (validation, plan, spans, prepared launch), the driver calls that enqueue
    the copy (with the emulated GPU of the tests each wakes a thread, which a real driver does not), enqueue to
    the loop seeing the copy's event complete (the copy, plus at most one loop iteration), how late the loop learns
    of the end (from the first driver call to the loop seeing the end, less the copy's time between timed events
    around it: an upper bound, as the launch's latency is included; measured from the enqueue's end instead it
    could go negative, the GPU having started before the enqueue returned), and from the loop seeing it to the
    call's return.  These calls run with timed events (:func:`aiodatadist.testing.probes.gpu_copy_times`); the
    p50/p99 rows above run without."""
    names = [f"{label}: {phase}" for phase in ("host before the launch", "driver calls to enqueue",
                                                "launch to end seen", "GPU end to end seen", "end seen to return")]
    phases: dict[str, list[float]] = {name: [] for name in names}
    with probes.gpu_copy_times(dd) as latest:  # for "GPU end to end seen": events with timing around each copy
        for _ in range(runs):
            start = time.perf_counter()
            await call()
            end = time.perf_counter()
            job = latest()
            if job is None or not job.enqueued_at or not job.seen_at or job.enqueued_at < start or not job.gpu_seconds:
                continue  # completed by a stream callback, no copy of its own, or not timed
            seen = job.seen_at - job.enqueued_at
            late = job.seen_at - job.launch_at - job.gpu_seconds  # the start event is recorded after launch_at
            for name, value in zip(names, (job.launch_at - start, job.enqueued_at - job.launch_at, seen,
                                           late, end - job.seen_at), strict=True):
                phases[name].append(value * 1e6)
    return [{"name": name, "p50_us": statistics.median(v), "p99_us": sorted(v)[max(0, int(len(v) * 0.99) - 1)],
             "runs": len(v)} for name, v in phases.items() if v]


async def _big_phases(dd: LLMDataDist, call: Callable[[], Awaitable[Any]], label: str, repeat: int,
                      d2d_gbps: float) -> list[dict[str, Any]]:
    """The 256 MiB row ``label`` again with timed copies: the kernel's own rate (its time between events on the
    GPU, against ``cuMemcpyDtoD``) and the phases of the call around it (see :func:`_phases`)."""
    kernel: list[float] = []
    with probes.gpu_copy_times(dd) as latest:
        for _ in range(max(repeat, 5)):
            await call()
            job = latest()
            if job is not None and job.gpu_seconds:
                kernel.append(job.gpu_seconds)
    rows: list[dict[str, Any]] = []
    if kernel:
        gbps = _gbps(MOVED_BYTES, statistics.median(kernel))
        rows.append(rate_row(f"{label}: kernel alone", gbps, "d2d", d2d_gbps))
    return rows + await _phases(dd, call, max(repeat, 5), label)


SWEEP: Final = ((256, 8), (256, 4), (256, 2), (128, 16), (128, 8), (64, 32), (64, 16))
"""(threads per CTA, CTAs per SM) tried by :func:`kernel_sweep`; the first is what ``launch_geometry`` picks for
32 KiB spans on an sm_80/sm_90 GPU."""


def kernel_sweep(dd: LLMDataDist, ordinal: int, repeat: int, d2d_gbps: float) -> list[dict[str, Any]]:
    """The pointer-list kernel alone on 8192 scattered 32 KiB spans (256 MiB) between two device buffers, one
    launch per geometry of :data:`SWEEP` at a time on ``dd``'s stream, timed by events around it on the GPU (no
    host time in it): whether the shipped geometry reaches the device's copy limit, and how far the others are."""
    device = probes.gpu(ordinal)
    rng = np.random.default_rng(2)
    spans = TENSORS * MOVED
    area = spans * 2 * BLOCK_BYTES  # room for the spans, scattered over twice their size
    src, dst = device.alloc(area), device.alloc(area)
    rows: list[dict[str, Any]] = []
    try:
        device.memset(src, 5, area)
        slots = 2 * spans
        table = np.concatenate((
            np.uint64(src) + rng.permutation(slots)[:spans].astype(np.uint64) * np.uint64(BLOCK_BYTES),
            np.uint64(dst) + rng.permutation(slots)[:spans].astype(np.uint64) * np.uint64(BLOCK_BYTES),
            np.full(spans, BLOCK_BYTES, dtype=np.uint64)))
        for threads, per_sm in SWEEP:
            times = probes.time_copy_kernel(dd, table, spans, BLOCK_BYTES, MOVED_BYTES, block=threads,
                                            grid=min(spans, per_sm * device.sm_count), runs=max(repeat, 5) + 1)
            gbps = _gbps(MOVED_BYTES, statistics.median(times[1:]))  # the first stages the table
            rows.append(rate_row(f"kernel {threads} x {per_sm}/SM", gbps, "d2d", d2d_gbps))
    finally:
        device.synchronize()
        device.free(src)
        device.free(dst)
    return rows


async def _check(prompt: PeerProcess, cache_id: int, dst: Any, src_blocks: list[int], dst_blocks: list[int]) -> None:
    """The moved blocks of tensors 0 and 63 match the prompt's bytes (by digest of each block)."""
    mine = tensor_bytes(dst)
    for t in (0, TENSORS - 1):
        theirs = await prompt.call("block_digests", cache_id=cache_id, tensor=t, block_bytes=BLOCK_BYTES)
        got = mine[t].reshape(BLOCKS, BLOCK_BYTES)
        for s, d in zip(src_blocks, dst_blocks):
            if hashlib.sha256(got[d]).hexdigest() != theirs[s]:
                raise AssertionError(f"tensor {t}: block {s} -> {d} differs")


def print_rows(rows: list[dict[str, Any]]) -> None:
    sys.stdout.write(f"{'workload':<30} {'GB/s':>8}  {'baseline':<10} {'GB/s':>8}  ratio\n")
    for r in rows:
        if "info" in r:
            sys.stdout.write(f"{r['name']}: {r['info']}\n")
            continue
        if "p50_us" in r:
            sys.stdout.write(f"{r['name']:<30} p50 {r['p50_us']:.1f} us  p99 {r['p99_us']:.1f} us ({r['runs']} calls)\n")
            continue
        sys.stdout.write(f"{r['name']:<30} {r['gbps']:8.1f}  {r['baseline']:<10} {r['baseline_gbps']:8.1f}  "
                         f"{r['ratio']:.2f}x\n")
