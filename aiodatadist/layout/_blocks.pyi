"""Type stub of the compiled ``aiodatadist._blocks`` (``_blocks.c``)."""

from collections.abc import Sequence

def block_runs(src: Sequence[int], dst: Sequence[int], src_slots: int, dst_slots: int, stride: int, /) -> bytes | None:
    """``src[i] -> dst[i]`` as runs of ``stride``-byte blocks in source order, merged where both sides continue:
    m source offsets, m destination offsets, m lengths (int64 bytes); None for input it does not take."""
