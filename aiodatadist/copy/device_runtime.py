"""The device-runtime interface: what the copy layer needs of a device runtime, and the one this process uses.

A runtime is one device of this process (an ordinal) and the executor that copies spans on it.  Everything above
the copy layer (the planes, the registry, the facade) reaches a device only through :class:`DeviceRuntime`, so a
second runtime (ACL on Ascend) plugs in by implementing it; CUDA implements it in
:class:`aiodatadist.cuda.runtime.CudaRuntime`.  Addresses are plain ints in the process's unified address space:
device memory, a peer's memory opened through IPC and page-locked host memory are all valid span ends.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..jobs.base import ExecutorJob
from ..layout.plans import CopyPlan
from ..native import Lane

__all__ = ["DeviceExecutor", "DeviceRuntime", "Lane", "open_runtime", "runtime_status"]

UInt64Array = npt.NDArray[np.uint64]


class DeviceExecutor(Protocol):
    """Copies a plan's spans on the device (within it, and over the bus to and from page-locked host memory),
    completing each job through an event the executor records after it and polls."""

    def start_plan(self, plan: CopyPlan, src_addrs: UInt64Array, dst_addrs: UInt64Array) -> ExecutorJob: ...

    async def wait(self, job: ExecutorJob) -> None:
        """Await a job; a cancelled caller returns only once the device no longer writes for it."""
        ...

    def cancel(self, job: ExecutorJob, error: BaseException | None = None) -> None: ...

    def close(self) -> None: ...


class DeviceRuntime(Protocol):
    """One device of this process, as the copy layer uses it.  Every method may be called from any thread: it
    binds the calling thread to the device first."""

    name: str
    """The runtime's name (``"cuda"``), as ``links()`` and ``aiodatadist info`` report it."""
    ordinal: int
    """The device's ordinal among the visible devices (``LLMConfig.device_id``)."""

    @property
    def executor(self) -> DeviceExecutor:
        """The executor copying on this device (one per runtime)."""
        ...

    def bind_thread(self) -> None:
        """Make this device current on the calling thread."""
        ...

    def alloc(self, nbytes: int) -> int: ...

    def free(self, ptr: int) -> None: ...

    def alloc_pinned(self, nbytes: int) -> int:
        """Page-locked host memory the device reads and writes at bus speed."""
        ...

    def free_pinned(self, ptr: int) -> None: ...

    def register_host(self, addr: int, nbytes: int) -> int:
        """Page-lock existing host memory for device copies; returns its device address."""
        ...

    def unregister_host(self, addr: int) -> None: ...

    def is_device_pointer(self, ptr: int) -> bool:
        """Whether ``ptr`` is memory of this device."""
        ...

    def address_range(self, ptr: int) -> tuple[int, int]:
        """``(base, size)`` of the allocation holding device address ``ptr``."""
        ...

    def ipc_handle(self, ptr: int) -> bytes:
        """The handle a same-host process opens to reach the allocation at ``ptr``."""
        ...

    def ipc_open(self, handle: bytes) -> int:
        """Open a same-host peer's allocation; returns its address in this process."""
        ...

    def ipc_close(self, ptr: int) -> None: ...

    def device_table(self) -> tuple[object, int]:
        """The native device-runtime table (a capsule named ``aiodatadist.native.device_ops``: bind, gather,
        scatter, record, query) and the device handle its ``bind`` takes; raises ``LLM_FEATURE_NOT_ENABLED``
        without the native helper."""
        ...

    def open_lane(self, capacity: int, chunk_bytes: int) -> Lane:
        """A stream of its own, an event and descriptor memory for ``capacity`` descriptors, shaped for copies
        of about ``chunk_bytes``."""
        ...

    def close_lane(self, lane: Lane) -> None:
        """Free what :meth:`open_lane` made (its stream is waited for first)."""
        ...

    def copy_to_device(self, dst: int, src_host: int, nbytes: int) -> None:
        """A synchronous copy from host memory (for checks and tests; transfers go through the executor)."""
        ...

    def copy_to_host(self, dst_host: int, src: int, nbytes: int) -> None:
        """A synchronous copy to host memory (for checks and tests; transfers go through the executor)."""
        ...

    def close(self) -> None:
        """Stop the executor once its work is done."""
        ...


def open_runtime(ordinal: int) -> DeviceRuntime:
    """The runtime of device ``ordinal`` (CUDA); raises ``LLM_FEATURE_NOT_ENABLED`` saying why when no device
    runtime can be used."""
    from ..cuda.runtime import CudaRuntime

    return CudaRuntime(ordinal)


def runtime_status() -> str:
    """One line for ``aiodatadist info``: the device runtime's version and devices, or why it cannot be used."""
    from ..cuda.driver import cuda_status

    return cuda_status()
