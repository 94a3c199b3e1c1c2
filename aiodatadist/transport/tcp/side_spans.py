"""One end's span lists of a plan, as a TCP transfer's two ends frame and place its bytes: :func:`plan_side_spans`.

Each end lists its own memory only (addresses and lengths in plan order, merged where that end's memory
continues).  Merging never reorders bytes, so both ends agree on every byte's offset in the transfer's stream
even though each merges differently.  The native helper walks the plan's grid into the lists in one pass
(``grid_table`` with both sides the same); without it, numpy builds them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

from ...copy.spans import as_u64
from ...layout import CopyPlan, PlanCache, coalesce
from ...native import native_extension

__all__ = ["SIDE_SPANS_CACHE", "SIDE_SPANS_MAX_SPANS", "SIDE_SPANS_MIN_SPANS", "plan_side_spans"]

UInt64Array = npt.NDArray[np.uint64]

SIDE_SPANS_CACHE: Final = 64
"""One end's span lists kept (least recently used first out), for plans of at most :data:`SIDE_SPANS_MAX_SPANS`
spans: a TCP transfer repeating a recent one (same plan, same tensors) reuses its lists on both ends."""
SIDE_SPANS_MAX_SPANS: Final = 16384
SIDE_SPANS_MIN_SPANS: Final = 256
"""Plans of fewer spans are walked at every call: 64 spans take 1.8 us, about what a cache hit costs (1.5 us),
while a miss (a serving engine's request, other blocks each time) costs 6 us more than the walk."""
_UNCUT: Final = 1 << 62  # grid_table's piece size that cuts no span

_side_spans: PlanCache[tuple[UInt64Array, UInt64Array]] = PlanCache(SIDE_SPANS_CACHE)
_grid_table: Callable[..., tuple[int, int, int]] | None = getattr(native_extension(), "grid_table", None)


def plan_side_spans(plan: CopyPlan, tensor_addrs: npt.ArrayLike, side: str) -> tuple[UInt64Array, UInt64Array]:
    """One end's spans of a plan (``side`` "src" or "dst"): addresses and lengths in plan order, merged where
    that end's memory continues (zero-length runs may be left out).

    The lists of plans of :data:`SIDE_SPANS_MIN_SPANS` to :data:`SIDE_SPANS_MAX_SPANS` spans are cached by the
    plan and the tensors' addresses (:class:`~aiodatadist.layout.PlanCache`), and are read-only."""
    addrs = as_u64(tensor_addrs)
    if not SIDE_SPANS_MIN_SPANS <= plan.num_spans <= SIDE_SPANS_MAX_SPANS:
        return _side(plan, addrs, side)
    return _side_spans.get_or_make(plan, (addrs.tobytes(), side), lambda: _read_only(_side(plan, addrs, side)))


def _read_only(lists: tuple[UInt64Array, UInt64Array]) -> tuple[UInt64Array, UInt64Array]:
    for array in lists:
        array.flags.writeable = False
    return lists


def _side(plan: CopyPlan, addrs: UInt64Array, side: str) -> tuple[UInt64Array, UInt64Array]:
    tensors, offsets = (plan.src_tensor, plan.runs.src_offset) if side == "src" else (
        plan.dst_tensor, plan.runs.dst_offset)
    if _grid_table is not None:  # both sides of the walk are this end: it merges where this end continues
        out = np.empty(3 * plan.num_spans, dtype=np.uint64)
        n, _, _ = _grid_table(addrs, addrs, tensors, tensors, offsets, offsets, plan.runs.length, _UNCUT, out)
        return out[:n], out[2 * n:3 * n]
    start = (addrs[tensors][:, None] + offsets.view(np.uint64)[None, :]).ravel()
    length = np.empty((len(tensors), len(offsets)), dtype=np.uint64)
    length[:] = plan.runs.length.view(np.uint64)
    merged, _, lengths = coalesce(start, start, length.ravel())
    return merged.astype(np.uint64, copy=True), lengths.astype(np.uint64, copy=True)
