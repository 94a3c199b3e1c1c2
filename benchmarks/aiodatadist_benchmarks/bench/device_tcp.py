"""``bench --device --transport tcp``: device caches over a TCP link (staged through page-locked memory), against
the host-memory TCP plane and the GPU's page-locked copies, all measured in the same run.

A prompt in another process and a decoder here, linked with ``llm.Transport=tcp`` on loopback; each side has a
device and a host blocks cache of 64 tensors x 256 blocks of 32 KiB, and 128 scattered blocks of each tensor move
(256 MiB):

* ``tcp d2d pull`` / ``tcp d2d push``: device cache to device cache (both sides staged), each run in turn with
  the same transfer between the two host caches (``tcp host pull`` / ``tcp host push``), the baseline it is held
  to;
* ``tcp host->dev pull`` / ``tcp dev->host pull``: one side staged;
* ``tcp d2d pull 2 MiB`` / ``tcp host pull 2 MiB``: one block of each tensor, p50/p99 over ``max(200, 20 x
  repeat)`` calls;
* the GPU's own ``cuMemcpyDtoH`` / ``cuMemcpyHtoD`` of 256 MiB page-locked memory, for scale.

GB/s = bytes moved / second; medians over ``--repeat``; every kind of transfer is checked byte-exact once.  On the
emulated GPU (no NVIDIA GPU) the device copies are CPU copies, so the ratios bound the pipeline's own cost.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

from aiodatadist import BlocksCacheKey

from .device import Figures, _check, _gbps, rate_row
from .device_pair import MOVED_BYTES, device_pair
from .timing import interleaved_times

__all__ = ["run_device_tcp_bench"]


async def run_device_tcp_bench(repeat: int, ordinal: int = 0,
                               progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Run the device-over-TCP workloads; one row per figure (``name``, ``gbps``, ``baseline``, ``ratio``)."""
    figures = await Figures.start(ordinal, repeat, progress, 2)
    rows, row = figures.rows, figures.rate

    async with device_pair(ordinal, "tcp") as pair:
        prompt, decoder, dev_src, host_src = pair.prompt, pair.decoder, pair.dev_src, pair.host_src
        dev, host, src_blocks, dst_blocks = pair.dev, pair.host, pair.src_blocks, pair.dst_blocks
        cm = decoder.cache_manager

        async def measured(name: str, call: Callable[[], Any], against: str,
                           baseline: Callable[[], Any]) -> float:
            """``call`` and its host-memory ``baseline`` in turn, ``repeat`` times each (a loaded machine's
            noise falls on both alike): both medians, and the row of their ratio."""
            progress(f"{name}: 64 x 128 scattered 32 KiB blocks over TCP, in turn with {against}")
            ours, theirs = await interleaved_times([call, baseline], repeat)
            await call()  # last: the destination holds what it moved, for the check that follows
            gbps, base_gbps = (_gbps(MOVED_BYTES, statistics.median(t)) for t in (ours, theirs))
            rows.append(rate_row(name, gbps, against, base_gbps))
            progress(f"{name}: {gbps:.2f} GB/s ({gbps / base_gbps:.2f}x {against} at {base_gbps:.2f})")
            return gbps

        def pull(model: int, dst: Any) -> Callable[[], Any]:
            return functools.partial(cm.pull_blocks, BlocksCacheKey(1, model), dst, src_blocks, dst_blocks)

        def push(model: int, src: Any) -> Callable[[], Any]:
            return functools.partial(cm.push_blocks, BlocksCacheKey(1, model), src, dst_blocks, src_blocks)

        host_pull, host_push = pull(1, host), push(1, host)
        await host_pull()
        await _check(prompt, host_src, host, src_blocks, dst_blocks)
        d2d = await measured("tcp d2d pull", pull(0, dev), "tcp host pull", host_pull)
        await _check(prompt, dev_src, dev, src_blocks, dst_blocks)
        await measured("tcp host->dev pull", pull(1, dev), "tcp host pull", host_pull)
        await _check(prompt, host_src, dev, src_blocks, dst_blocks)
        await measured("tcp dev->host pull", pull(0, host), "tcp host pull", host_pull)
        await _check(prompt, dev_src, host, src_blocks, dst_blocks)
        # (the pushes write back what was pulled: the check holds after them too)
        await measured("tcp d2d push", push(0, dev), "tcp host push", host_push)
        await _check(prompt, dev_src, dev, src_blocks, dst_blocks)
        row("tcp d2d pull, vs page-locked d2h", d2d, "d2h")
        row("tcp d2d pull, vs page-locked h2d", d2d, "h2d")
        runs = max(200, 20 * repeat)
        progress(f"2 MiB pulls x {runs}, host and device in turn: one block of each tensor")
        small = {name: functools.partial(cm.pull_blocks, BlocksCacheKey(1, model), dst, [src_blocks[0]],
                                         [dst_blocks[0]])
                 for name, model, dst in (("tcp host pull 2 MiB", 1, host), ("tcp d2d pull 2 MiB", 0, dev))}
        samples = await interleaved_times(list(small.values()), runs, warmup=10)
        for name, seconds in zip(small, samples):
            got = sorted(t * 1e6 for t in seconds)
            rows.append({"name": name, "p50_us": statistics.median(got),
                         "p99_us": got[max(0, int(len(got) * 0.99) - 1)], "runs": len(got)})
        rows.append({"name": "tcp d2d pull 2 MiB p50, vs the host's", "info":
                     f"{rows[-1]['p50_us'] / rows[-2]['p50_us']:.2f}x"})
        rows.append({"name": "staging", "info": decoder.links()[0]["staging"]})
    return rows
