"""What a DEVICE test does to its runtime's device without naming the runtime: the emulated runtimes' hooks
(``fake_hold``, ``fake_fault``), their delay knobs, a device fault's code, and reads and fills of device memory.

The GPU tests run on every runtime in :data:`RUNTIMES` (``tests/gpu/conftest.py``'s ``device_runtime``
fixture): CUDA (a real GPU or the emulated driver, ``fake_libcuda.c``) and ACL (a real NPU or the emulated
runtime, ``fake_libascendcl.c``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from aiodatadist import LLMDataDist

__all__ = ["FAULT", "RUNTIMES", "delay_env", "fake_library", "fake_symbol", "fill_device", "read_device",
           "runtime_of"]

RUNTIMES = ("cuda", "acl")
FAULT = {"cuda": 700, "acl": 507053}
"""A device fault each emulated runtime reports from ``fake_fault`` on: CUDA_ERROR_ILLEGAL_ADDRESS (sticky for the
context) and ACL_ERROR_RT_DEVICE_MEM_ERROR (a failed task: its stream stops)."""


def runtime_of(dd: LLMDataDist) -> Any:
    """The device runtime of an instance (set up on first use)."""
    return dd.cache_manager._device().runtime


def fake_library(runtime: Any) -> ctypes.CDLL:
    """The loaded runtime library (an emulated one has the hooks below)."""
    return runtime.device.driver.lib if runtime.name == "cuda" else runtime.device.library.lib


def fake_symbol(dd: LLMDataDist, name: str) -> ctypes.c_int:
    """An ``int`` of the emulated runtime's library (``fake_hold``: while set, every copy waits before it runs)."""
    return ctypes.c_int.in_dll(fake_library(runtime_of(dd)), name)


def delay_env(runtime_name: str) -> str:
    """The emulated runtime's variable that delays every stream operation (microseconds)."""
    return "FAKE_CUDA_DELAY_US" if runtime_name == "cuda" else "FAKE_ACL_DELAY_US"


def read_device(runtime: Any, addr: int, nbytes: int) -> np.ndarray:
    """What device memory holds now: a synchronous copy that does not wait for the executor's streams (CUDA's
    ``copy_to_host`` synchronises the context first, so its driver call is made here; ACL's ``aclrtMemcpy`` waits
    for no stream)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    if runtime.name == "cuda":
        device = runtime.device
        device.make_current()
        device.driver.call("cuMemcpyDtoH_v2", ctypes.c_void_p(buf.ctypes.data), ctypes.c_uint64(addr),
                           ctypes.c_size_t(nbytes))
    else:
        runtime.copy_to_host(buf.ctypes.data, addr, nbytes)
    return buf


def fill_device(runtime: Any, addr: int, byte: int, nbytes: int) -> None:
    """Set ``nbytes`` of device memory at ``addr`` to ``byte``."""
    buf = np.full(nbytes, byte, dtype=np.uint8)
    runtime.copy_to_device(addr, buf.ctypes.data, nbytes)
