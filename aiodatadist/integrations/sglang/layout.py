"""How SGLang's transfer buffers become aiodatadist blocks caches (pure: no SGLang, no I/O).

SGLang describes a KV pool as parallel lists: one buffer per layer for K and one for V (``kv_data_ptrs``,
``kv_data_lens``, ``kv_item_lens``: bytes of one page).  Buffers of equal item size form one blocks cache of
``uint8`` blocks (a page each), in the order SGLang lists them: a KV pool is usually one cache of ``2 x layers``
tensors, so one pull moves a chunk's pages of every layer.

Both engines compute the same groups from the same lists, so buffer ``i`` of the prefill lands in buffer ``i`` of
the decode: group ``g`` of one side is group ``g`` of the other, tensor for tensor.  The metadata ("aux") buffers,
one row of ``aux_item_lens[i]`` bytes per request, travel in notifications instead (:mod:`.wire`); both engines
move the buffers they share (:func:`matching_prefix`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BufferGroup", "group_buffers", "matching_prefix"]


@dataclass(frozen=True, slots=True)
class BufferGroup:
    """Buffers of one item size: one blocks cache of ``len(addrs)`` tensors of ``blocks`` items each."""

    model_id: int
    indices: tuple[int, ...]  # positions of the buffers in SGLang's lists, ascending
    addrs: tuple[int, ...]
    item_len: int  # bytes of one block (a KV page, an aux row)
    blocks: int  # blocks every buffer of the group holds (the smallest buffer's count)


def group_buffers(ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int],
                  first_model_id: int = 0) -> list[BufferGroup]:
    """Group buffers by item size, in order of first appearance; ``ValueError`` on inconsistent lists (different
    lengths, a null pointer, an item size <= 0, a buffer smaller than one item)."""
    if not len(ptrs) == len(lens) == len(item_lens):
        raise ValueError(f"buffer lists differ in length: {len(ptrs)} pointers, {len(lens)} lengths, "
                         f"{len(item_lens)} item sizes")
    members: dict[int, list[int]] = {}
    for i, (ptr, length, item) in enumerate(zip(ptrs, lens, item_lens, strict=True)):
        if ptr <= 0 or item <= 0 or length < item:
            raise ValueError(f"buffer {i}: pointer {ptr:#x}, {length} bytes, items of {item} bytes: not a buffer of "
                             "whole items")
        members.setdefault(int(item), []).append(i)
    return [BufferGroup(first_model_id + g, tuple(indices), tuple(int(ptrs[i]) for i in indices), item,
                        min(int(lens[i]) // item for i in indices))
            for g, (item, indices) in enumerate(members.items())]


def matching_prefix(mine: Sequence[int], theirs: Sequence[int]) -> int:
    """How many leading buffers two engines share (item sizes equal, position for position); SGLang pairs aux
    buffers this way and moves only the common ones (an optional buffer enabled on one engine only comes last)."""
    count = 0
    for a, b in zip(mine, theirs):
        if a != b:
            break
        count += 1
    return count

