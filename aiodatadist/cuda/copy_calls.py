"""The driver calls every GPU copy makes (its kernel's launch, the event recorded after it, the queries of that
event), one call into the native helper each instead of ctypes' conversions.

A ctypes call of ``cuLaunchKernel`` converts its eleven arguments on every call, and each call first makes the
device's context current (another ctypes call): a few microseconds apiece on the path of every copy and of every
poll of its end.  The native helper calls the same driver functions (their addresses, as ctypes found them in
the loaded library) with the arguments as plain ints, the context made current in the same call.  Without the
native helper the same functions run through ctypes.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..native import native_extension
from .driver import CudaError

if TYPE_CHECKING:
    from .driver import Device

__all__ = ["CTX_FAILED", "STAGE_FAILED", "CopyCalls"]

CTX_FAILED = 1 << 20
"""Added to the ``CUresult`` of ``cuCtxSetCurrent`` when making the device's context current failed (the call
itself was then not made)."""
STAGE_FAILED = 1 << 21
"""Added to the ``CUresult`` of ``cuMemcpyHtoDAsync_v2`` when a launch's table could not be staged (nothing was
launched)."""

_BOUND = ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuLaunchKernel", "cuEventRecord", "cuEventQuery",
          "cuMemcpyHtoDAsync_v2")


class CopyCalls:
    """``launch(function, grid, block, stream, params[, table, nbytes, host, dev])``, ``record(event, stream)`` and
    ``query(event)`` on ``device``, handles and addresses as ints; each returns the ``CUresult`` (0: success), or
    :data:`CTX_FAILED` plus that of ``cuCtxSetCurrent``.  A launch given a table (a C-contiguous array) first copies
    its first ``nbytes`` to the page-locked staging buffer at ``host``, then to the device at ``dev`` on the stream
    (:data:`STAGE_FAILED` plus the ``CUresult`` of that copy if it failed).  :meth:`error` turns a failure into its
    exception."""

    __slots__ = ("_device", "launch", "query", "record", "table")

    def __init__(self, device: Device) -> None:
        self._device = device
        ext = native_extension()
        bind = getattr(ext, "cuda_bind", None)
        self.launch: Callable[..., int]
        self.record: Callable[[int, int], int]
        self.query: Callable[[int], int]
        self.table: object | None = None
        """The native device-runtime table of these functions (a capsule), or None without the native helper."""
        if bind is not None:
            fns = self.table = bind(*(_address(device.driver.fn(name)) for name in _BOUND))
            self.launch = functools.partial(ext.cuda_launch, fns, device.context)
            self.record = functools.partial(ext.cuda_record, fns, device.context)
            self.query = functools.partial(ext.cuda_query, fns, device.context)
        else:
            self.launch, self.record, self.query = self._ctypes_launch, self._ctypes_record, self._ctypes_query

    def error(self, name: str, result: int) -> CudaError:
        """The exception of ``name`` having returned ``result``."""
        if result & CTX_FAILED:
            return self._device.driver.error("cuCtxSetCurrent", result & ~CTX_FAILED)
        if result & STAGE_FAILED:
            return self._device.driver.error("cuMemcpyHtoDAsync_v2", result & ~STAGE_FAILED)
        return self._device.driver.error(name, result)

    def _current(self) -> int:
        try:
            self._device.make_current()
        except CudaError as exc:
            return CTX_FAILED | exc.result
        return 0

    def _ctypes_launch(self, function: int, grid: int, block: int, stream: int, params: int,
                       table: np.ndarray | None = None, nbytes: int = 0, host: int = 0, dev: int = 0) -> int:
        if nbytes and not host:
            raise ValueError("a table to stage needs a staging buffer")
        if nbytes and (table is None or table.nbytes < nbytes):
            raise ValueError("the table is shorter than the bytes to stage")
        failed = self._current()
        if failed:
            return failed
        fn = self._device.driver.fn
        if nbytes:
            assert table is not None
            ctypes.memmove(host, table.ctypes.data, nbytes)
            result = int(fn("cuMemcpyHtoDAsync_v2")(dev, host, nbytes, stream))
            if result:
                return STAGE_FAILED | result
        return int(fn("cuLaunchKernel")(function, grid, 1, 1, block, 1, 1, 0, stream,
                                        ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p)), None))

    def _ctypes_record(self, event: int, stream: int) -> int:
        return self._current() or int(self._device.driver.fn("cuEventRecord")(event, stream))

    def _ctypes_query(self, event: int) -> int:
        return self._current() or int(self._device.driver.fn("cuEventQuery")(event))


def _address(function: object) -> int:
    """Where a ctypes foreign function's code is."""
    return ctypes.cast(function, ctypes.c_void_p).value or 0  # type: ignore[arg-type]  # (a CFuncPtr)
