"""The device-runtime table of CUDA's driver (``adt_device_ops``, filled in ``native/src/cuda.c``), driven the way a
native I/O thread would drive it, without the executor: bind the thread to the device, gather spans of device
memory into page-locked host memory with one launch of the pointer-list kernel, scatter them back, record and
query the event after each copy.  Byte-exact against numpy, with random non-zero data."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from helpers.device_ops import (
    CUDA_FUNCTIONS,
    EVENT_PENDING,
    EVENT_READY,
    NO_ROOM,
    DeviceLane,
    DeviceOps,
    device_ops,
)

from aiodatadist.cuda import Device
from aiodatadist.cuda.kernels import KERNEL_NAME, ptx_text
from aiodatadist.native import native_extension

CU_STREAM_NON_BLOCKING = 1
CU_EVENT_DISABLE_TIMING = 2
CUDA_ERROR_NOT_READY = 600
CAPACITY = 64  # descriptors the lane holds


@dataclass
class Rig:
    """A table, and what its gathers and scatters need on the device: the kernel, a stream, an event, a lane."""

    device: Device
    ops: DeviceOps
    lane: DeviceLane
    stream: ctypes.c_void_p
    event: ctypes.c_void_p

    def wait(self) -> int:
        """Record the event after what the stream holds and query it until it is done: the last query's code."""
        assert self.ops.record(self.ops.ctx, self.event, self.stream) == 0
        code = ctypes.c_int(-1)
        deadline = time.monotonic() + 30
        while self.ops.query(self.ops.ctx, self.event, self.stream, ctypes.byref(code)) == EVENT_PENDING:
            assert code.value == CUDA_ERROR_NOT_READY
            assert time.monotonic() < deadline, "the copy did not end in 30 s"
            time.sleep(0.0005)
        return code.value


@pytest.fixture
def rig(device: Device) -> Iterator[Rig]:
    ext = native_extension()
    if getattr(ext, "cuda_bind", None) is None:
        pytest.skip("the native helper is not built")
    drv = device.driver
    capsule = ext.cuda_bind(*(ctypes.cast(drv.fn(name), ctypes.c_void_p).value for name in CUDA_FUNCTIONS))
    device.make_current()
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    stream, event = ctypes.c_void_p(), ctypes.c_void_p()
    drv.call("cuModuleLoadData", ctypes.byref(module), ptx_text())
    drv.call("cuModuleGetFunction", ctypes.byref(function), module, KERNEL_NAME.encode())
    drv.call("cuStreamCreate", ctypes.byref(stream), CU_STREAM_NON_BLOCKING)
    drv.call("cuEventCreate", ctypes.byref(event), CU_EVENT_DISABLE_TIMING)
    staging, table = device.alloc_pinned(24 * CAPACITY), device.alloc(24 * CAPACITY)
    lane = DeviceLane(kernel=function.value, stream=stream.value, staging=staging, device_table=table,
                      capacity=CAPACITY, piece=4096, block=256, max_grid=8)
    try:
        yield Rig(device, device_ops(capsule), lane, stream, event)
    finally:
        device.make_current()
        drv.call("cuStreamSynchronize", stream)
        drv.fn("cuEventDestroy_v2")(event)
        drv.fn("cuStreamDestroy_v2")(stream)
        drv.fn("cuModuleUnload")(module)
        device.free(table)
        device.free_pinned(staging)
        del capsule


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8)


def _host_view(address: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address))


# Spans of a 64 KiB buffer: scattered, one empty, two that continue each other (merged), one cut into pieces.
OFFSETS = [40960, 3, 1000, 1000, 1500, 9000, 20000]
LENGTHS = [77, 900, 0, 500, 7000, 10000, 16]


