"""CUDA behind the copy layer's device-runtime interface (:class:`aiodatadist.copy.device_runtime.DeviceRuntime`):
one device's primary context and the executor that copies on its stream."""

from __future__ import annotations

from .driver import get_device
from .executor import CudaExecutor

__all__ = ["CudaRuntime"]


class CudaRuntime:
    """Device ``ordinal`` through the CUDA driver API; raises ``LLM_FEATURE_NOT_ENABLED`` (saying why) without a
    usable GPU."""

    name = "cuda"

    def __init__(self, ordinal: int) -> None:
        self.device = get_device(ordinal)
        self.ordinal = ordinal
        self.executor = CudaExecutor(self.device)

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

    def address_range(self, ptr: int) -> tuple[int, int]:
        return self.device.address_range(ptr)

    def ipc_handle(self, ptr: int) -> bytes:
        return self.device.ipc_handle(ptr)

    def ipc_open(self, handle: bytes) -> int:
        return self.device.ipc_open(handle)

    def ipc_close(self, ptr: int) -> None:
        self.device.ipc_close(ptr)

    def copy_to_device(self, dst: int, src_host: int, nbytes: int) -> None:
        self.device.copy_htod(dst, src_host, nbytes)

    def copy_to_host(self, dst_host: int, src: int, nbytes: int) -> None:
        self.device.copy_dtoh(dst_host, src, nbytes)

    def close(self) -> None:
        self.executor.close()
