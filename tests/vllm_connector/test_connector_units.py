"""The vLLM connector's pure parts: where a layer's KV blocks lie in memory (its options, which need no vLLM:
``tests/unit/integrations/test_engine_options.py``).

Skipped without vLLM (``bash scripts/vllm_tests.sh`` installs it in a venv of its own and runs these)."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("vllm")

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist.integrations.vllm import block_regions


def _bytes_of_block(base: int, block: int, block_elems: int, itemsize: int) -> int:
    return base + block * block_elems * itemsize


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(3, 9), dims=st.lists(st.integers(1, 5), min_size=1, max_size=3), split=st.booleans(),
       order=st.randoms(use_true_random=False))
def test_block_regions_locate_every_element(blocks: int, dims: list[int], split: bool, order) -> None:  # type: ignore[no-untyped-def]
    """For vLLM's layouts (``[num_blocks, ...]`` and ``[2, num_blocks, ...]``, with the dimensions inside a block
    stored in any order), every element of block b of region r lies inside ``[base_r + b * block_bytes, +block_bytes)``."""
    inner = list(range(len(dims)))
    order.shuffle(inner)
    physical = [blocks] + [dims[i] for i in inner]
    if split:
        physical = [2] + physical
    storage = torch.arange(int(torch.tensor(physical).prod()), dtype=torch.float32).reshape(physical)
    # A logical view whose inner dimensions are permuted back (what vLLM's stride orders do).
    lead = 2 if split else 1
    perm = list(range(lead)) + [lead + inner.index(i) for i in range(len(dims))]
    tensor = storage.permute(perm)
    bases, block_elems = block_regions(tensor, blocks)
    assert block_elems == int(torch.tensor(dims).prod())
    assert len(bases) == (2 if split else 1)
    regions = [tensor[r] for r in range(2)] if split else [tensor]
    for base, region in zip(bases, regions):
        for b in range(blocks):
            low = _bytes_of_block(base, b, block_elems, 4)
            element_addrs = [region[b].data_ptr() + 4 * sum(i * s for i, s in zip(idx, region[b].stride()))
                             for idx in itertools.product(*(range(n) for n in region[b].shape))]
            assert sorted(element_addrs) == list(range(low, low + 4 * block_elems, 4))


def test_block_regions_refuse_blocks_that_are_not_contiguous() -> None:
    interleaved = torch.zeros(5, 2, 4).transpose(0, 1)  # [2, 5 blocks, 4]: K and V of a block side by side
    assert block_regions(interleaved, 5) == ([interleaved.data_ptr()], 8)  # one region of 8-element blocks
    strided = torch.zeros(5, 8)[:, ::2]  # every other element
    with pytest.raises(ValueError, match="not contiguous"):
        block_regions(strided, 5)
    with pytest.raises(ValueError, match="has 7 blocks"):
        block_regions(torch.zeros(5, 4), 7)
