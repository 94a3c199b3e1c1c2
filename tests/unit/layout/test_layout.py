"""Property-based tests of ``aiodatadist.layout`` (and ``executor.split_spans``) against slow reference models.

Every reference below is written directly from LLM-DataDist's documented semantics with plain
Python loops over layers, tensors, blocks and bytes.  The code under test is vectorised numpy; the two must agree
on (a) which inputs are rejected with ``LLMException(LLM_PARAM_INVALID)`` and (b) for accepted inputs, exactly
which destination byte receives which source byte.  Copy spans are executed byte by byte on a simulated address
space (every tensor has a fake base address) filled with random non-zero bytes.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np
import pytest
from helpers.examples import examples
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aiodatadist.errors import LLMException, LLMStatusCode
from aiodatadist.jobs.chunks import split_spans
from aiodatadist.layout.plans import (
    CacheGeometry,
    Runs,
    Spans,
    all_tensor_indices,
    b2b_runs,
    c2b_runs,
    coalesce,
    copy_blocks_runs,
    copy_cache_run,
    make_plan,
    plan_to_spans,
    pull_tensor_indices,
    push_tensor_indices,
    slot_run,
    swap_blocks_runs,
)

SETTINGS = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHEAP = settings(max_examples=examples(400), deadline=None)

#: Block / slot indices far outside any cache.  The public API type-checks them as uint32/uint64 before they
#: reach the layout module, so the layout functions must reject them with LLM_PARAM_INVALID too.
HUGE = [2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


class Invalid(Exception):
    """Raised by a reference model: LLM-DataDist rejects the input with LLM_PARAM_INVALID."""


def invalid_unless(condition: bool) -> None:
    if not condition:
        raise Invalid


def compare(reference, implementation):
    """Run both; return ``(expected, actual)`` or ``None`` after checking that both reject the input."""
    try:
        expected = reference()
    except Invalid:
        with pytest.raises(LLMException) as info:
            implementation()
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        return None
    return expected, implementation()


# -- strategies ------------------------------------------------------------------------------------------------

def geometry(num_tensors: int, slots: int, stride: int, is_blocks: bool = True) -> CacheGeometry:
    return CacheGeometry(num_tensors=num_tensors, tensor_size=slots * stride, slots=slots, is_blocks=is_blocks)


@st.composite
def geometries(draw, *, num_tensors=None, slots=None, stride=None, is_blocks=True):
    nt = draw(st.integers(1, 5)) if num_tensors is None else num_tensors
    sl = draw(st.integers(1, 6)) if slots is None else slots
    sd = draw(st.integers(1, 8)) if stride is None else stride
    return geometry(nt, sl, sd, is_blocks)


@st.composite
def stride_pairs(draw):
    """Two strides, equal most of the time."""
    a = draw(st.integers(1, 8))
    b = draw(st.one_of(st.just(a), st.just(a), st.just(a), st.integers(1, 8)))
    return a, b


def index_or_wild(upper: int):
    """An index in [0, upper) most of the time, sometimes just outside or far outside."""
    return st.one_of(
        st.integers(0, max(upper - 1, 0)),
        st.integers(0, max(upper - 1, 0)),
        st.integers(-2, upper + 2),
        st.sampled_from(HUGE),
    )


def bad_index(upper: int):
    """An index outside [0, upper)."""
    return st.one_of(st.sampled_from([-1, upper, upper + 1]), st.sampled_from(HUGE))


def mostly(valid, bad):
    """``valid`` four times out of five, else ``bad``."""
    return st.one_of(valid, valid, valid, valid, bad)


@st.composite
def corrupted(draw, blocks: list[int], upper: int, kind: str):
    """``blocks`` (valid, unique indices of a cache with ``upper`` blocks) with one rule broken by ``kind``."""
    out = list(blocks)
    if kind == "dup":  # keeps the length when it can
        if len(out) >= 2:
            i, j = draw(st.permutations(range(len(out))))[:2]
            out[i] = out[j]
        else:
            out.append(out[0])
    elif kind == "bad":
        out[draw(st.integers(0, len(out) - 1))] = draw(bad_index(upper))
    elif kind == "drop":
        out.pop(draw(st.integers(0, len(out) - 1)))
    elif kind == "extra":
        free = [b for b in range(upper) if b not in out]
        out.append(draw(st.sampled_from(free)) if free else out[0])
    elif kind == "empty":
        out = []
    else:
        assert kind == "nothing"
    return out


@st.composite
def address_lists(draw, num_tensors: int, tensor_size: int):
    """Fake base addresses of the tensors of one cache, in several memory layouts."""
    kind = draw(st.sampled_from(["spaced", "contiguous", "reversed", "shuffled", "shuffled_contiguous", "high"]))
    base = draw(st.sampled_from([2**20, 2**40]))
    if kind == "spaced":
        return [(t + 1) * 2**20 for t in range(num_tensors)]
    if kind == "contiguous":
        return [base + t * tensor_size for t in range(num_tensors)]
    if kind == "reversed":
        return [base + (num_tensors - 1 - t) * tensor_size for t in range(num_tensors)]
    perm = draw(st.permutations(range(num_tensors)))
    if kind == "shuffled":
        return [(p + 1) * 2**20 for p in perm]
    if kind == "shuffled_contiguous":
        return [base + p * tensor_size for p in perm]
    # top of the 64-bit address space: int64 arithmetic would overflow
    return [2**64 - (num_tensors - t) * 2**20 for t in range(num_tensors)]


@st.composite
def tensor_pairs(draw, src_nt: int, dst_nt: int):
    """Tensor index lists of a plan: a window of each cache (as a layer range gives), or a permutation."""
    k = draw(st.integers(1, min(src_nt, dst_nt)))
    s0 = draw(st.integers(0, src_nt - k))
    if draw(st.booleans()):
        d0 = draw(st.integers(0, dst_nt - k))
        return list(range(s0, s0 + k)), list(range(d0, d0 + k))
    dst = draw(st.permutations(range(dst_nt)))[:k]
    return list(range(s0, s0 + k)), list(dst)


@st.composite
def layer_inputs(draw):
    """(src_nt, dst_nt, src_range, dst_range, n): ranges inside, matching, empty, beyond or arbitrary."""
    n = draw(st.sampled_from([0, 1, 1, 2, 2, 2, 3, 4]))
    unit = max(n, 1)

    def tensor_count():
        layers = draw(st.integers(0, 4))
        return max(1, layers * unit + draw(st.sampled_from([0, 0, 0, 1])))

    src_nt, dst_nt = tensor_count(), tensor_count()

    def layer_range(layers: int, length: int | None = None):
        kind = draw(st.sampled_from(["none", "inside", "inside", "empty", "beyond", "wild"]))
        if length is not None and layers >= length and draw(st.booleans()):
            start = draw(st.integers(0, layers - length))
            return range(start, start + length)
        if kind == "none":
            return None
        if kind == "inside" and layers > 0:
            start = draw(st.integers(0, layers - 1))
            return range(start, draw(st.integers(start + 1, layers)))
        if kind == "empty":
            start = draw(st.integers(0, 5))
            return range(start, start - draw(st.integers(0, 2)))
        if kind == "beyond":
            return range(draw(st.integers(0, layers)), layers + draw(st.integers(1, 2)))
        return range(draw(st.integers(0, 7)), draw(st.integers(0, 7)))

    src_range = layer_range(src_nt // unit)
    dst_range = layer_range(dst_nt // unit, len(src_range) if src_range else None)
    if draw(st.booleans()):
        src_range, dst_range = dst_range, src_range
    return src_nt, dst_nt, src_range, dst_range, n


# -- simulated memory ------------------------------------------------------------------------------------------

class Memory:
    """Tensors (numpy uint8 arrays) at fake base addresses; byte access by absolute address."""

    def __init__(self, addrs: list[int], arrays: list[np.ndarray]) -> None:
        order = sorted(range(len(addrs)), key=lambda t: addrs[t])
        self.bases = [addrs[t] for t in order]
        self.tensors = order
        self.arrays = arrays

    def locate(self, addr: int) -> tuple[int, int]:
        """(tensor, offset) of an absolute address; fails on an address outside every tensor."""
        i = bisect.bisect_right(self.bases, addr) - 1
        assert i >= 0, f"address {addr:#x} is below every tensor"
        t = self.tensors[i]
        off = addr - self.bases[i]
        assert off < len(self.arrays[t]), f"address {addr:#x} is outside every tensor"
        return t, off

    def read(self, addr: int) -> int:
        t, off = self.locate(addr)
        return int(self.arrays[t][off])

    def write(self, addr: int, value: int) -> None:
        t, off = self.locate(addr)
        self.arrays[t][off] = value


def random_tensors(rng: np.random.Generator, num_tensors: int, size: int) -> list[np.ndarray]:
    return [rng.integers(1, 256, size=size, dtype=np.uint8) for _ in range(num_tensors)]


def reference_mapping(pairs, ref_runs) -> dict[tuple[int, int], tuple[int, int]]:
    """(dst tensor, dst byte) -> (src tensor, src byte) for every byte the reference copies."""
    mapping: dict[tuple[int, int], tuple[int, int]] = {}
    for s_t, d_t in pairs:
        for s_off, d_off, n in ref_runs:
            for i in range(n):
                key = (d_t, d_off + i)
                assert key not in mapping, "reference writes a byte twice: the rules let through an ambiguous copy"
                mapping[key] = (s_t, s_off + i)
    return mapping


def check_no_continuation(spans: Spans) -> None:
    s, d, n = spans.src.tolist(), spans.dst.tolist(), spans.length.tolist()
    for i in range(len(n) - 1):
        assert not (s[i] + n[i] == s[i + 1] and d[i] + n[i] == d[i + 1]), f"spans {i} and {i + 1} are not merged"


def check_plan(data, runs: Runs, src_g: CacheGeometry, dst_g: CacheGeometry, pairs, ref_runs,
               *, same_memory: bool = False) -> tuple[Spans, list[int], list[int]]:
    """Build the plan's spans and check them against the reference runs (applied to every tensor pair)."""
    assert runs.src_offset.dtype == runs.dst_offset.dtype == runs.length.dtype == np.int64
    src_t = np.asarray([p[0] for p in pairs], dtype=np.int64)
    dst_t = np.asarray([p[1] for p in pairs], dtype=np.int64)
    plan = make_plan(src_t, dst_t, runs)
    src_addrs = data.draw(address_lists(src_g.num_tensors, src_g.tensor_size), label="src_addrs")
    dst_addrs = src_addrs if same_memory else data.draw(address_lists(dst_g.num_tensors, dst_g.tensor_size),
                                                        label="dst_addrs")
    spans = plan_to_spans(plan, src_addrs, dst_addrs)
    assert spans.src.dtype == spans.dst.dtype == spans.length.dtype == np.uint64
    assert len(spans.src) == len(spans.dst) == len(spans.length) == len(spans)
    assert all(n > 0 for n in spans.length.tolist())
    check_no_continuation(spans)

    ref_map = reference_mapping(pairs, ref_runs)
    assert spans.total_bytes == plan.total_bytes == len(ref_map)
    assert plan.num_spans >= len(spans)

    # exact byte mapping
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    src_arrays = random_tensors(rng, src_g.num_tensors, src_g.tensor_size)
    dst_arrays = src_arrays if same_memory else random_tensors(rng, dst_g.num_tensors, dst_g.tensor_size)
    src_mem, dst_mem = Memory(src_addrs, src_arrays), Memory(dst_addrs, dst_arrays)
    got_map: dict[tuple[int, int], tuple[int, int]] = {}
    for s, d, n in zip(spans.src.tolist(), spans.dst.tolist(), spans.length.tolist()):
        for i in range(n):
            key = dst_mem.locate(d + i)
            assert key not in got_map, f"destination byte {key} written twice"
            got_map[key] = src_mem.locate(s + i)
    assert got_map == ref_map

    # byte-level execution on random non-zero data
    expected_dst = [a.copy() for a in (src_arrays if same_memory else dst_arrays)]
    expected_src = expected_dst if same_memory else src_arrays
    for s_t, d_t in pairs:
        for s_off, d_off, n in ref_runs:
            for i in range(n):
                expected_dst[d_t][d_off + i] = expected_src[s_t][s_off + i]
    before_src = [a.copy() for a in src_arrays]
    for s, d, n in zip(spans.src.tolist(), spans.dst.tolist(), spans.length.tolist()):
        for i in range(n):
            dst_mem.write(d + i, src_mem.read(s + i))
    for got, want in zip(dst_arrays, expected_dst):
        assert np.array_equal(got, want)
    if not same_memory:
        for got, want in zip(src_arrays, before_src):
            assert np.array_equal(got, want), "the source was modified"
    return spans, src_addrs, dst_addrs