def test_gather_then_scatter_moves_every_byte_through_host_memory(rig: Rig) -> None:
    device, ops = rig.device, rig.ops
    size, total = 1 << 16, sum(LENGTHS)
    source_data, model = _random(size, 1), _random(size, 2)
    source, destination = device.alloc(size), device.alloc(size)
    host = device.alloc_pinned(total)
    try:
        device.copy_htod(source, source_data.ctypes.data, size)
        device.copy_htod(destination, model.ctypes.data, size)
        lengths = np.array(LENGTHS, np.uint64)
        addr = np.array(OFFSETS, np.uint64) + np.uint64(source)
        assert ops.bind(ops.ctx, device.context) == 0
        host_at = device.host_device_pointer(host)
        assert ops.gather(ops.ctx, ctypes.byref(rig.lane), addr.ctypes.data, lengths.ctypes.data, len(lengths),
                          host_at) == 0
        assert rig.wait() == 0
        expected = np.concatenate([source_data[o:o + n] for o, n in zip(OFFSETS, LENGTHS, strict=True)])
        assert np.array_equal(_host_view(host, total), expected)

        # back into other places of another buffer
        places = [60000, 0, 500, 2000, 2500, 30000, 50000]
        for o, n, p in zip(OFFSETS, LENGTHS, places, strict=True):
            model[p:p + n] = source_data[o:o + n]
        addr = np.array(places, np.uint64) + np.uint64(destination)
        assert ops.scatter(ops.ctx, ctypes.byref(rig.lane), host_at, addr.ctypes.data, lengths.ctypes.data,
                           len(lengths)) == 0
        assert rig.wait() == 0
        landed = np.zeros(size, np.uint8)
        device.copy_dtoh(landed.ctypes.data, destination, size)
        assert np.array_equal(landed, model)
    finally:
        device.free(source)
        device.free(destination)
        device.free_pinned(host)


def test_more_pieces_than_the_lane_holds_run_nothing(rig: Rig) -> None:
    device, ops = rig.device, rig.ops
    buffer, host = device.alloc(1 << 20), device.alloc_pinned(1 << 20)
    try:
        # one span of CAPACITY + 1 pieces
        addr, lengths = np.array([buffer], np.uint64), np.array([(CAPACITY + 1) * rig.lane.piece], np.uint64)
        assert ops.bind(ops.ctx, device.context) == 0
        assert ops.gather(ops.ctx, ctypes.byref(rig.lane), addr.ctypes.data, lengths.ctypes.data, 1,
                          device.host_device_pointer(host)) == NO_ROOM
        empty = np.zeros(0, np.uint64)
        assert ops.gather(ops.ctx, ctypes.byref(rig.lane), empty.ctypes.data, empty.ctypes.data, 0, host) == 0
        assert rig.wait() == 0
    finally:
        device.free(buffer)
        device.free_pinned(host)


def test_bind_makes_the_device_current_on_this_thread(rig: Rig) -> None:
    drv, ops = rig.device.driver, rig.ops
    drv.call("cuCtxSetCurrent", ctypes.c_void_p(None))
    assert ops.bind(ops.ctx, rig.device.context) == 0
    current = ctypes.c_void_p()
    drv.call("cuCtxGetCurrent", ctypes.byref(current))
    assert current.value == rig.device.context
    assert ops.bind(ops.ctx, rig.device.context) == 0  # already current: nothing to do


def test_query_says_pending_while_the_copy_runs(rig: Rig, gpu_mode: str) -> None:
    if gpu_mode != "emulated":
        pytest.skip("holds a copy on the emulated GPU")
    device, ops = rig.device, rig.ops
    hold = ctypes.c_int.in_dll(device.driver.lib, "fake_hold")
    buffer, host = device.alloc(4096), device.alloc_pinned(4096)
    try:
        addr, lengths = np.array([buffer], np.uint64), np.array([4096], np.uint64)
        assert ops.bind(ops.ctx, device.context) == 0
        hold.value = 1
        assert ops.gather(ops.ctx, ctypes.byref(rig.lane), addr.ctypes.data, lengths.ctypes.data, 1, host) == 0
        assert ops.record(ops.ctx, rig.event, rig.stream) == 0
        code = ctypes.c_int(-1)
        assert ops.query(ops.ctx, rig.event, rig.stream, ctypes.byref(code)) == EVENT_PENDING
        assert code.value == CUDA_ERROR_NOT_READY
        hold.value = 0
        assert rig.wait() == 0
        assert ops.query(ops.ctx, rig.event, rig.stream, ctypes.byref(code)) == EVENT_READY and code.value == 0
    finally:
        hold.value = 0
        device.free(buffer)
        device.free_pinned(host)
