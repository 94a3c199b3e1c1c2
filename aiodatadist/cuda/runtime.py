"""CUDA behind the copy layer's device-runtime interface (:class:`aiodatadist.copy.device_runtime.DeviceRuntime`):
one device's primary context and the executor that copies on its stream."""

from __future__ import annotations

import ctypes
import os

from ..errors import LLMException, LLMStatusCode
from ..native import Lane
from .driver import CU_EVENT_DISABLE_TIMING, CU_STREAM_NON_BLOCKING, get_device
from .executor import CudaExecutor
from .kernels import MAX_BLOCK, choose_piece

__all__ = ["CudaRuntime"]


class CudaRuntime:
    """Device ``ordinal`` through the CUDA driver API; raises ``LLM_FEATURE_NOT_ENABLED`` (saying why) without a
    usable GPU."""

    name = "cuda"

    def __init__(self, ordinal: int) -> None:
        self.device = get_device(ordinal)
        self.ordinal = ordinal
        self.executor = CudaExecutor(self.device)

    @property
    def ipc_pid(self) -> int:
        return os.getpid()

    def bind_thread(self) -> None:
        self.device.make_current()

    def alloc(self, nbytes: int) -> int:
        return self.device.alloc(nbytes)

    def free(self, ptr: int) -> None:
        self.device.free(ptr)

    def alloc_pinned(self, nbytes: int) -> int:
        return self.device.alloc_pinned(nbytes)

    def free_pinned(self, ptr: int) -> None:
        self.device.free_pinned(ptr)

    def register_host(self, addr: int, nbytes: int) -> int:
        return self.device.register_host(addr, nbytes)

    def unregister_host(self, addr: int) -> None:
        self.device.unregister_host(addr)

    def is_device_pointer(self, ptr: int) -> bool:
        return self.device.is_device_pointer(ptr)

    def address_range(self, ptr: int, nbytes: int = 0) -> tuple[int, int]:
        return self.device.address_range(ptr)

    def ipc_handle(self, ptr: int, importer: int | None = None) -> bytes:
        return self.device.ipc_handle(ptr)  # CUDA's IPC names no importer

    def ipc_open(self, handle: bytes) -> int:
        return self.device.ipc_open(handle)

    def ipc_close(self, ptr: int) -> None:
        self.device.ipc_close(ptr)

    def ipc_withdraw(self, ptr: int) -> None:
        pass  # a CUDA IPC handle needs no closing by its exporter

    def device_table(self) -> tuple[object, int]:
        table = self.executor.device_table
        if table is None:
            raise LLMException("staging device memory needs the native helper (it is not built)",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        return table, self.device.context

    def open_lane(self, capacity: int, chunk_bytes: int) -> Lane:
        device, drv = self.device, self.device.driver
        device.make_current()
        stream, event = ctypes.c_void_p(), ctypes.c_void_p()
        drv.call("cuStreamCreate", ctypes.byref(stream), CU_STREAM_NON_BLOCKING)
        try:
            drv.call("cuEventCreate", ctypes.byref(event), CU_EVENT_DISABLE_TIMING)
            try:
                staging = device.alloc_pinned(24 * capacity)
                try:
                    table = device.alloc(24 * capacity)
                except BaseException:
                    device.free_pinned(staging)
                    raise
            except BaseException:
                drv.fn("cuEventDestroy_v2")(event)
                raise
        except BaseException:
            drv.fn("cuStreamDestroy_v2")(stream)
            raise
        # A chunk's pieces shared out to every SM, several each (the CTAs loop over further pieces).
        return Lane(kernel=self.executor.kernel, stream=stream.value or 0, staging=staging, device_table=table,
                    capacity=capacity, piece=choose_piece(chunk_bytes, sm_count=device.sm_count), block=MAX_BLOCK,
                    max_grid=4 * device.sm_count, event=event.value or 0)

    def close_lane(self, lane: Lane) -> None:
        device, drv = self.device, self.device.driver
        device.make_current()
        drv.fn("cuStreamSynchronize")(ctypes.c_void_p(lane.stream))
        drv.fn("cuEventDestroy_v2")(ctypes.c_void_p(lane.event))
        drv.fn("cuStreamDestroy_v2")(ctypes.c_void_p(lane.stream))
        device.free(lane.device_table)
        device.free_pinned(lane.staging)

    def copy_to_device(self, dst: int, src_host: int, nbytes: int) -> None:
        self.device.copy_htod(dst, src_host, nbytes)

    def copy_to_host(self, dst_host: int, src: int, nbytes: int) -> None:
        self.device.copy_dtoh(dst_host, src, nbytes)

    def close(self) -> None:
        self.executor.close()
