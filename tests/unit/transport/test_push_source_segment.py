"""Whether an owner may copy an offered push source from the pusher's segment mapped here: only where every byte
the plan reads lies inside that segment (``same_host_plane._reads_inside``); anything else is read the unshared
way, so a wrong or hostile offer can never make the owner read outside the mapping."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from aiodatadist.layout.plans import Runs, make_plan
from aiodatadist.protocol.identity import SegmentIdentity
from aiodatadist.transport.same_host_plane import _reads_inside

U64 = (1 << 64) - 1


@st.composite
def offers(draw: st.DrawFn) -> tuple[np.ndarray, object, tuple[SegmentIdentity, int], bool]:
    tensors = draw(st.integers(1, 6))
    addrs = np.array(draw(st.lists(st.integers(0, 1 << 20), min_size=tensors, max_size=tensors)), dtype=np.uint64)
    used = draw(st.lists(st.integers(0, tensors - 1), min_size=1, max_size=tensors, unique=True))
    runs = draw(st.lists(st.tuples(st.integers(0, 1 << 12), st.integers(1, 1 << 12)), min_size=1, max_size=5))
    plan = make_plan(np.array(used, dtype=np.int64), np.array(used, dtype=np.int64),
                     Runs(np.array([o for o, _ in runs], dtype=np.int64), np.zeros(len(runs), dtype=np.int64),
                          np.array([n for _, n in runs], dtype=np.int64)))
    base = draw(st.integers(0, 1 << 20))
    size = draw(st.integers(1, 1 << 21))
    # the model: every byte of every run of every tensor the plan reads, inside [base, base + size)
    inside = all(base <= int(addrs[t]) + o and int(addrs[t]) + o + n <= base + size for t in used for o, n in runs)
    return addrs, plan, (SegmentIdentity(1, 2, 3, 4, size), base), inside


@given(offers())
def test_an_offered_source_is_mapped_only_where_every_byte_read_lies_in_the_segment(
        offer: tuple[np.ndarray, object, tuple[SegmentIdentity, int], bool]) -> None:
    addrs, plan, segment, inside = offer
    assert _reads_inside(addrs, plan, segment) is inside  # type: ignore[arg-type]


def test_addresses_near_the_top_of_the_address_space_do_not_wrap_around() -> None:
    plan = make_plan(np.array([0], dtype=np.int64), np.array([0], dtype=np.int64),
                     Runs(np.array([4096], dtype=np.int64), np.array([0], dtype=np.int64),
                          np.array([8192], dtype=np.int64)))
    segment = (SegmentIdentity(1, 2, 3, 4, 1 << 20), 0)
    # In uint64 arithmetic this address plus the run's end would wrap to just inside the segment.
    assert not _reads_inside(np.array([U64 - 4096], dtype=np.uint64), plan, segment)
    assert _reads_inside(np.array([0], dtype=np.uint64), plan, segment)
