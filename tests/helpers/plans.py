"""Random copy plans for property tests of span walks: tensors adjacent in memory or apart, runs that continue
the previous one on both sides, on one side or on neither, and (optionally) zero-length runs."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from aiodatadist.layout.plans import CopyPlan, Runs, make_plan

TENSOR_BYTES = 1 << 20


def draw_plan(data: st.DataObject, *, zero_lengths: bool = False) -> tuple[CopyPlan, np.ndarray, np.ndarray]:
    """A plan over up to 4 tensors of 1 MiB each side, and the two sides' tensor addresses (never dereferenced)."""
    tensors, size = data.draw(st.integers(1, 4)), TENSOR_BYTES
    adjacent = data.draw(st.booleans())  # tensors that follow each other in memory merge across their boundary
    src_addrs = np.array([(1 << 40) + t * size * (1 if adjacent else 3) for t in range(tensors)], np.uint64)
    dst_addrs = np.array([(1 << 41) + t * size * (1 if adjacent else 5) for t in range(tensors)], np.uint64)
    pairs = data.draw(st.integers(1, 6))
    src_tensor = data.draw(st.lists(st.integers(0, tensors - 1), min_size=pairs, max_size=pairs))
    dst_tensor = data.draw(st.lists(st.integers(0, tensors - 1), min_size=pairs, max_size=pairs))
    s_off: list[int] = []
    d_off: list[int] = []
    lengths: list[int] = []
    for _ in range(data.draw(st.integers(1, 8))):
        n = data.draw(st.integers(0 if zero_lengths else 1, 200_000))
        continues = data.draw(st.sampled_from(["both", "src", "dst", "neither"])) if s_off else "neither"
        s = s_off[-1] + lengths[-1] if continues in ("both", "src") else data.draw(st.integers(0, size - n))
        d = d_off[-1] + lengths[-1] if continues in ("both", "dst") else data.draw(st.integers(0, size - n))
        s_off.append(s)
        d_off.append(d)
        lengths.append(n)
    plan = make_plan(np.array(src_tensor, np.int64), np.array(dst_tensor, np.int64),
                     Runs(np.array(s_off, np.int64), np.array(d_off, np.int64), np.array(lengths, np.int64)))
    return plan, src_addrs, dst_addrs
