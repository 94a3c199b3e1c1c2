"""ACL behind the copy layer's device-runtime interface (:class:`aiodatadist.copy.device_runtime.DeviceRuntime`):
one NPU's default context (shared with torch_npu) and the executor that copies on its stream.

Verified on the emulated runtime only (``tests/helpers/fake_libascendcl.c``): see ``docs/design.md``, "Ascend NPUs
through ACL", for what has to be checked first on hardware.
"""

from __future__ import annotations

import ctypes

from ..errors import LLMException, LLMStatusCode
from ..native import Lane
from .device import ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, AclDevice, acl_device
from .executor import ACL_EVENT_SYNC, ACL_STOP_ON_FAILURE, AclExecutor

__all__ = ["AclRuntime"]


class AclRuntime:
    """NPU ``ordinal`` through ACL; raises ``LLM_FEATURE_NOT_ENABLED`` (saying why) without a usable NPU."""

    name = "acl"

    def __init__(self, ordinal: int) -> None:
        self.device: AclDevice = acl_device(ordinal)
        self.ordinal = ordinal
        self.executor = AclExecutor(self.device)

    @property
    def ipc_pid(self) -> int:
        """The PID a peer whitelists for this process's imports (its bare TGID)."""
        return self.device.ipc_pid

    def bind_thread(self) -> None:
        self.device.bind_thread()

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
        return self.device.address_range(ptr, nbytes)

    def ipc_handle(self, ptr: int, importer: int | None = None) -> bytes:
        return self.device.ipc_handle(ptr, importer)

    def ipc_open(self, handle: bytes) -> int:
        return self.device.ipc_open(handle)

    def ipc_close(self, ptr: int) -> None:
        self.device.ipc_close(ptr)

    def ipc_withdraw(self, ptr: int) -> None:
        self.device.withdraw(ptr)

    def device_table(self) -> tuple[object, int]:
        table = self.executor.device_table
        if table is None:
            raise LLMException("staging NPU memory needs the native helper (it is not built)",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        return table, self.device.context

    def open_lane(self, capacity: int, chunk_bytes: int) -> Lane:
        """A stream of its own (stopping at a failed copy), an event and page-locked room for ``capacity``
        descriptors; ACL copies spans of any length, so nothing is cut into pieces."""
        device, lib = self.device, self.device.library
        device.bind_thread()
        stream, event = ctypes.c_void_p(), ctypes.c_void_p()
        lib.call("aclrtCreateStream", ctypes.byref(stream))
        try:
            if lib.has("aclrtSetStreamFailureMode"):
                lib.call("aclrtSetStreamFailureMode", stream, ACL_STOP_ON_FAILURE)
            if lib.has("aclrtCreateEventExWithFlag"):  # re-recorded after every copy
                lib.call("aclrtCreateEventExWithFlag", ctypes.byref(event), ACL_EVENT_SYNC)
            else:
                lib.call("aclrtCreateEvent", ctypes.byref(event))
            try:
                staging = device.alloc_pinned(24 * capacity)
            except BaseException:
                lib.fn("aclrtDestroyEvent")(event)
                raise
        except BaseException:
            lib.fn("aclrtDestroyStream")(stream)
            raise
        return Lane(kernel=0, stream=stream.value or 0, staging=staging, device_table=0, capacity=capacity, piece=0,
                    block=0, max_grid=0, event=event.value or 0)

    def close_lane(self, lane: Lane) -> None:
        device, lib = self.device, self.device.library
        device.bind_thread()
        stream = ctypes.c_void_p(lane.stream)
        lib.fn("aclrtSynchronizeStream")(stream)
        lib.fn("aclrtDestroyEvent")(ctypes.c_void_p(lane.event))
        lib.fn("aclrtDestroyStream")(stream)
        device.free_pinned(lane.staging)

    def copy_to_device(self, dst: int, src_host: int, nbytes: int) -> None:
        self.device.copy(dst, src_host, nbytes, ACL_MEMCPY_HOST_TO_DEVICE)

    def copy_to_host(self, dst_host: int, src: int, nbytes: int) -> None:
        self.device.copy(dst_host, src, nbytes, ACL_MEMCPY_DEVICE_TO_HOST)

    def close(self) -> None:
        self.executor.close()
        self.device.close()
