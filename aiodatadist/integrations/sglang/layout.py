"""How SGLang's transfer buffers become aiodatadist blocks caches (pure: no SGLang, no I/O).

SGLang describes a KV pool as parallel lists: one buffer per layer for K and one for V (``kv_data_ptrs``,
``kv_data_lens``, ``kv_item_lens``: bytes of one page), and its metadata ("aux") buffers the same way, one row
of ``aux_item_lens[i]`` bytes per request.  Buffers of equal item size form one blocks cache of ``uint8`` blocks
(a page, or an aux row), in the order SGLang lists them: a KV pool is usually one cache of ``2 x layers`` tensors,
so one push moves a chunk's pages of every layer; the aux buffers make a few small caches (one per row size).

Both engines compute the same groups from the same lists, so buffer ``i`` of the prefill lands in buffer ``i`` of
the decode: group ``g`` of one side is group ``g`` of the other, tensor for tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AUX_MODEL_BASE", "AuxPush", "BufferGroup", "aux_pushes", "group_buffers", "matching_prefix"]

AUX_MODEL_BASE = 1 << 16
"""``BlocksCacheKey.model_id`` of the first aux group (KV groups are numbered from 0)."""


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


@dataclass(frozen=True, slots=True)
class AuxPush:
    """One push of a request's aux rows: the first ``tensors`` buffers of the local group ``group`` into the first
    ``tensors`` buffers of the peer's group ``dst_model_id``."""

    group: BufferGroup
    dst_model_id: int
    tensors: int


def aux_pushes(mine: Sequence[BufferGroup], my_item_lens: Sequence[int], their_item_lens: Sequence[int],
               first_model_id: int = AUX_MODEL_BASE) -> list[AuxPush]:
    """The pushes that move the aux buffers both engines share (:func:`matching_prefix`) into the peer's groups.

    The peer groups its buffers as :func:`group_buffers` does; a group's buffers below the common prefix are the
    group's first ones on both sides, in the same order."""
    common = matching_prefix(my_item_lens, their_item_lens)
    their_ids: dict[int, int] = {}
    for item in their_item_lens:
        their_ids.setdefault(int(item), first_model_id + len(their_ids))
    pushes = []
    for group in mine:
        tensors = sum(1 for i in group.indices if i < common)
        if tensors:
            pushes.append(AuxPush(group, their_ids[group.item_len], tensors))
    return pushes