# -- layer ranges -> tensor indices (pull, push) ---------------------------------------------------------------

def ref_pull_indices(src_nt: int, dst_nt: int, src_range, dst_range, n: int):
    """Pull path (local = destination cache)."""
    invalid_unless(n > 0)

    def tensors(layer_range):
        if layer_range is None:
            return None
        out = [layer * n + j for layer in layer_range for j in range(n)]
        return out or None  # an empty range gives no indices -> "all"

    s, d = tensors(src_range), tensors(dst_range)
    if s is None and d is None:
        # every tensor to the same index (implementation rule: both caches have the same tensor count)
        invalid_unless(src_nt == dst_nt)
        return list(range(dst_nt)), list(range(dst_nt))
    invalid_unless(dst_nt % n == 0)
    for i in s or []:
        invalid_unless(0 <= i < src_nt)
    for i in d or []:
        invalid_unless(0 <= i < dst_nt)
    if s is not None and d is not None:
        invalid_unless(len(s) == len(d))
    elif s is not None:
        invalid_unless(len(s) == dst_nt)
        d = list(range(dst_nt))
    else:
        invalid_unless(len(d) <= src_nt)
        s = list(range(len(d)))  # source tensors taken from the start
    return s, d


def ref_push_indices(src_nt: int, dst_nt: int, src_range, dst_range, n: int):
    """Push path (local = source cache): one transfer per layer pair."""
    invalid_unless(n > 0)
    invalid_unless(src_nt % n == 0)
    for r in (src_range, dst_range):
        invalid_unless(r is None or r.start < r.stop)
    layers = src_nt // n
    s_layers = list(src_range) if src_range is not None else list(range(layers))
    d_layers = list(dst_range) if dst_range is not None else list(range(layers))
    invalid_unless(len(s_layers) == len(d_layers))
    s, d = [], []
    for s_layer, d_layer in zip(s_layers, d_layers):
        invalid_unless(s_layer < src_nt // n)
        invalid_unless(d_layer < dst_nt // n)
        s.extend(s_layer * n + j for j in range(n))
        d.extend(d_layer * n + j for j in range(n))
    return s, d


def check_indices(result):
    if result is None:
        return
    (want_s, want_d), (got_s, got_d) = result
    assert got_s.dtype == got_d.dtype == np.int64
    assert got_s.tolist() == want_s
    assert got_d.tolist() == want_d


@CHEAP
@given(layer_inputs())
@example((4, 4, None, None, 2))
@example((4, 4, range(0), range(3, 1), 2))
@example((8, 4, range(2, 4), None, 2))
@example((4, 8, None, range(2, 4), 2))
@example((4, 6, None, range(2), 3))
@example((6, 4, range(1), range(1), 3))
@example((8, 8, range(2), range(3), 2))
@example((8, 8, None, range(1, 3), 2))
def test_pull_tensor_indices(inputs):
    src_nt, dst_nt, src_range, dst_range, n = inputs
    src, dst = geometry(src_nt, 2, 4), geometry(dst_nt, 2, 4)
    check_indices(compare(lambda: ref_pull_indices(src_nt, dst_nt, src_range, dst_range, n),
                          lambda: pull_tensor_indices(src, dst, src_range, dst_range, n)))


@CHEAP
@given(layer_inputs())
@example((4, 4, None, None, 2))
@example((4, 8, None, range(2, 4), 2))
@example((4, 8, range(0), None, 2))
@example((4, 6, range(1, 2), range(1, 2), 2))
@example((4, 5, range(1, 2), range(1, 2), 2))
@example((4, 5, range(1, 3), range(1, 3), 2))
@example((5, 4, None, None, 2))
def test_push_tensor_indices(inputs):
    src_nt, dst_nt, src_range, dst_range, n = inputs
    src, dst = geometry(src_nt, 2, 4), geometry(dst_nt, 2, 4)
    check_indices(compare(lambda: ref_push_indices(src_nt, dst_nt, src_range, dst_range, n),
                          lambda: push_tensor_indices(src, dst, src_range, dst_range, n)))


@SETTINGS
@given(st.integers(1, 8), st.integers(1, 8))
def test_all_tensor_indices(src_nt, dst_nt):
    def ref():
        invalid_unless(src_nt == dst_nt)
        return list(range(src_nt)), list(range(dst_nt))

    check_indices(compare(ref, lambda: all_tensor_indices(geometry(src_nt, 2, 4), geometry(dst_nt, 3, 4))))


# -- block lists and slots -> byte runs ------------------------------------------------------------------------

def ref_b2b(src_blocks, dst_blocks, src: CacheGeometry, dst: CacheGeometry):
    """Block src_blocks[i] -> block dst_blocks[i] of every selected tensor."""
    invalid_unless(len(src_blocks) > 0 and len(dst_blocks) > 0)
    invalid_unless(len(src_blocks) == len(dst_blocks))
    invalid_unless(src.stride == dst.stride)
    for b in src_blocks:
        invalid_unless(0 <= b < src.slots)
    for b in dst_blocks:
        invalid_unless(0 <= b < dst.slots)
    invalid_unless(len(set(dst_blocks)) == len(dst_blocks))
    size = dst.stride
    return [(s * size, d * size, size) for s, d in zip(src_blocks, dst_blocks)]


def consecutive_runs(src_blocks, dst_blocks) -> int:
    """Runs where both indices increase by 1 are coalesced into single transfers."""
    return 1 + sum(1 for i in range(len(src_blocks) - 1)
                   if not (src_blocks[i + 1] == src_blocks[i] + 1 and dst_blocks[i + 1] == dst_blocks[i] + 1))


@st.composite
def b2b_inputs(draw):
    s_stride, d_stride = draw(stride_pairs())
    src = draw(geometries(stride=s_stride))
    dst = draw(geometries(stride=d_stride))
    side, kind = draw(st.sampled_from([("src", "nothing"), ("dst", "nothing"), ("src", "dup"), ("dst", "dup"),
                                       ("src", "bad"), ("dst", "bad"), ("src", "drop"), ("dst", "extra"),
                                       ("src", "empty"), ("dst", "empty")]))
    k_min = 2 if kind == "dup" and min(src.slots, dst.slots) >= 2 else 1
    k = draw(st.integers(k_min, min(src.slots, dst.slots)))
    if draw(st.booleans()):
        a, b = draw(st.integers(0, src.slots - k)), draw(st.integers(0, dst.slots - k))
        src_blocks, dst_blocks = list(range(a, a + k)), list(range(b, b + k))
    else:
        src_blocks = draw(st.lists(st.integers(0, src.slots - 1), min_size=k, max_size=k, unique=True))
        dst_blocks = draw(st.lists(st.integers(0, dst.slots - 1), min_size=k, max_size=k, unique=True))
    if side == "src":
        src_blocks = draw(corrupted(src_blocks, src.slots, kind))  # duplicate *source* blocks are fine
    else:
        dst_blocks = draw(corrupted(dst_blocks, dst.slots, kind))
    return src, dst, src_blocks, dst_blocks


@SETTINGS
@given(b2b_inputs(), st.data(), st.sampled_from(["list", "tuple", "array"]))
def test_b2b_runs(inputs, data, container):
    """Lists and tuples take the native path (where built), arrays the vectorised one: both must match the
    reference."""
    src, dst, src_blocks, dst_blocks = inputs
    def as_array(values: list[int]) -> object:
        return np.asarray(values, dtype=np.int64) if all(-2**63 <= v < 2**63 for v in values) else values

    wrap = {"list": list, "tuple": tuple, "array": as_array}[container]
    result = compare(lambda: ref_b2b(src_blocks, dst_blocks, src, dst),
                     lambda: b2b_runs(wrap(src_blocks), wrap(dst_blocks), src, dst))
    if result is None:
        return
    ref_runs, runs = result
    assert (np.diff(runs.src_offset) >= 0).all()  # read in source order, whatever order the pairs came in
    by_src = sorted(zip(src_blocks, dst_blocks), key=lambda pair: pair[0])
    assert len(runs.length) == consecutive_runs([a for a, _ in by_src], [b for _, b in by_src])
    pairs = list(zip(*data.draw(tensor_pairs(src.num_tensors, dst.num_tensors), label="tensors")))
    check_plan(data, runs, src, dst, pairs, ref_runs)


@st.composite
def long_block_lists(draw):
    """Block lists of up to 600 pairs over caches of up to 2000 blocks (past the native path's stack buffers
    and through its hash set of destinations), in any order, sometimes with one destination twice."""
    slots = draw(st.integers(1, 2000))
    n = draw(st.integers(1, min(slots, 600)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    how = draw(st.sampled_from(["random", "ascending", "runs"]))
    if how == "runs":  # consecutive stretches on both sides, which merge
        start_s, start_d = draw(st.integers(0, slots - n)), draw(st.integers(0, slots - n))
        src, dst = list(range(start_s, start_s + n)), list(range(start_d, start_d + n))
        cut = draw(st.integers(0, n))
        src, dst = src[cut:] + src[:cut], dst[cut:] + dst[:cut]
    else:
        src = rng.integers(0, slots, n).tolist()  # duplicate sources are allowed
        dst = rng.choice(slots, n, replace=False).tolist()
        if how == "ascending":
            src.sort()
            dst.sort()
    if n > 1 and draw(st.booleans()):
        dst[draw(st.integers(0, n - 1))] = dst[draw(st.integers(0, n - 1))]  # maybe a duplicate destination
    return slots, src, dst


@SETTINGS
@given(long_block_lists(), st.integers(1, 64), st.sampled_from([list, tuple]))
def test_b2b_runs_of_long_lists_match_the_vectorised_path(inputs, stride, container):
    """The native pass over lists and tuples gives the vectorised path's runs (and rejects what it rejects),
    for lists longer than its stack buffers and destinations in any order."""
    slots, src_blocks, dst_blocks = inputs
    g = geometry(2, slots, stride)
    result = compare(lambda: ref_b2b(src_blocks, dst_blocks, g, g),
                     lambda: b2b_runs(container(src_blocks), container(dst_blocks), g, g))
    if result is None:
        return
    runs = result[1]
    vectorised = b2b_runs(np.asarray(src_blocks, dtype=np.int64), np.asarray(dst_blocks, dtype=np.int64), g, g)
    for mine, theirs in zip((runs.src_offset, runs.dst_offset, runs.length),
                            (vectorised.src_offset, vectorised.dst_offset, vectorised.length)):
        assert mine.dtype == np.int64 and not mine.flags.writeable
        assert mine.tolist() == theirs.tolist()


def ref_c2b(src_slot, src: CacheGeometry, dst_blocks, dst: CacheGeometry):
    """The source slot cut into chunks of the destination block size; chunk i -> dst_blocks[i]."""
    invalid_unless(len(dst_blocks) > 0)
    invalid_unless(0 <= src_slot < src.slots)
    for b in dst_blocks:
        invalid_unless(0 <= b < dst.slots)
    invalid_unless(len(set(dst_blocks)) == len(dst_blocks))
    block, slot = dst.stride, src.stride
    chunks = []
    pos = 0
    while pos < slot:
        chunks.append((src_slot * slot + pos, min(block, slot - pos)))
        pos += block
    invalid_unless(len(dst_blocks) <= len(chunks))
    return [(s_off, b * block, n) for (s_off, n), b in zip(chunks, dst_blocks)]


@st.composite
def c2b_inputs(draw):
    kind = draw(st.sampled_from(["nothing", "nothing", "slot", "dup", "bad", "extra", "empty"]))
    if kind == "extra":  # one block more than the slot fills: the slot must fill fewer blocks than exist
        dst = draw(geometries(slots=draw(st.integers(2, 8))))
        src = draw(geometries(stride=draw(st.integers(1, dst.tensor_size - dst.stride)), is_blocks=False))
    else:
        dst = draw(geometries(slots=draw(st.integers(1, 8))))
        src = draw(geometries(stride=draw(st.integers(1, dst.tensor_size + 2)), is_blocks=False))
    chunks = -(-src.stride // dst.stride)
    slot = draw(bad_index(src.slots) if kind == "slot" else st.integers(0, src.slots - 1))
    k_max = min(chunks, dst.slots)
    k = k_max if kind == "extra" else draw(st.one_of(st.just(k_max), st.integers(1, k_max)))
    if draw(st.booleans()):
        b = draw(st.integers(0, dst.slots - k))
        dst_blocks = list(range(b, b + k))
    else:
        dst_blocks = draw(st.lists(st.integers(0, dst.slots - 1), min_size=k, max_size=k, unique=True))
    return src, dst, slot, draw(corrupted(dst_blocks, dst.slots, "nothing" if kind == "slot" else kind))


@SETTINGS
@given(c2b_inputs(), st.data())
def test_c2b_runs(inputs, data):
    src, dst, slot, dst_blocks = inputs
    result = compare(lambda: ref_c2b(slot, src, dst_blocks, dst), lambda: c2b_runs(slot, src, dst_blocks, dst))
    if result is None:
        return
    ref_runs, runs = result
    # chunk i and i+1 are contiguous in the slot; they merge exactly when the destination blocks are consecutive
    assert len(runs.length) == 1 + sum(1 for i in range(len(dst_blocks) - 1) if dst_blocks[i + 1] != dst_blocks[i] + 1)
    pairs = list(zip(*data.draw(tensor_pairs(src.num_tensors, dst.num_tensors), label="tensors")))
    check_plan(data, runs, src, dst, pairs, ref_runs)


def ref_slot(src_slot, src: CacheGeometry, dst_slot, dst: CacheGeometry, size):
    """pull_cache/push_cache: ``size`` bytes (-1 = the destination slot) from one slot to another."""
    invalid_unless(0 <= src_slot < src.slots)
    invalid_unless(0 <= dst_slot < dst.slots)
    invalid_unless(size == -1 or size > 0)
    nbytes = dst.stride if size == -1 else size
    invalid_unless(nbytes <= dst.stride and nbytes <= src.stride)
    return [(src_slot * src.stride, dst_slot * dst.stride, nbytes)]


def slot_or_bad(broken: bool, slots: int):
    return bad_index(slots) if broken else st.integers(0, slots - 1)


def size_or_bad(broken: bool, valid_max: int, *limits: int):
    """-1 or a size in [1, valid_max]; if ``broken``: 0, negative, huge, or just above ``valid_max`` / a limit."""
    if broken:
        return st.sampled_from([0, -2, -(2**63), 2**63 - 1, valid_max + 1, *(x + 1 for x in limits)])
    return st.one_of(st.just(-1), st.integers(1, max(valid_max, 1)))


@SETTINGS
@given(st.data())
def test_slot_run(data):
    s_stride, d_stride = data.draw(st.one_of(stride_pairs(), st.tuples(st.integers(1, 8), st.integers(1, 8))),
                                   label="strides")
    src = data.draw(geometries(stride=s_stride, is_blocks=False), label="src")
    dst = data.draw(geometries(stride=d_stride, is_blocks=False), label="dst")
    broken = data.draw(st.sampled_from(["nothing", "nothing", "src_slot", "dst_slot", "size"]), label="broken")
    src_slot = data.draw(slot_or_bad(broken == "src_slot", src.slots), label="src_slot")
    dst_slot = data.draw(slot_or_bad(broken == "dst_slot", dst.slots), label="dst_slot")
    size = data.draw(size_or_bad(broken == "size", min(src.stride, dst.stride), src.stride, dst.stride),
                     label="size")
    result = compare(lambda: ref_slot(src_slot, src, dst_slot, dst, size),
                     lambda: slot_run(src_slot, src, dst_slot, dst, size))
    if result is None:
        return
    ref_runs, runs = result
    assert len(runs.length) == 1
    pairs = list(zip(*data.draw(tensor_pairs(src.num_tensors, dst.num_tensors), label="tensors")))
    check_plan(data, runs, src, dst, pairs, ref_runs)


def ref_copy_cache(g: CacheGeometry, dst_slot, src_slot, offset, size):
    """copy_cache: ``size`` bytes (-1 = rest of the slot) at ``offset`` of a slot, per tensor."""
    invalid_unless(0 <= src_slot < g.slots)
    invalid_unless(0 <= dst_slot < g.slots)
    invalid_unless(0 <= offset < g.stride)
    invalid_unless(size == -1 or size > 0)
    nbytes = g.stride - offset if size == -1 else size
    invalid_unless(offset + nbytes <= g.stride)
    return [(src_slot * g.stride + offset, dst_slot * g.stride + offset, nbytes)]


@SETTINGS
@given(st.data())
def test_copy_cache_run(data):
    g = data.draw(geometries(stride=data.draw(st.integers(1, 12)), is_blocks=False), label="geometry")
    broken = data.draw(st.sampled_from(["nothing", "nothing", "src_slot", "dst_slot", "offset", "size"]),
                       label="broken")
    src_slot = data.draw(slot_or_bad(broken == "src_slot", g.slots), label="src_slot")
    dst_slot = data.draw(slot_or_bad(broken == "dst_slot", g.slots), label="dst_slot")
    if broken == "offset":
        offset = data.draw(st.sampled_from([g.stride, g.stride + 1, -1, 2**64 - 1]), label="offset")
    else:
        offset = data.draw(st.integers(0, g.stride - 1), label="offset")
    size = data.draw(size_or_bad(broken == "size", g.stride - max(offset, 0)), label="size")
    result = compare(lambda: ref_copy_cache(g, dst_slot, src_slot, offset, size),
                     lambda: copy_cache_run(g, dst_slot, src_slot, offset, size))
    if result is None:
        return
    ref_runs, runs = result
    pairs = [(t, t) for t in range(g.num_tensors)]
    check_plan(data, runs, g, g, pairs, ref_runs)


def ref_copy_blocks(info: dict, g: CacheGeometry):
    """copy_blocks: each source block to each of its destination blocks, inside one cache.

    Rules beyond LLM-DataDist's documentation (documented by the implementation): at least one destination per
    source, destinations unique and never a source of the same call (otherwise the result depends on copy order).
    """
    invalid_unless(len(info) > 0)
    runs = []
    for s, dsts in info.items():
        invalid_unless(len(dsts) > 0)
        invalid_unless(0 <= s < g.slots)
        for d in dsts:
            invalid_unless(0 <= d < g.slots)
            runs.append((s * g.stride, d * g.stride, g.stride))
    all_dst = [d for dsts in info.values() for d in dsts]
    invalid_unless(len(set(all_dst)) == len(all_dst))
    invalid_unless(not set(all_dst) & set(info))
    return runs


@st.composite
def copy_blocks_inputs(draw):
    g = draw(geometries(slots=draw(st.integers(2, 8))))
    # valid: split a permutation of the blocks into sources and destinations
    perm = draw(st.permutations(range(g.slots)))
    n_src = draw(st.integers(1, g.slots - 1))
    sources, dests = perm[:n_src], perm[n_src:draw(st.integers(n_src + 1, g.slots))]
    info: dict[int, list[int]] = {s: [] for s in sources}
    for d in dests:
        info[draw(st.sampled_from(sources))].append(d)
    info = {s: v for s, v in info.items() if v}
    kind = draw(st.sampled_from(["nothing", "nothing", "dst_is_src", "dup_dst", "bad_src", "bad_dst", "empty_list",
                                 "empty", "wild"]))
    keys = list(info)
    if kind == "empty_list":
        free = [b for b in range(g.slots) if b not in info and all(b not in v for v in info.values())]
        info[draw(st.sampled_from(free)) if free else keys[0]] = []
    elif kind == "dst_is_src":
        info[draw(st.sampled_from(keys))].append(draw(st.sampled_from(keys)))
    elif kind == "dup_dst":
        all_dst = [d for v in info.values() for d in v]
        if all_dst:
            info[draw(st.sampled_from(keys))].append(draw(st.sampled_from(all_dst)))
    elif kind == "bad_src":
        info[draw(bad_index(g.slots))] = [d for d in range(g.slots) if d not in info][:1] or [0]
    elif kind == "bad_dst":
        info[draw(st.sampled_from(keys))].append(draw(bad_index(g.slots)))
    elif kind == "empty":
        info = {}
    elif kind == "wild":
        info = draw(st.dictionaries(index_or_wild(g.slots), st.lists(index_or_wild(g.slots), max_size=3),
                                    max_size=4))
    return g, info


@SETTINGS
@given(copy_blocks_inputs(), st.data())
def test_copy_blocks_runs(inputs, data):
    g, info = inputs
    result = compare(lambda: ref_copy_blocks(info, g), lambda: copy_blocks_runs(info, g))
    if result is None:
        return
    ref_runs, runs = result
    pairs = [(t, t) for t in range(g.num_tensors)]
    check_plan(data, runs, g, g, pairs, ref_runs, same_memory=True)


def ref_swap_blocks(mapping: dict, src: CacheGeometry, dst: CacheGeometry):
    """swap_blocks: block k of src -> block mapping[k] of dst; equal block size and num_tensors."""
    invalid_unless(len(mapping) > 0)
    invalid_unless(src.stride == dst.stride)
    invalid_unless(src.num_tensors == dst.num_tensors)
    for s, d in mapping.items():
        invalid_unless(0 <= s < src.slots)
        invalid_unless(0 <= d < dst.slots)
    invalid_unless(len(set(mapping.values())) == len(mapping))
    return [(s * src.stride, d * dst.stride, src.stride) for s, d in mapping.items()]


@st.composite
def swap_inputs(draw):
    s_stride, d_stride = draw(stride_pairs())
    src = draw(geometries(stride=s_stride))
    nt = draw(mostly(st.just(src.num_tensors), st.integers(1, 5)))
    dst = draw(geometries(num_tensors=nt, stride=d_stride))
    k = draw(st.integers(1, min(src.slots, dst.slots)))
    keys = draw(st.lists(st.integers(0, src.slots - 1), min_size=k, max_size=k, unique=True))
    values = draw(st.lists(st.integers(0, dst.slots - 1), min_size=k, max_size=k, unique=True))
    kind = draw(st.sampled_from(["nothing", "nothing", "dup_dst", "bad_src", "bad_dst", "empty", "wild"]))
    if kind == "dup_dst":
        keys.append(draw(st.integers(0, src.slots - 1)))
        values.append(draw(st.sampled_from(values)))
    elif kind == "bad_src":
        keys.append(draw(bad_index(src.slots)))
        values.append(draw(st.integers(0, dst.slots - 1)))
    elif kind == "bad_dst":
        values[draw(st.integers(0, k - 1))] = draw(bad_index(dst.slots))
    elif kind == "empty":
        keys, values = [], []
    elif kind == "wild":
        return src, dst, draw(st.dictionaries(index_or_wild(src.slots), index_or_wild(dst.slots), max_size=5))
    return src, dst, dict(zip(keys, values))


@SETTINGS
@given(swap_inputs(), st.data())
def test_swap_blocks_runs(inputs, data):
    src, dst, mapping = inputs
    result = compare(lambda: ref_swap_blocks(mapping, src, dst), lambda: swap_blocks_runs(mapping, src, dst))
    if result is None:
        return
    ref_runs, runs = result
    pairs = [(t, t) for t in range(src.num_tensors)]
    check_plan(data, runs, src, dst, pairs, ref_runs)


G4x8 = geometry(2, 4, 8)  # 2 tensors, 4 blocks/slots of 8 bytes
G4x4 = geometry(2, 4, 4)
G3x8 = geometry(3, 4, 8)
C2x20 = geometry(2, 2, 20, is_blocks=False)  # a 20-byte slot fills 3 blocks of 8 bytes (the last partly)

BOUNDARY_CASES = [
    # (id, reference, implementation)
    ("b2b-ok", lambda: ref_b2b([0, 1, 3], [3, 2, 0], G4x8, G4x8), lambda: b2b_runs([0, 1, 3], [3, 2, 0], G4x8, G4x8)),
    ("b2b-dup-src-ok", lambda: ref_b2b([1, 1], [0, 2], G4x8, G4x8), lambda: b2b_runs([1, 1], [0, 2], G4x8, G4x8)),
    ("b2b-dup-dst", lambda: ref_b2b([0, 1], [2, 2], G4x8, G4x8), lambda: b2b_runs([0, 1], [2, 2], G4x8, G4x8)),
    ("b2b-len", lambda: ref_b2b([0, 1], [2], G4x8, G4x8), lambda: b2b_runs([0, 1], [2], G4x8, G4x8)),
    ("b2b-empty-src", lambda: ref_b2b([], [2], G4x8, G4x8), lambda: b2b_runs([], [2], G4x8, G4x8)),
    ("b2b-empty-both", lambda: ref_b2b([], [], G4x8, G4x8), lambda: b2b_runs([], [], G4x8, G4x8)),
    ("b2b-src-range", lambda: ref_b2b([4], [0], G4x8, G4x8), lambda: b2b_runs([4], [0], G4x8, G4x8)),
    ("b2b-dst-range", lambda: ref_b2b([0], [4], G4x8, G4x8), lambda: b2b_runs([0], [4], G4x8, G4x8)),
    ("b2b-negative", lambda: ref_b2b([-1], [0], G4x8, G4x8), lambda: b2b_runs([-1], [0], G4x8, G4x8)),
    ("b2b-block-size", lambda: ref_b2b([0], [0], G4x8, G4x4), lambda: b2b_runs([0], [0], G4x8, G4x4)),
    ("c2b-ok-partial", lambda: ref_c2b(1, C2x20, [3, 0, 1], G4x8), lambda: c2b_runs(1, C2x20, [3, 0, 1], G4x8)),
    ("c2b-prefix", lambda: ref_c2b(0, C2x20, [2], G4x8), lambda: c2b_runs(0, C2x20, [2], G4x8)),
    ("c2b-too-many", lambda: ref_c2b(0, C2x20, [0, 1, 2, 3], G4x8), lambda: c2b_runs(0, C2x20, [0, 1, 2, 3], G4x8)),
    ("c2b-slot", lambda: ref_c2b(2, C2x20, [0], G4x8), lambda: c2b_runs(2, C2x20, [0], G4x8)),
    ("c2b-empty", lambda: ref_c2b(0, C2x20, [], G4x8), lambda: c2b_runs(0, C2x20, [], G4x8)),
    ("c2b-dup", lambda: ref_c2b(0, C2x20, [1, 1], G4x8), lambda: c2b_runs(0, C2x20, [1, 1], G4x8)),
    ("c2b-range", lambda: ref_c2b(0, C2x20, [4], G4x8), lambda: c2b_runs(0, C2x20, [4], G4x8)),
    ("slot-ok", lambda: ref_slot(1, C2x20, 0, C2x20, -1), lambda: slot_run(1, C2x20, 0, C2x20, -1)),
    ("slot-size", lambda: ref_slot(1, C2x20, 0, C2x20, 20), lambda: slot_run(1, C2x20, 0, C2x20, 20)),
    ("slot-size+1", lambda: ref_slot(1, C2x20, 0, C2x20, 21), lambda: slot_run(1, C2x20, 0, C2x20, 21)),
    ("slot-size0", lambda: ref_slot(1, C2x20, 0, C2x20, 0), lambda: slot_run(1, C2x20, 0, C2x20, 0)),
    ("slot-size-2", lambda: ref_slot(1, C2x20, 0, C2x20, -2), lambda: slot_run(1, C2x20, 0, C2x20, -2)),
    ("slot-src", lambda: ref_slot(2, C2x20, 0, C2x20, -1), lambda: slot_run(2, C2x20, 0, C2x20, -1)),
    ("slot-dst", lambda: ref_slot(0, C2x20, 2, C2x20, -1), lambda: slot_run(0, C2x20, 2, C2x20, -1)),
    ("slot-small-src", lambda: ref_slot(0, G4x4, 0, G4x8, -1), lambda: slot_run(0, G4x4, 0, G4x8, -1)),
    ("slot-small-src-size", lambda: ref_slot(0, G4x4, 0, G4x8, 5), lambda: slot_run(0, G4x4, 0, G4x8, 5)),
    ("slot-small-dst", lambda: ref_slot(0, G4x8, 0, G4x4, -1), lambda: slot_run(0, G4x8, 0, G4x4, -1)),
    ("copy_cache-ok", lambda: ref_copy_cache(C2x20, 0, 1, 5, 7), lambda: copy_cache_run(C2x20, 0, 1, 5, 7)),
    ("copy_cache-rest", lambda: ref_copy_cache(C2x20, 0, 1, 19, -1), lambda: copy_cache_run(C2x20, 0, 1, 19, -1)),
    ("copy_cache-offset", lambda: ref_copy_cache(C2x20, 0, 1, 20, -1), lambda: copy_cache_run(C2x20, 0, 1, 20, -1)),
    ("copy_cache-end", lambda: ref_copy_cache(C2x20, 0, 1, 5, 15), lambda: copy_cache_run(C2x20, 0, 1, 5, 15)),
    ("copy_cache-end+1", lambda: ref_copy_cache(C2x20, 0, 1, 5, 16), lambda: copy_cache_run(C2x20, 0, 1, 5, 16)),
    ("copy_cache-size0", lambda: ref_copy_cache(C2x20, 0, 1, 0, 0), lambda: copy_cache_run(C2x20, 0, 1, 0, 0)),
    ("copy_cache-size-2", lambda: ref_copy_cache(C2x20, 0, 1, 4, -2), lambda: copy_cache_run(C2x20, 0, 1, 4, -2)),
    ("copy_cache-src", lambda: ref_copy_cache(C2x20, 0, 2, 0, -1), lambda: copy_cache_run(C2x20, 0, 2, 0, -1)),
    ("copy_cache-dst", lambda: ref_copy_cache(C2x20, 2, 0, 0, -1), lambda: copy_cache_run(C2x20, 2, 0, 0, -1)),
    ("copy_blocks-ok", lambda: ref_copy_blocks({0: [2, 3]}, G4x8), lambda: copy_blocks_runs({0: [2, 3]}, G4x8)),
    ("copy_blocks-empty-list", lambda: ref_copy_blocks({0: [2], 1: []}, G4x8),
     lambda: copy_blocks_runs({0: [2], 1: []}, G4x8)),
    ("copy_blocks-empty", lambda: ref_copy_blocks({}, G4x8), lambda: copy_blocks_runs({}, G4x8)),
    ("copy_blocks-chain", lambda: ref_copy_blocks({0: [1], 1: [2]}, G4x8),
     lambda: copy_blocks_runs({0: [1], 1: [2]}, G4x8)),
    ("copy_blocks-self", lambda: ref_copy_blocks({0: [0]}, G4x8), lambda: copy_blocks_runs({0: [0]}, G4x8)),
    ("copy_blocks-dup", lambda: ref_copy_blocks({0: [2], 1: [2]}, G4x8),
     lambda: copy_blocks_runs({0: [2], 1: [2]}, G4x8)),
    ("copy_blocks-range", lambda: ref_copy_blocks({0: [4]}, G4x8), lambda: copy_blocks_runs({0: [4]}, G4x8)),
    ("copy_blocks-src-range", lambda: ref_copy_blocks({4: [0]}, G4x8), lambda: copy_blocks_runs({4: [0]}, G4x8)),
    ("swap-ok", lambda: ref_swap_blocks({3: 0, 0: 3}, G4x8, G4x8), lambda: swap_blocks_runs({3: 0, 0: 3}, G4x8, G4x8)),
    ("swap-dup", lambda: ref_swap_blocks({0: 1, 2: 1}, G4x8, G4x8), lambda: swap_blocks_runs({0: 1, 2: 1}, G4x8, G4x8)),
    ("swap-empty", lambda: ref_swap_blocks({}, G4x8, G4x8), lambda: swap_blocks_runs({}, G4x8, G4x8)),
    ("swap-range", lambda: ref_swap_blocks({0: 4}, G4x8, G4x8), lambda: swap_blocks_runs({0: 4}, G4x8, G4x8)),
    ("swap-src-range", lambda: ref_swap_blocks({4: 0}, G4x8, G4x8), lambda: swap_blocks_runs({4: 0}, G4x8, G4x8)),
    ("swap-block-size", lambda: ref_swap_blocks({0: 0}, G4x8, G4x4), lambda: swap_blocks_runs({0: 0}, G4x8, G4x4)),
    ("swap-num-tensors", lambda: ref_swap_blocks({0: 0}, G4x8, G3x8), lambda: swap_blocks_runs({0: 0}, G4x8, G3x8)),
]


@pytest.mark.parametrize(("reference", "implementation"), [pytest.param(r, i, id=n) for n, r, i in BOUNDARY_CASES])
def test_boundary_cases(reference, implementation):
    """Hand-picked edges of every rule, so that each is checked on every run, not only when hypothesis finds it."""
    result = compare(reference, implementation)
    if result is not None:
        ref_runs, runs = result
        got = sorted(zip(runs.src_offset.tolist(), runs.dst_offset.tolist(), runs.length.tolist()))
        # compare byte maps (the implementation may merge or reorder runs)
        def bytes_of(triples):
            return sorted((s + i, d + i) for s, d, n in triples for i in range(n))
        assert bytes_of(got) == bytes_of(ref_runs)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda g: b2b_runs([2**63], [0], g, g), id="b2b-src"),
        pytest.param(lambda g: b2b_runs([0], [2**64 - 1], g, g), id="b2b-dst"),
        pytest.param(lambda g: c2b_runs(0, g, [2**63], g), id="c2b-dst"),
        pytest.param(lambda g: c2b_runs(2**64 - 1, g, [0], g), id="c2b-slot"),
        pytest.param(lambda g: slot_run(2**63, g, 0, g), id="slot-src"),
        pytest.param(lambda g: copy_cache_run(g, 0, 0, 2**64 - 1, -1), id="copy_cache-offset"),
        pytest.param(lambda g: copy_blocks_runs({2**63: [1]}, g), id="copy_blocks-src"),
        pytest.param(lambda g: copy_blocks_runs({0: [2**64 - 1]}, g), id="copy_blocks-dst"),
        pytest.param(lambda g: swap_blocks_runs({2**63: 0}, g, g), id="swap-src"),
        pytest.param(lambda g: swap_blocks_runs({0: 2**64 - 1}, g, g), id="swap-dst"),
    ],
)
def test_huge_index_is_param_invalid(call):
    """uint64 indices >= 2**63 pass the API's type checks; they must be rejected as out of range, not overflow."""
    g = geometry(2, 4, 8)
    with pytest.raises(LLMException) as info:
        call(g)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_offset_beyond_int64_is_param_invalid():
    """A slot whose byte offset needs 64 bits (a geometry as a peer may describe it) is refused, not overflowed."""
    huge = CacheGeometry(num_tensors=1, tensor_size=2**64, slots=2, is_blocks=False)  # slots of 2**63 bytes
    with pytest.raises(LLMException) as info:
        slot_run(1, huge, 0, huge)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_make_plan_rejects_length_mismatch():
    runs = b2b_runs([0], [0], geometry(2, 2, 4), geometry(2, 2, 4))
    with pytest.raises(LLMException) as info:
        make_plan(np.arange(2), np.arange(1), runs)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


# -- coalescing ------------------------------------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_consecutive_blocks_give_minimal_spans(data):
    """Consecutive block lists give one run; spans merge across tensor pairs exactly where memory continues."""
    stride = data.draw(st.integers(1, 8), label="stride")
    src = data.draw(geometries(stride=stride), label="src")
    dst = data.draw(geometries(stride=stride), label="dst")
    k = data.draw(st.integers(1, min(src.slots, dst.slots)), label="k")
    a = data.draw(st.integers(0, src.slots - k), label="a")
    b = data.draw(st.integers(0, dst.slots - k), label="b")
    kind = data.draw(st.sampled_from(["b2b", "swap"]) if src.num_tensors == dst.num_tensors else st.just("b2b"))
    if kind == "b2b":
        runs = b2b_runs(list(range(a, a + k)), list(range(b, b + k)), src, dst)
        pairs = list(zip(*data.draw(tensor_pairs(src.num_tensors, dst.num_tensors), label="tensors")))
    else:
        runs = swap_blocks_runs({a + i: b + i for i in range(k)}, src, dst)
        pairs = [(t, t) for t in range(src.num_tensors)]
    assert runs.length.tolist() == [k * stride]
    n = k * stride
    spans, src_addrs, dst_addrs = check_plan(data, runs, src, dst, pairs, [(a * stride, b * stride, n)])
    # one run per tensor pair, in plan order; pairs i and i+1 can only merge where memory continues on both sides
    run_src = [src_addrs[s_t] + a * stride for s_t, _ in pairs]
    run_dst = [dst_addrs[d_t] + b * stride for _, d_t in pairs]
    breaks = sum(1 for i in range(len(pairs) - 1)
                 if not (run_src[i] + n == run_src[i + 1] and run_dst[i] + n == run_dst[i + 1]))
    assert len(spans) == 1 + breaks


@SETTINGS
@given(st.data())
def test_copy_blocks_consecutive_is_one_run(data):
    """copy_blocks {a+i: [b+i]} with disjoint windows: one run per tensor (the tensor-major spans follow)."""
    g = data.draw(geometries(slots=data.draw(st.integers(2, 8))), label="geometry")
    k = data.draw(st.integers(1, g.slots // 2), label="k")
    a, b = sorted(data.draw(st.permutations(range(g.slots // k)), label="windows")[:2])
    if data.draw(st.booleans()):
        a, b = b, a
    a, b = a * k, b * k
    info = {a + i: [b + i] for i in range(k)}
    runs = copy_blocks_runs(info, g)
    assert (runs.src_offset.tolist(), runs.dst_offset.tolist(), runs.length.tolist()) == (
        [a * g.stride], [b * g.stride], [k * g.stride])
    check_plan(data, runs, g, g, [(t, t) for t in range(g.num_tensors)], [(a * g.stride, b * g.stride, k * g.stride)],
               same_memory=True)


@SETTINGS
@given(st.integers(1, 5), st.integers(1, 6), st.integers(1, 8), st.sampled_from([2**20, 2**40, 2**63]))
def test_whole_cache_copy_is_one_span_when_contiguous(nt, slots, stride, base):
    g = geometry(nt, slots, stride)
    runs = b2b_runs(list(range(slots)), list(range(slots)), g, g)
    plan = make_plan(*all_tensor_indices(g, g), runs)
    contiguous = [base + t * g.tensor_size for t in range(nt)]
    other = [base + 2**30 + t * g.tensor_size for t in range(nt)]
    spans = plan_to_spans(plan, contiguous, other)
    assert (spans.src.tolist(), spans.dst.tolist(), spans.length.tolist()) == ([base], [base + 2**30],
                                                                               [nt * g.tensor_size])
    spaced = [(t + 1) * 2**20 for t in range(nt)]
    spans = plan_to_spans(plan, spaced, spaced)
    assert spans.src.tolist() == spaced and spans.length.tolist() == [g.tensor_size] * nt


@st.composite
def raw_spans(draw, max_len=40):
    n = draw(st.integers(0, 10))
    src, dst, length = [], [], []
    s, d = draw(st.integers(0, 2**40)), draw(st.integers(0, 2**40))
    for _ in range(n):
        ln = draw(st.integers(1, max_len))
        if draw(st.booleans()):  # jump elsewhere on one or both sides
            s += draw(st.integers(-100, 100)) if s > 100 else draw(st.integers(0, 100))
        if draw(st.booleans()):
            d += draw(st.integers(-100, 100)) if d > 100 else draw(st.integers(0, 100))
        src.append(s)
        dst.append(d)
        length.append(ln)
        s, d = s + ln, d + ln
    return src, dst, length


@SETTINGS
@given(raw_spans())
def test_coalesce_matches_greedy_merge(spans):
    src, dst, length = spans
    want: list[list[int]] = []
    for s, d, n in zip(src, dst, length):
        if want and want[-1][0] + want[-1][2] == s and want[-1][1] + want[-1][2] == d:
            want[-1][2] += n
        else:
            want.append([s, d, n])
    got = coalesce(np.asarray(src, dtype=np.uint64), np.asarray(dst, dtype=np.uint64),
                   np.asarray(length, dtype=np.uint64))
    assert [list(x) for x in zip(*(a.tolist() for a in got))] == want


# -- executor.split_spans --------------------------------------------------------------------------------------

def expand(spans: Spans) -> list[tuple[int, int]]:
    out = []
    for s, d, n in zip(spans.src.tolist(), spans.dst.tolist(), spans.length.tolist()):
        out.extend((s + i, d + i) for i in range(n))
    return out


@st.composite
def chunk_and_piece(draw):
    """``chunk_bytes`` and ``piece_bytes`` (None = the default, ``chunk_bytes``; else at most ``chunk_bytes``)."""
    chunk = draw(st.integers(1, 64))
    return chunk, draw(st.one_of(st.none(), st.integers(1, chunk)))


def call_split(spans: Spans, chunk: int, piece: int | None):
    return split_spans(spans, chunk) if piece is None else split_spans(spans, chunk, piece)


@SETTINGS
@given(raw_spans(max_len=60), chunk_and_piece())
@example(([], [], []), (8, None))
@example(([0, 100], [0, 100], [8, 8]), (8, None))
@example(([0], [0], [16]), (8, None))
@example(([0], [0], [1]), (1, None))
@example(([0], [0], [5]), (8, 2))
@example(([0, 100], [0, 100], [8, 8]), (8, 4))
def test_split_spans(spans, chunk_piece):
    chunk, piece = chunk_piece
    limit = chunk if piece is None else piece
    src, dst, length = spans
    original = Spans(np.asarray(src, dtype=np.uint64), np.asarray(dst, dtype=np.uint64),
                     np.asarray(length, dtype=np.uint64))
    pieces, bounds = call_split(original, chunk, piece)
    n = len(pieces)
    assert pieces.src.dtype == pieces.dst.dtype == pieces.length.dtype == np.uint64
    # same bytes, same order: the split is a refinement of the original span list
    assert expand(pieces) == expand(original)
    assert pieces.total_bytes == original.total_bytes
    lengths = pieces.length.tolist()
    assert all(0 < x <= limit for x in lengths)
    assert n == sum(-(-x // limit) for x in length)  # each span cut into as few pieces as the limit allows
    # boundaries: start at 0, end at n, strictly increasing (so every piece is in exactly one chunk)
    b = bounds.tolist()
    assert b[0] == 0 and b[-1] == n
    assert all(x < y for x, y in itertools.pairwise(b))
    total = sum(length)
    if n == 0:
        assert b == [0]
    assert len(b) - 1 <= -(-total // chunk)
    max_piece = max(lengths, default=0)
    ends = np.cumsum([0] + lengths).tolist()
    for lo, hi in itertools.pairwise(b):
        size = ends[hi] - ends[lo]
        assert size < chunk + max_piece, (lo, hi, size)  # so a chunk is < 2 * chunk_bytes
        if hi < n:
            # an inner boundary follows the piece that reaches a multiple of chunk_bytes
            assert ends[hi] // chunk > ends[hi - 1] // chunk, (lo, hi)
    # every multiple of chunk_bytes inside the data is closed by a boundary right after the piece that reaches it
    for mark in range(chunk, total, chunk):
        first = next(i for i in range(n) if ends[i + 1] >= mark)
        assert first + 1 in b


@SETTINGS
@given(b2b_inputs(), chunk_and_piece(), st.data())
def test_split_spans_of_real_plan(inputs, chunk_piece, data):
    chunk, piece = chunk_piece
    src, dst, src_blocks, dst_blocks = inputs
    try:
        runs = b2b_runs(src_blocks, dst_blocks, src, dst)
    except LLMException:
        return
    pairs = data.draw(tensor_pairs(src.num_tensors, dst.num_tensors), label="tensors")
    plan = make_plan(np.asarray(pairs[0]), np.asarray(pairs[1]), runs)
    spans = plan_to_spans(plan, data.draw(address_lists(src.num_tensors, src.tensor_size)),
                          data.draw(address_lists(dst.num_tensors, dst.tensor_size)))
    pieces, bounds = call_split(spans, chunk, piece)
    assert expand(pieces) == expand(spans)
    assert all(0 < x <= (piece or chunk) for x in pieces.length.tolist())
    b = bounds.tolist()
    assert b[0] == 0 and b[-1] == len(pieces) and all(x < y for x, y in itertools.pairwise(b))


@pytest.mark.parametrize("op", ["pull", "push"])
@pytest.mark.parametrize("api", ["cache", "blocks"])
def test_caches_of_different_data_types_have_no_plan(op: str, api: str) -> None:
    """Equal bytes per block are not enough (bf16, 27, into float16, 1): the data type must match."""
    from aiodatadist.layout.plans import TransferParams, transfer_plan

    def geometry(data_type: int) -> CacheGeometry:
        return CacheGeometry(2, 4 * 512, 4, api == "blocks", data_type)

    params = TransferParams(op, api, src_blocks=(0,) if api == "blocks" else (), dst_blocks=(1,))
    with pytest.raises(LLMException, match="data type mismatch.*DT_FLOAT16.*DT_BF16") as info:
        transfer_plan(params, geometry(1), geometry(27), 0)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert transfer_plan(params, geometry(27), geometry(27), 0).total_bytes > 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=120), st.integers(1, 4))
def test_plan_cache_keeps_a_value_from_its_second_sight_on(accesses: list[tuple[int, int]], size: int) -> None:
    """Against a model: a key's first sight makes a value the cache does not keep, the next one makes a value it
    keeps; a hit returns the kept value itself; at most ``size`` are kept, least recently used first out, and every
    value pushed out (and only those) is told to ``on_evict``; a key pushed out must be seen twice again; keys seen
    once are remembered up to ``SEEN_PER_ENTRY * size``, the oldest forgotten first."""
    from collections import OrderedDict

    from aiodatadist.layout.plans import PlanCache

    plans = [make_plan(np.array([0], np.int64), np.array([0], np.int64),
                       Runs(*(np.array([i], np.int64) for _ in range(3)))) for i in range(6)]
    evicted: list[object] = []
    cache: PlanCache[object] = PlanCache(size, evicted.append)
    kept: OrderedDict[tuple[int, int], object] = OrderedDict()  # the model
    seen: OrderedDict[tuple[int, int], None] = OrderedDict()
    made: list[bool] = []
    for plan_index, part in accesses:
        key = (plan_index, part)
        value = cache.get_or_make(plans[plan_index], (part.to_bytes(8, "little"),),
                                  lambda kept_now: made.append(kept_now) or object())
        if key in kept:
            assert value is kept[key] and not made
            kept.move_to_end(key)
        elif key in seen:
            assert made == [True]
            del seen[key]
            kept[key] = value
            if len(kept) > size:
                assert evicted.pop(0) is kept.popitem(last=False)[1]
        else:
            assert made == [False] and value not in [v for _, v in cache.values()]
            seen[key] = None
            if len(seen) > PlanCache.SEEN_PER_ENTRY * size:
                seen.popitem(last=False)
        made.clear()
        assert not evicted
        assert [v for _, v in cache.values()] == list(kept.values())
