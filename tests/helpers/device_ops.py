"""The device-runtime table (``adt_device_ops`` in ``aiodatadist/native/src/adt.h``) as ctypes sees it, taken out of
the capsule the native module's ``cuda_bind`` returns: for tests that drive a device the way a native I/O thread
would.  The structures mirror the header member for member (``tests/unit/native/test_native_bindings.py`` checks the
names and their order)."""

from __future__ import annotations

import ctypes
from typing import Any

from aiodatadist.native import DeviceLane  # (re-exported: the tests import it from here)

CAPSULE = b"aiodatadist.native.device_ops"
"""``ADT_DEVICE_OPS_CAPSULE``."""
BIND_FAILED = 1 << 20
STAGE_FAILED = 1 << 21
NO_ROOM = -1
EVENT_READY, EVENT_PENDING, EVENT_FAILED = 0, 1, 2

CUDA_FUNCTIONS = ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuLaunchKernel", "cuEventRecord", "cuEventQuery",
                  "cuMemcpyHtoDAsync_v2")
"""What ``cuda_bind`` takes, in order (``ADT_CUDA_FNS``)."""


class DeviceLaunch(ctypes.Structure):
    _fields_ = [("kernel", ctypes.c_void_p), ("grid", ctypes.c_uint), ("block", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("params", ctypes.c_void_p), ("table", ctypes.c_void_p),
                ("table_bytes", ctypes.c_size_t), ("staging", ctypes.c_void_p), ("device_table", ctypes.c_uint64)]


_vp, _int, _sz, _u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64


class DeviceOps(ctypes.Structure):
    _fields_ = [
        ("ctx", _vp),
        ("bind", ctypes.CFUNCTYPE(_int, _vp, _vp)),
        ("launch", ctypes.CFUNCTYPE(_int, _vp, ctypes.POINTER(DeviceLaunch))),
        ("gather", ctypes.CFUNCTYPE(_int, _vp, ctypes.POINTER(DeviceLane), _vp, _vp, _sz, _u64)),
        ("scatter", ctypes.CFUNCTYPE(_int, _vp, ctypes.POINTER(DeviceLane), _u64, _vp, _vp, _sz)),
        ("record", ctypes.CFUNCTYPE(_int, _vp, _vp, _vp)),
        ("query", ctypes.CFUNCTYPE(_int, _vp, _vp, _vp, ctypes.POINTER(_int))),
    ]


def device_ops(capsule: Any) -> DeviceOps:
    """The table a ``cuda_bind`` capsule holds (valid while the capsule lives)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return DeviceOps.from_address(get(capsule, CAPSULE))
