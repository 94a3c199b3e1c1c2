"""Probe (GPU machines only): the copy engines' batched copy (cuMemcpyBatchAsync, CUDA 12.8+) against the
pointer-list kernel, for 8192 scattered 32 KiB spans host->device, device->host and device->device, timed by
events on the GPU.  Prints one line per figure; never part of the test suite."""

from __future__ import annotations

import ctypes
import statistics
import sys

import numpy as np

from aiodatadist.cuda import get_device
from aiodatadist.cuda.executor import CudaExecutor, _Work

SPANS, SPAN = 8192, 32 << 10
TOTAL = SPANS * SPAN


class Attrs(ctypes.Structure):
    _fields_ = [("order", ctypes.c_int), ("src_type", ctypes.c_int), ("src_id", ctypes.c_int),
                ("dst_type", ctypes.c_int), ("dst_id", ctypes.c_int), ("flags", ctypes.c_uint)]


def main() -> int:
    device = get_device(0)
    drv = device.driver
    lib = ctypes.CDLL(drv.path)
    ex = CudaExecutor(device)
    stream = ex._stream
    area = 2 * TOTAL
    dev_a, dev_b, host = device.alloc(area), device.alloc(area), device.alloc_pinned(area)
    rng = np.random.default_rng(3)
    start, end = ex._record_event(timed=True), ex._record_event(timed=True)

    def offsets() -> np.ndarray:
        return rng.permutation(2 * SPANS)[:SPANS].astype(np.uint64) * np.uint64(SPAN)

    def timed(enqueue) -> float:
        times = []
        for _ in range(6):
            drv.call("cuEventRecord", start, stream)
            enqueue()
            drv.call("cuEventRecord", end, stream)
            drv.call("cuEventSynchronize", end)
            ms = ctypes.c_float()
            drv.call("cuEventElapsedTime_v2", ctypes.byref(ms), start, end)
            times.append(ms.value / 1e3)
        return TOTAL / statistics.median(times[1:]) / 1e9

    batch = getattr(lib, "cuMemcpyBatchAsync_v2", None)
    batch_v1 = getattr(lib, "cuMemcpyBatchAsync", None)
    print(f"cuMemcpyBatchAsync_v2: {batch is not None}, cuMemcpyBatchAsync: {batch_v1 is not None}")
    for name, src_base, dst_base in (("h2d", host, dev_a), ("d2h", dev_a, host), ("d2d", dev_a, dev_b)):
        src = np.uint64(src_base) + offsets()
        dst = np.uint64(dst_base) + offsets()
        lengths = np.full(SPANS, SPAN, dtype=np.uint64)
        table = np.concatenate((src, dst, lengths))
        launch = ex._table_launch(TOTAL, table.copy(), SPANS, SPAN)

        def kernel(launch=launch) -> None:
            work = _Work()
            ex._submit(launch, work)

        print(f"{name} kernel: {timed(kernel):.1f} GB/s")
        raw = {"h2d": "cuMemcpyHtoDAsync_v2", "d2h": "cuMemcpyDtoHAsync_v2", "d2d": "cuMemcpyDtoDAsync_v2"}[name]
        whole_fn = getattr(lib, raw, None)
        if whole_fn is None:
            print(f"{name}: the driver lacks {raw}")
            continue
        whole_fn.restype = ctypes.c_int

        def whole(fn=whole_fn, name=name) -> None:
            s_, d_ = (host, dev_b) if name == "h2d" else (dev_a, host) if name == "d2h" else (dev_a, dev_b)
            rc = fn(ctypes.c_uint64(d_) if name != "d2h" else ctypes.c_void_p(d_),
                    ctypes.c_uint64(s_) if name != "h2d" else ctypes.c_void_p(s_), ctypes.c_size_t(TOTAL), stream)
            if rc:
                raise RuntimeError(f"rc={rc}")

        try:
            print(f"{name} one contiguous async copy: {timed(whole):.1f} GB/s")
        except Exception as exc:  # noqa: BLE001
            print(f"{name} one contiguous copy failed: {exc}")
        dsts = (ctypes.c_uint64 * SPANS)(*dst.tolist())
        srcs = (ctypes.c_uint64 * SPANS)(*src.tolist())
        sizes = (ctypes.c_size_t * SPANS)(*lengths.tolist())
        attrs = Attrs(1, 0, 0, 0, 0, 0)  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, no location hints
        idxs = (ctypes.c_size_t * 1)(0)
        fail = ctypes.c_size_t(0)
        for label, fn, extra in (("v2", batch, ()),) if batch is not None else (("v1", batch_v1, (ctypes.byref(fail),)),):
            if fn is None:
                continue
            fn.restype = ctypes.c_int

            def call(fn=fn, extra=extra, dsts=dsts, srcs=srcs, sizes=sizes, attrs=attrs, idxs=idxs) -> None:
                rc = fn(dsts, srcs, sizes, ctypes.c_size_t(SPANS), ctypes.byref(attrs), idxs, ctypes.c_size_t(1),
                        *extra, stream)
                if rc:
                    raise RuntimeError(f"rc={rc} ({drv.describe(rc)})")

            try:
                print(f"{name} batch {label}: {timed(call):.1f} GB/s")
            except Exception as exc:  # noqa: BLE001
                print(f"{name} batch {label} failed: {exc}")
                device.synchronize()
    device.synchronize()
    ex.close()
    device.free(dev_a)
    device.free(dev_b)
    device.free_pinned(host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
