"""What the transfer layer keeps per link, both as requester and as owner.

A :class:`~aiodatadist.link.link.Link` knows nothing of transfers (its data plane keeps its own running jobs):
this table is keyed by the link object and dropped when the link closes.
"""

from __future__ import annotations

import asyncio
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..protocol.messages import Descriptor
from ..registry.caches import CacheEntry, IndexKey
from ..transport.directory import Resolved

if TYPE_CHECKING:
    from ..link.link import Link

__all__ = ["Lease", "LinkTransfers", "TransferStates", "transfer_id"]


@dataclass(eq=False)
class Lease:
    """Owner side of a running transfer: keeps the cache alive until the requester ends it."""

    entry: CacheEntry
    release_key: IndexKey | None  # a pull by CacheKey: the key it took (released if it succeeds, else bound again)
    job: Any = None  # the owner's end on the link's data plane (TCP: sending for a pull, receiving for a push)
    op: str = "pull"  # the requester's operation
    nbytes: int = 0  # what the plan moves
    started: float = 0.0  # time.perf_counter() at BEGIN
    withdrawing: bool = False  # not a transfer: held from WITHDRAW until the requester's END (not in the stats)


@dataclass(eq=False)
class LinkTransfers:
    """The transfers of one link."""

    # owner side
    leases: dict[int, Lease] = field(default_factory=dict)  # by transfer id
    writable: set[int] = field(default_factory=set)  # caller-owned caches the peer may write one-sided (by id)
    # requester side
    running: set[int] = field(default_factory=set)  # transfers between BEGIN and their end
    aborted: set[int] = field(default_factory=set)  # ABORTs that came before the copy started
    descriptors: dict[int, Descriptor] = field(default_factory=dict)  # the peer's caches, by cache id
    resolved: dict[IndexKey, Resolved] = field(default_factory=dict)  # keys resolved to published caches
    writing: dict[int, tuple[int, asyncio.Future[None]]] = field(default_factory=dict)
    """One-sided pushes running: transfer id -> (the peer's cache id, done when the push no longer writes)."""


class TransferStates:
    """``Link`` -> :class:`LinkTransfers`, created on first use, dropped when the link closes."""

    def __init__(self) -> None:
        self._by_link: dict[Link, LinkTransfers] = {}

    def of(self, link: Link) -> LinkTransfers:
        """The link's state (a closed link gets an empty one that is not kept)."""
        state = self._by_link.get(link)
        if state is None:
            state = LinkTransfers()
            if not link.closed:
                self._by_link[link] = state
        return state

    def pop(self, link: Link) -> LinkTransfers | None:
        return self._by_link.pop(link, None)


_ID_BATCH = 512
_random_ids: list[int] = []  # from os.urandom, a batch at a time (list.pop and extend are atomic)
os.register_at_fork(after_in_child=_random_ids.clear)  # a forked child never hands out its parent's ids


def transfer_id(running: set[int]) -> int:
    """A fresh transfer id: random, so that it is also the transfer's token on the data connections.

    A TCP frame is written only into a transfer its receiving end registered under that id, which the
    authenticated control plane agreed; 62 random bits cannot be guessed by whoever else reaches the port.
    The bits come from ``os.urandom`` (as ``secrets`` takes them), read 512 ids at a time: one system call per
    transfer cost more than the rest of a small same-host transfer's bookkeeping.
    """
    while True:
        try:
            tid = _random_ids.pop()
        except IndexError:
            _random_ids.extend(v >> 2 for v in struct.unpack(f"<{_ID_BATCH}Q", os.urandom(8 * _ID_BATCH)))
            continue
        if tid and tid not in running:
            return tid
