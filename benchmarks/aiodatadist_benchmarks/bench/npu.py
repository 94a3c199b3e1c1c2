"""aiodatadist's NPU copies against the NPU's own ``aclrtMemcpy`` of the same bytes, in one run: what
``scripts/npu_checks.sh`` prints on an Ascend machine.

``python -m aiodatadist_benchmarks.bench.npu [--repeat N] [--quick]``: one instance (``Placement.DEVICE`` through
ACL) and, for each shape, the baseline measured in the same run:

* ``copy_blocks`` within device memory, 4 contiguous 64 MiB blocks and 8192 scattered 32 KiB blocks (256 MiB),
  against one ``aclrtMemcpy`` (device to device) of 256 MiB;
* ``swap_blocks`` host -> device and device -> host (a page-locked host cache) of the same shapes, against one
  ``aclrtMemcpy`` of 256 MiB over the bus each way.

Every shape is checked byte-exact once.  Prints one line per figure: GB/s medians and the ratio to the baseline.
On the emulated runtime (``AIODATADIST_LIBASCENDCL`` naming ``fake_libascendcl``) the figures mean nothing but the
run checks the path; ``--quick`` shrinks the shapes for that.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from aiodatadist import CacheDesc, DataType, LLMDataDist, LLMRole, Placement
from aiodatadist.testing import fill_pattern, tensor_bytes

__all__ = ["main"]

ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE = 1, 2, 3


def _median_rate(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


async def _timed(call: Callable[[], Awaitable[None]], repeat: int) -> list[float]:
    await call()  # warm
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        await call()
        out.append(time.perf_counter() - start)
    return out


def _baseline(dev: Any, kind: int, nbytes: int, repeat: int) -> float:
    """GB/s of one synchronous ``aclrtMemcpy`` of ``nbytes`` (median) on ``dev`` (an
    :class:`aiodatadist.acl.device.AclDevice`)."""
    a = dev.alloc(nbytes)
    host = dev.alloc_pinned(nbytes) if kind != ACL_MEMCPY_DEVICE_TO_DEVICE else 0
    b = dev.alloc(nbytes) if kind == ACL_MEMCPY_DEVICE_TO_DEVICE else host
    src, dst = (a, b) if kind != ACL_MEMCPY_HOST_TO_DEVICE else (b, a)
    try:
        times = []
        for _ in range(repeat + 1):
            start = time.perf_counter()
            dev.copy(dst, src, nbytes, kind)
            times.append(time.perf_counter() - start)
        return _median_rate(nbytes, times[1:])
    finally:
        dev.free(a)
        if kind == ACL_MEMCPY_DEVICE_TO_DEVICE:
            dev.free(b)
        else:
            dev.free_pinned(host)


async def _shape(cm: Any, base: dict[int, float], name: str, blocks: int, block: int, repeat: int) -> int:
    """One shape's rows (``blocks`` of ``block`` bytes); returns 1 if its copy was not byte-exact."""
    cache = cm.allocate_blocks_cache(CacheDesc(1, (2 * blocks, block), DataType.DT_UINT8, Placement.DEVICE))
    host = cm.allocate_blocks_cache(CacheDesc(1, (blocks, block), DataType.DT_UINT8, Placement.HOST))
    try:
        data = fill_pattern(cache, 11)[0].reshape(2 * blocks, block)
        fill_pattern(host, 12)
        moves = {i: [blocks + i] for i in range(blocks)}
        same = {i: i for i in range(blocks)}
        failed = 0
        await cm.copy_blocks(cache, moves)
        if not np.array_equal(tensor_bytes(cache)[0].reshape(2 * blocks, block)[blocks:], data[:blocks]):
            print(f"FAILED: copy_blocks {name} is not byte-exact")
            failed = 1
        rows: list[tuple[str, Callable[[], Awaitable[None]], int]] = [
            ("copy_blocks d2d", lambda: cm.copy_blocks(cache, moves), ACL_MEMCPY_DEVICE_TO_DEVICE),
            ("swap h2d", lambda: cm.swap_blocks(host, cache, same), ACL_MEMCPY_HOST_TO_DEVICE),
            ("swap d2h", lambda: cm.swap_blocks(cache, host, same), ACL_MEMCPY_DEVICE_TO_HOST),
        ]
        for label, call, kind in rows:
            rate = _median_rate(blocks * block, await _timed(call, repeat))
            print(f"{label:16s} {name:14s} {rate:8.2f} GB/s  = {rate / base[kind]:.2f}x aclrtMemcpy")
        return failed
    finally:
        cm.deallocate_blocks_cache(cache)
        cm.deallocate_blocks_cache(host)


async def run(repeat: int, quick: bool) -> int:
    os.environ.setdefault("AIODATADIST_DEVICE_RUNTIME", "acl")
    scale = 16 if quick else 1
    big, small = (64 << 20) // scale, (32 << 10) // scale
    shapes = [("4 x 64 MiB", 4, big), ("8192 x 32 KiB", 8192, small)]
    failures = 0
    async with LLMDataDist(LLMRole.PROMPT, 1) as prompt:
        await prompt.init({})
        runtime = prompt.cache_manager._device().runtime
        device = runtime.device
        print(f"runtime: {runtime.name}, {device.library.version_string} at {device.library.path}")
        nbytes = 4 * big
        base = {k: _baseline(device, k, nbytes, repeat) for k in (ACL_MEMCPY_DEVICE_TO_DEVICE,
                                                                  ACL_MEMCPY_HOST_TO_DEVICE,
                                                                  ACL_MEMCPY_DEVICE_TO_HOST)}
        print(f"baseline aclrtMemcpy {nbytes >> 20} MiB: d2d {base[3]:.1f} GB/s, h2d {base[1]:.1f} GB/s, "
              f"d2h {base[2]:.1f} GB/s")
        for name, blocks, block in shapes:
            failures += await _shape(prompt.cache_manager, base, name, blocks, block, repeat)
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="small shapes (the emulated runtime)")
    args = parser.parse_args()
    raise SystemExit(asyncio.run(run(args.repeat, args.quick)))


if __name__ == "__main__":
    main()


