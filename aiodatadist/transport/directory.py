"""The cache directory, requester side (the owner writes it: :mod:`aiodatadist.registry.publication`): which of an instance's shared-memory caches are live, readable by same-host peers.

An owner publishes each remote-accessible shared-memory cache in a row of a small ``memfd`` table that its
same-host peers map read-only.  A row holds the cache id, the ``model_id`` the cache currently answers to as a
``BlocksCacheKey`` (-1 if none) and a *stamp*: a random 62-bit number, drawn afresh each time a cache is
published and 0 once it was released.  The stamp is also a capability: a one-sided TCP read names it, and a
peer learns it only from the owner's reply to a transfer the authenticated control plane agreed.  A requester that already resolved a key through the owner (one round trip,
which also brings the cache's descriptor) keeps ``(row, stamp)``; later transfers by the same key check the row
instead of asking again, copy, and check the stamp once more afterwards: a cache released in between fails the
transfer with ``LLM_KV_CACHE_NOT_EXIST`` exactly as the round-trip path does.

This is safe because a peer's shared-memory cache stays mapped in the requester for the life of the link: a
copy that races a release touches pages that nobody else uses, never the owner's other memory.
Caller-registered memory outside any ``HostMemory`` is published too, with an empty span (size 0): same-host
peers pull it one-sided with ``process_vm_readv`` (a read that races a release reads pages that went back to the
caller, or faults; either way the stamp check fails the pull, and the owner's memory is never written) and push
into it with ``process_vm_writev``: unregistering caller-owned memory first ``WITHDRAW``s such writes (the owner
holds a lease until the peer confirms they stopped).  Every transfer of it over TCP goes through the owner.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

from ..memory import map_peer_segment
from ..native import DIR_WORDS, DirWord
from ..protocol.identity import SegmentIdentity

__all__ = ["DirectoryView", "Resolved"]

MAX_DIRECTORY_BYTES = 4096 * DIR_WORDS * 8 * 16  # a bound on what a peer may announce (16x the default table)
_WORDS = DIR_WORDS  # a row's words: see DirWord (mirrors native/src/net.c)
_STAMP, _CACHE, _MODEL = int(DirWord.STAMP), int(DirWord.CACHE), int(DirWord.MODEL)


class DirectoryView:
    """Requester side: a read-only mapping of a same-host peer's directory."""

    def __init__(self, identity: SegmentIdentity) -> None:
        self._map: mmap.mmap | None = map_peer_segment(identity, writable=False)
        try:  # a memoryview: indexing it gives Python ints, several times cheaper than numpy's scalars
            self._words = memoryview(self._map).cast("q")
        except TypeError:  # not a whole number of words
            self._map.close()
            raise ValueError("a directory holds whole 64-bit words") from None
        self.rows = len(self._words) // _WORDS

    @classmethod
    def from_wire(cls, identity: SegmentIdentity | None, pid: int) -> DirectoryView | None:
        """Map the directory a peer announced (the handshake's ``directory``); ``None`` when it is absent,
        malformed or not mappable."""
        if identity is None or identity.pid != pid or not 0 < identity.size <= MAX_DIRECTORY_BYTES:
            return None
        try:
            return cls(identity)
        except (OSError, OverflowError, ValueError):
            return None

    def live(self, row: int, stamp: int, cache_id: int, model_id: int | None) -> bool:
        """Whether the cache published as ``(row, stamp)`` is still live (and still answers to ``model_id``)."""
        if not 0 <= row < self.rows:
            return False
        base = row * _WORDS
        words = self._words
        if words[base + _STAMP] != stamp or words[base + _CACHE] != cache_id:
            return False
        return model_id is None or words[base + _MODEL] == model_id

    def close(self) -> None:
        if self._map is not None:
            self._words.release()
            self._words = memoryview(b"").cast("q")
            self.rows = 0
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None


@dataclass(frozen=True, slots=True)
class Resolved:
    """A key the owner resolved to a published cache: later transfers check the directory instead of asking."""

    cache_id: int
    slot: int
    row: int
    stamp: int
    model_id: int | None  # checked too for BlocksCacheKey: another cache may take the model id over
