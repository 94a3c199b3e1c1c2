"""The identity of a shared-memory segment, as peers announce it: a plain value (a leaf module, so that the sans-IO
protocol can carry it without loading the native helper)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SegmentIdentity"]


@dataclass(frozen=True, slots=True)
class SegmentIdentity:
    """What a peer needs to map a segment and verify it: owner pid, fd number, inode, device, size."""

    pid: int
    fd: int
    inode: int
    device: int
    size: int
