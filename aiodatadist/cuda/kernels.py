"""The pointer-list copy kernel (``copy_kernel.ptx``): its image, launch geometry and the host-side split of
long spans into pieces that balance the work across CTAs.

Everything here is pure Python/numpy: nothing loads the CUDA driver.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Final

import numpy as np
import numpy.typing as npt

from ..jobs.chunks import split_spans
from ..layout.plans import Spans

__all__ = [
    "KERNEL_NAME",
    "MAX_BLOCK",
    "MAX_PIECE",
    "MIN_BLOCK",
    "MIN_PIECE",
    "choose_piece",
    "launch_geometry",
    "ptx_text",
    "split_long_spans",
]

KERNEL_NAME: Final = "adt_copy_spans"
"""Entry point of the PTX: ``(const u64* src, const u64* dst, const u64* len, unsigned n)``."""

PTX_RESOURCE: Final = "copy_kernel.ptx"
MIN_BLOCK: Final = 64
MAX_BLOCK: Final = 256  # the kernel's __launch_bounds__
BYTES_PER_THREAD: Final = 16 * 4  # one unrolled pass: 4 loads of 16 bytes per thread
THREADS_PER_SM: Final = 2048  # sm_80/sm_90 (sm_75 has 1024: a second wave, harmless with a grid-stride loop)
MIN_PIECE: Final = 64 << 10
MAX_PIECE: Final = 1 << 20
PIECES_PER_SM: Final = 8
DEFAULT_SM_COUNT: Final = 132  # H100 SXM; callers pass the device's own count


@cache
def ptx_text() -> bytes:
    """The kernel's PTX image, NUL-terminated as ``cuModuleLoadData`` requires."""
    data = resources.files(__package__).joinpath(PTX_RESOURCE).read_bytes()
    return data if data.endswith(b"\0") else data + b"\0"


def launch_geometry(num_spans: int, max_span: int, *, sm_count: int = DEFAULT_SM_COUNT) -> tuple[int, int]:
    """``(grid, block)`` for copying ``num_spans`` spans of at most ``max_span`` bytes.

    The block is the smallest power of two in ``[MIN_BLOCK, MAX_BLOCK]`` whose threads cover the longest span
    in one unrolled pass; the grid is one CTA per span, at most as many as the GPU holds at once (CTAs loop
    over further spans).  ``grid`` is 0 when there is nothing to copy.
    """
    block = MIN_BLOCK
    threads = -(-max(max_span, 0) // BYTES_PER_THREAD)
    while block < threads and block < MAX_BLOCK:
        block *= 2
    if num_spans <= 0:
        return 0, block
    resident = max(1, sm_count) * (THREADS_PER_SM // block)
    return min(num_spans, resident, 2**31 - 1), block


def choose_piece(total_bytes: int, *, sm_count: int = DEFAULT_SM_COUNT) -> int:
    """The size long spans are cut into: a power of two in ``[MIN_PIECE, MAX_PIECE]``, small enough that a
    transfer of ``total_bytes`` gives every SM several pieces (a lone CTA cannot keep enough reads in flight),
    large enough that the descriptors stay negligible (24 bytes per piece)."""
    target = -(-max(total_bytes, 1) // (max(1, sm_count) * PIECES_PER_SM))
    piece = MIN_PIECE
    while piece < target and piece < MAX_PIECE:
        piece *= 2
    return piece


def split_long_spans(src: npt.NDArray[np.uint64], dst: npt.NDArray[np.uint64], length: npt.NDArray[np.uint64],
                     piece: int = MAX_PIECE) -> Spans:
    """Cut every span longer than ``piece`` bytes into consecutive pieces of ``piece`` bytes (the last one
    shorter), vectorised; spans that fit stay as they are, in order.  A 16-aligned span stays 16-aligned in
    every piece when ``piece`` is a multiple of 16."""
    if piece <= 0:
        raise ValueError(f"piece must be positive, not {piece}")
    spans = Spans(np.asarray(src, dtype=np.uint64), np.asarray(dst, dtype=np.uint64),
                  np.asarray(length, dtype=np.uint64))
    return split_spans(spans, 1 << 62, piece)[0]
