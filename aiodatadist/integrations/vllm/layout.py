"""Where a vLLM layer's KV blocks lie in memory (torch only: no vLLM)."""

from __future__ import annotations

import itertools
import math

import torch

__all__ = ["block_regions"]


def block_regions(tensor: torch.Tensor, num_blocks: int) -> tuple[list[int], int]:
    """Where a layer's KV blocks lie: the base address of each region holding ``num_blocks`` blocks back to back,
    and the elements per block.

    A layer's tensor holds one region (``[num_blocks, ...]``, vLLM CPU) or several along leading dimensions
    (``[2, num_blocks, ...]``: K and V, vLLM CUDA); within a region, block i starts ``i * block_elems`` elements
    after its base and its elements are dense (in any order of dimensions: both sides share the layout)."""
    dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
    if not dims:
        raise ValueError(f"AiodatadistConnector: no dimension of the KV cache tensor {tuple(tensor.shape)} has "
                         f"{num_blocks} blocks")
    block_dim = dims[0]
    inner = [d for d in range(tensor.dim()) if d != block_dim]
    if _dense(tensor, inner, tensor.stride(block_dim)):  # the whole tensor is one region
        return [tensor.data_ptr()], tensor.stride(block_dim)
    regions = [tensor[index] for index in itertools.product(*(range(n) for n in tensor.shape[:block_dim]))]
    inner = list(range(1, tensor.dim() - block_dim))
    if all(_dense(region, inner, region.stride(0)) for region in regions):
        return [region.data_ptr() for region in regions], regions[0].stride(0)
    raise ValueError(f"AiodatadistConnector: the blocks of a KV cache tensor of shape {tuple(tensor.shape)} and "
                     f"strides {tensor.stride()} are not contiguous ranges of memory")


def _dense(tensor: torch.Tensor, dims: list[int], block_stride: int) -> bool:
    """True when the dimensions ``dims`` of ``tensor`` fill exactly ``block_stride`` elements, densely."""
    expected = 1
    for d in sorted(dims, key=lambda d: (tensor.stride(d), tensor.shape[d])):
        if tensor.shape[d] == 1:
            continue
        if tensor.stride(d) != expected:
            return False
        expected *= tensor.shape[d]
    return expected == block_stride and math.prod(tensor.shape[d] for d in dims) == block_stride
