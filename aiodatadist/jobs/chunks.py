"""How copies are cut, for every executor: spans into pieces (how often a stop is noticed) and pieces into chunks
(what a worker, or a GPU launch, takes at once)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..layout.plans import Spans

__all__ = ["MAX_CHUNK", "MIN_CHUNK", "PIECE", "SINGLE_CHUNK", "SMALL", "as_u64", "split_spans"]

# Spans are cut into pieces of at most PIECE bytes: native copies poll the stop flag between pieces, so a stop
# takes effect within ~0.1 ms.  Pieces are grouped into chunks (the units workers take, round-robin across
# jobs): tiny transfers are one chunk (one thread hand-off), small ones one chunk per worker (latency), big ones
# chunks of 4-16 MiB for parallelism and fairness.
PIECE = 1 << 20
SINGLE_CHUNK = 512 << 10
SMALL = 4 << 20
MIN_CHUNK = 4 << 20
MAX_CHUNK = 16 << 20


def as_u64(addrs: Any) -> Any:
    """``addrs`` as a C-contiguous uint64 array (itself when it is one already)."""
    return addrs if type(addrs) is np.ndarray and addrs.dtype == np.uint64 and addrs.flags.c_contiguous \
        else np.ascontiguousarray(addrs, dtype=np.uint64)


def split_spans(spans: Spans, chunk_bytes: int, piece_bytes: int | None = None) -> tuple[
        Spans, npt.NDArray[np.int64]]:
    """Split spans longer than ``piece_bytes`` (default: ``chunk_bytes``) and group them into chunks of about
    ``chunk_bytes``.

    Returns the (possibly longer) span list and the chunk boundaries (indices into it, first 0, last n).
    """
    piece = piece_bytes or chunk_bytes
    length = spans.length
    total = int(length.sum())
    if total <= chunk_bytes and (not len(length) or int(length.max()) <= piece):
        # the common small transfer: one chunk, nothing to compute
        return spans, np.array([0, len(length)] if len(length) else [0], dtype=np.int64)
    pieces = np.maximum((length + np.uint64(piece - 1)) // np.uint64(piece), np.uint64(1)).astype(np.int64)
    if int(pieces.max(initial=1)) > 1:
        owner = np.repeat(np.arange(len(length)), pieces)
        first = np.concatenate(([0], np.cumsum(pieces)[:-1]))
        k = (np.arange(len(owner)) - first[owner]).astype(np.uint64)
        off = k * np.uint64(piece)
        new_len = np.minimum(length[owner] - off, np.uint64(piece))
        spans = Spans(spans.src[owner] + off, spans.dst[owner] + off, new_len)
    ends = np.cumsum(spans.length, dtype=np.uint64)
    total = int(ends[-1]) if len(ends) else 0
    marks = np.arange(chunk_bytes, total, chunk_bytes, dtype=np.uint64)
    cuts = np.searchsorted(ends, marks, side="left") + 1
    bounds = np.unique(np.concatenate(([0], cuts, [len(spans)]))).astype(np.int64)
    return spans, bounds
