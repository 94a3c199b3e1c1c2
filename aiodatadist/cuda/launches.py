"""Launches ready to enqueue on a GPU stream: a plan's or a span list's copy as one ``cuMemcpyAsync`` or one
launch of the pointer-list kernel (its descriptor table, cut into pieces, and geometry), and the descriptor buffers
that carry a table to the device.  Nothing here touches a stream: :class:`~.executor.CudaExecutor` enqueues."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Final

import numpy as np

from ..errors import LLMException, LLMStatusCode
from ..layout.plans import CopyPlan, Spans, plan_to_spans
from ..native import native_extension
from .driver import Device
from .kernels import choose_piece, launch_geometry, split_long_spans

__all__ = ["DEVICE_ONLY", "OVER_THE_BUS", "Descriptors", "Launch", "LaunchPreparer"]

_grid_table: Callable[..., tuple[int, int, int]] | None = getattr(native_extension(), "grid_table", None)

MAX_SPANS: Final = 2**32 - 1  # the kernel's span count is an unsigned int
DEVICE_ONLY: Final = 0  # a copy's kind: both ends in device memory
OVER_THE_BUS: Final = 1  # either end in page-locked host memory (its bus is 10-50x slower than device memory)
KINDS_KEPT: Final = 4096  # address pairs whose kind an executor remembers (forgotten all at once past that)


class Launch:
    """A copy ready to enqueue: one span (``single``: dst, src, bytes) or the kernel's descriptor table (``table``:
    the pieces' sources, then destinations, then lengths) and launch geometry; nothing to copy when neither.

    A launch kept in the executor's cache (``cached``) keeps its table on the device after its first use
    (``resident``: the descriptor buffer holding it, and the kernel's parameters): a repeated copy is then one
    ``cuLaunchKernel``.  ``last_seq``: the latest job that launched with it (its buffer is reused only once the
    stream is past that job)."""

    __slots__ = ("block", "cached", "grid", "kind", "last_seq", "n", "nbytes", "resident", "single", "table")

    def __init__(self, nbytes: int, single: tuple[int, int, int] | None = None, table: np.ndarray | None = None,
                 grid: int = 0, block: int = 0) -> None:
        self.nbytes = nbytes
        self.kind = DEVICE_ONLY  # what its copy's duration is expected from (see CudaExecutor._rates)
        self.single = single
        self.table = table
        self.n = 0 if table is None else len(table) // 3
        self.grid, self.block = grid, block
        self.cached = False
        self.resident: Descriptors | None = None
        self.last_seq = 0


class Descriptors:
    """A job's span descriptors: page-locked staging memory and the device copy the kernel reads."""

    __slots__ = ("_args", "_params", "_params_at", "capacity", "dev", "host")

    def __init__(self, device: Device, capacity: int) -> None:
        self.capacity = capacity
        self._args: tuple[ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32] | None = None
        self._params: ctypes.Array[ctypes.c_void_p] | None = None
        self._params_at = 0
        self.host = device.alloc_pinned(24 * capacity)
        try:
            self.dev = device.alloc(24 * capacity)
        except BaseException:
            device.free_pinned(self.host)
            raise

    def params(self, n: int) -> int:
        """The address of the kernel's parameters for a table of ``n`` spans in this buffer (the last ones built
        are kept: the driver copies parameters at the launch, so one array serves every launch)."""
        args = self._args
        if args is None or args[3].value != n:
            args = self._args = (ctypes.c_uint64(self.dev), ctypes.c_uint64(self.dev + 8 * n),
                                 ctypes.c_uint64(self.dev + 16 * n), ctypes.c_uint32(n))
            self._params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
            self._params_at = ctypes.addressof(self._params)
        return self._params_at

    def free(self, device: Device) -> None:
        device.free(self.dev)
        device.free_pinned(self.host)


class LaunchPreparer:
    """Prepares the launches of one executor's device: pieces sized for its SMs (or ``piece_bytes``), and the kind
    of each copy (within device memory or over the bus), remembered per pair of addresses."""

    def __init__(self, device: Device, piece_bytes: int | None = None) -> None:
        self._device = device
        self._piece_bytes = piece_bytes
        self._kinds: dict[tuple[int, int], int] = {}  # (first source, first destination address) -> kind

    def kind(self, src: int, dst: int) -> int:
        """Whether a copy from ``src`` to ``dst`` (a tensor's address at each end) stays in device memory or
        crosses the bus, remembered per pair (an address freed and reused for the other kind only misleads the
        expected duration of its copies for a while, never what they copy)."""
        kind = self._kinds.get((src, dst))
        if kind is None:
            device = self._device.is_device_pointer(src) and self._device.is_device_pointer(dst)
            kind = DEVICE_ONLY if device else OVER_THE_BUS
            if len(self._kinds) >= KINDS_KEPT:
                self._kinds.clear()
            self._kinds[(src, dst)] = kind
        return kind

    def for_plan(self, plan: CopyPlan, src_addrs: np.ndarray, dst_addrs: np.ndarray) -> Launch:
        """:meth:`for_spans` of a plan's spans: the native helper walks the plan's grid into the descriptor table
        in one pass (the same spans, merged and cut alike); without it, through span arrays."""
        if _grid_table is None:
            return self.for_spans(plan_to_spans(plan, src_addrs, dst_addrs))
        nbytes = plan.total_bytes
        piece = self._piece_bytes or choose_piece(nbytes, sm_count=self._device.sm_count)
        runs = plan.runs
        arrays = (src_addrs, dst_addrs, plan.src_tensor, plan.dst_tensor, runs.src_offset, runs.dst_offset,
                  runs.length)
        out = np.empty(3 * (plan.num_spans + nbytes // piece + 1), dtype=np.uint64)  # room for every piece
        n, merged, longest = _grid_table(*arrays, piece, out)
        if 3 * n > len(out):  # (cannot happen: a span of L bytes makes at most L // piece + 1 pieces)
            return self.for_spans(plan_to_spans(plan, src_addrs, dst_addrs))
        if merged <= 1:
            return Launch(nbytes, (int(out[n]), int(out[0]), nbytes) if merged else None)
        return self.table_launch(nbytes, out[:3 * n], n, longest)

    def for_spans(self, spans: Spans) -> Launch:
        """The launch that copies ``spans``: raises ``LLMException`` if one launch cannot take them."""
        length = np.asarray(spans.length, dtype=np.uint64)
        src = np.asarray(spans.src, dtype=np.uint64)
        dst = np.asarray(spans.dst, dtype=np.uint64)
        if len(length) and not length.all():  # zero-length spans copy nothing
            keep = length != 0
            src, dst, length = src[keep], dst[keep], length[keep]
        nbytes = int(length.sum())
        if len(length) <= 1:
            return Launch(nbytes, (int(dst[0]), int(src[0]), nbytes) if len(length) else None)
        piece = self._piece_bytes or choose_piece(nbytes, sm_count=self._device.sm_count)
        pieces = split_long_spans(src, dst, length, piece)
        table = np.concatenate((pieces.src, pieces.dst, pieces.length)).astype(np.uint64, copy=False)
        return self.table_launch(nbytes, table, len(pieces), int(pieces.length.max()))

    def table_launch(self, nbytes: int, table: np.ndarray, n: int, longest: int) -> Launch:
        """The kernel's launch for a descriptor table of ``n`` pieces (sources, destinations, lengths)."""
        if n > MAX_SPANS:
            raise LLMException(f"{n} spans are more than one kernel launch takes ({MAX_SPANS})",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        grid, block = launch_geometry(n, longest, sm_count=self._device.sm_count)
        table.flags.writeable = False
        return Launch(nbytes, table=table, grid=grid, block=block)
