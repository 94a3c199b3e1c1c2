"""Publication of an owner's caches: the cache directory that same-host peers map read-only.

An owner publishes each remote-accessible cache in a row of a small ``memfd`` table (its layout is the native
helper's, :class:`~aiodatadist.native.DirWord`), read by same-host peers (:class:`~aiodatadist.transport.directory.
DirectoryView`) and by this process's native TCP threads serving one-sided reads and writes.  A row holds the cache
id, the ``model_id`` it answers to as a ``BlocksCacheKey`` (-1 if none), its memory (one span, or the exact
extents of its tensors for memory the caller allocated) and a *stamp*: a random
62-bit number drawn afresh each time a cache is published and 0 once it was released.  See
:mod:`aiodatadist.transport.directory` for how requesters use it.
"""

from __future__ import annotations

import logging
import secrets

import numpy as np

from ..memory import SharedSegment
from ..native import DIR_DEVICE, DIR_WORDS, DirWord, native_pool
from ..protocol.identity import SegmentIdentity

__all__ = ["DIRECTORY_ROWS", "CacheDirectory"]

DIRECTORY_ROWS = 4096
WITHDRAW_BOUND_MS = 5000
"""How long a release waits for the native threads serving a peer's frame from the row (each holds it for one
frame; one held up by a peer that stalled mid-frame is given up on, logged, as a copy that does not stop is)."""
log = logging.getLogger("aiodatadist.cache")
_WORDS = DIR_WORDS
_STAMP, _CACHE, _MODEL, _BASE, _SIZE = DirWord.STAMP, DirWord.CACHE, DirWord.MODEL, DirWord.BASE, DirWord.SIZE
_TABLE, _TENSORS, _FLAGS = DirWord.TABLE, DirWord.TENSORS, DirWord.FLAGS


class CacheDirectory:
    """Owner side: the table of published caches (written only from the owner's event loop thread)."""

    def __init__(self, rows: int = DIRECTORY_ROWS) -> None:
        self.segment = SharedSegment(rows * _WORDS * 8, name="aiodatadist-directory")
        self._words = self.segment.array().view(np.int64)[:rows * _WORDS]  # (the segment is whole pages)
        self._free = list(range(rows - 1, -1, -1))
        self._tables: dict[int, np.ndarray] = {}  # row -> its tensor table, alive until the row is withdrawn

    @property
    def address(self) -> int:
        """Where the table is in this process (the native TCP plane validates one-sided reads against it)."""
        return self.segment.address

    @property
    def rows(self) -> int:
        return len(self._words) // _WORDS

    def publish(self, cache_id: int, model_id: int = -1, base: int = 0, size: int = 0,
                tensors: np.ndarray | None = None, *, device: bool = False) -> tuple[int, int] | None:
        """Publish a live cache whose memory is ``[base, base + size)``, or (``tensors``: ascending,
        non-overlapping start addresses) tensors of ``size`` bytes at those addresses, nothing between them
        (``device``: device memory); returns ``(row, stamp)``, or ``None`` when the table is full."""
        if not self._free:
            return None
        row = self._free.pop()
        base_word = row * _WORDS
        self._words[base_word + _CACHE] = cache_id
        self._words[base_word + _MODEL] = model_id
        self._words[base_word + _BASE] = base
        self._words[base_word + _SIZE] = size
        self._words[base_word + _FLAGS] = DIR_DEVICE if device else 0
        if tensors is not None:
            table = self._tables[row] = np.array(tensors, dtype=np.uint64)  # its own copy
            self._words[base_word + _TABLE] = table.ctypes.data
            self._words[base_word + _TENSORS] = len(table)
        else:
            self._words[base_word + _TABLE] = 0
            self._words[base_word + _TENSORS] = 0
        stamp = secrets.randbits(62) + 1  # unguessable: a one-sided TCP read must present it
        self._words[base_word + _STAMP] = stamp  # last: a reader that sees the stamp sees the fields (x86 TSO)
        return row, stamp

    def set_model(self, row: int, model_id: int) -> None:
        self._words[row * _WORDS + _MODEL] = model_id

    def withdraw(self, row: int) -> None:
        """The cache was released: its row stops matching any stamp at once, and this returns once no native
        thread serving a peer's one-sided read or write still touches its memory (at most one frame each), or,
        past :data:`WITHDRAW_BOUND_MS`, with an error logged and the row never used again."""
        lib = native_pool()
        if lib is not None and lib.adt_dir_withdraw(self._words.ctypes.data, row, WITHDRAW_BOUND_MS):
            # A thread may still read the row (and its table) and the memory: neither is used again.
            log.error("a one-sided TCP transfer of a released cache did not stop within %d ms (a peer stalled "
                      "mid-frame); its memory may still be read or written until it does", WITHDRAW_BOUND_MS)
            return
        self._words[row * _WORDS + _STAMP] = 0
        self._tables.pop(row, None)  # no thread reads it any more
        self._free.append(row)

    @property
    def identity(self) -> SegmentIdentity:
        """The table's segment, as the handshake announces it to same-host peers (``dir``)."""
        return self.segment.identity

    def close(self) -> None:
        self._words = np.empty(0, dtype=np.int64)  # the view would keep the mapping alive
        self._free.clear()
        self.segment.close()
