"""Host memory for caches: anonymous shared-memory segments that peers on the same host can map."""

from .host import HostMemory
from .segment import SegmentIdentity, SharedSegment, cache_segment, map_peer_segment, map_segment_fd

__all__ = ["HostMemory", "SegmentIdentity", "SharedSegment", "cache_segment", "map_peer_segment", "map_segment_fd"]
