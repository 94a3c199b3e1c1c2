"""The CUDA layer: the driver API through ctypes, a pointer-list copy kernel shipped as PTX, and an executor that
completes GPU copies on an event loop.

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
from .executor import CudaExecutor, CudaJob
from .kernels import KERNEL_NAME, choose_piece, launch_geometry, ptx_text, split_long_spans

__all__ = [
    "KERNEL_NAME",
    "CUipcMemHandle",
    "CudaDriver",
    "CudaError",
    "CudaExecutor",
    "CudaJob",
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
