"""The CUDA runtime behind the copy layer's device-runtime interface: the driver API through ctypes
(:mod:`.driver`), a pointer-list copy kernel shipped as PTX (:mod:`.kernels`), an executor that launches copies on
one stream and completes them through polled events (:mod:`.executor`), and :class:`~.runtime.CudaRuntime`, what
the copy layer uses (:mod:`aiodatadist.copy.device_runtime`).  The executor is not re-exported here: nothing
outside the copy layer reaches it.

Nothing here needs a compiler, the CUDA toolkit or torch at run time, only the NVIDIA driver
(``libcuda.so.1``).  Importing this package never loads it: :func:`cuda_driver` does on first use and raises
:class:`CudaUnavailable` (``LLM_FEATURE_NOT_ENABLED``) saying why CUDA cannot be used.
"""

from __future__ import annotations

from .driver import (
    CudaDriver,
    CudaError,
    CudaUnavailable,
    CUipcMemHandle,
    Device,
    cuda_driver,
    cuda_status,
    get_device,
)
from .kernels import KERNEL_NAME, choose_piece, launch_geometry, ptx_text, split_long_spans

__all__ = [
    "KERNEL_NAME",
    "CUipcMemHandle",
    "CudaDriver",
    "CudaError",
    "CudaUnavailable",
    "Device",
    "choose_piece",
    "cuda_driver",
    "cuda_status",
    "get_device",
    "launch_geometry",
    "ptx_text",
    "split_long_spans",
]
