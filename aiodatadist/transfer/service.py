"""``TransferService``: the requester and owner sides of one instance, behind the link manager's hooks.

:class:`~aiodatadist.transfer.requester.Requester` runs this instance's pulls and pushes;
:class:`~aiodatadist.transfer.owner.Owner` serves its peers'.  The service routes a link's requests to them and
cleans up a closed link's transfers (copies stopped before leases are dropped).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..copy.engine import CopyEngine
from ..errors import LLMException, LLMLinkError, LLMStatusCode, LLMTimeoutError
from ..link.link import Link
from ..link.manager import LinkManager
from ..notifications import NotificationInbox
from ..protocol.codec import ProtocolError
from ..protocol.messages import (
    Abort,
    Begin,
    End,
    Freed,
    Located,
    Notify,
    Resolve,
    ResolveReply,
    Withdraw,
    request_from_wire,
)
from ..registry.caches import CacheEntry, CacheRegistry
from ..settings.options import Settings
from ..stats import OneSided, StatsRecorder
from .owner import Owner
from .requester import Requester
from .state import LinkTransfers, TransferStates

__all__ = ["TransferService"]


class TransferService:
    """Pulls and pushes of one :class:`~aiodatadist.LLMDataDist`, both sides."""

    def __init__(self, cluster_id: int, settings: Settings, links: LinkManager, registry: CacheRegistry,
                 engine: CopyEngine, stats: StatsRecorder, inbox: NotificationInbox) -> None:
        self._states = TransferStates()
        self._settings = settings
        self._links = links
        self._stats = stats
        self._inbox = inbox
        self._requester = Requester(cluster_id, settings, links, registry, self._states, stats)
        self._owner = Owner(links, registry, engine, self._states, inbox.deliver, stats)
        self.run = self._requester.run
        """One pull or push, bounded by ``sync_kv_timeout`` (:meth:`Requester.run`)."""
        links.on_request = self.handle
        links.on_link_closed = self.on_link_closed

    def state_of(self, link: Link) -> LinkTransfers:
        """The transfers of ``link`` (for diagnostics and tests)."""
        return self._states.of(link)

    async def resolve(self, cluster_id: int, addrs: tuple[int, ...]) -> tuple[Located, ...]:
        """Where cluster ``cluster_id`` holds ``addrs`` (its registered tensors): ``LLM_KV_CACHE_NOT_EXIST`` if an
        address is in none, ``LLM_NOT_YET_LINK`` when not linked."""
        link = self._links.links.get(cluster_id) or await self._links.not_linked(cluster_id)
        try:
            async with asyncio.timeout(self._settings.sync_kv_timeout_ms / 1000):
                reply = await link.channel.request(Resolve(addrs))
        except TimeoutError:
            raise LLMTimeoutError(f"cluster {cluster_id} did not resolve destination addresses within "
                                  f"{self._settings.sync_kv_timeout_ms} ms") from None
        try:
            located = ResolveReply.from_wire(reply).at
        except ProtocolError as exc:
            raise LLMException(f"malformed resolve reply: {exc}", status_code=LLMStatusCode.LLM_FAILED) from None
        if len(located) != len(addrs):
            raise LLMException("resolve reply of the wrong length", status_code=LLMStatusCode.LLM_FAILED)
        return located

    async def notify(self, cluster_id: int, note: bytes) -> None:
        """Send a notification (checked) over the link to ``cluster_id`` and wait until the peer queued it (or
        dropped it: its queue was full), bounded by ``sync_kv_timeout``."""
        link = self._links.links.get(cluster_id) or await self._links.not_linked(cluster_id)
        self._stats.notification_sent(cluster_id)
        timeout_ms = self._settings.sync_kv_timeout_ms
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                await link.channel.request(Notify(note))
        except TimeoutError as exc:
            if isinstance(exc, LLMException):
                raise
            raise LLMTimeoutError(f"notify of cluster {cluster_id} was not acknowledged within "
                                  f"sync_kv_timeout={timeout_ms} ms") from None

    async def handle(self, link: Link, message: dict[str, Any]) -> dict[str, Any] | None:
        """A transfer request from a peer; returns the reply body (None: answered later, or never)."""
        match request_from_wire(message):
            case Begin() as begin:
                return self._owner.begin(link, begin, message["i"])
            case End() as end:
                return self._owner.end(link, end, message["i"])
            case Abort() as abort:
                self._requester.abort(link, abort)
                return None
            case Freed() as freed:
                self._requester.freed(link, freed)
                return None
            case Withdraw() as withdraw:
                self._requester.withdraw(link, withdraw)
                return None
            case Notify() as notify:
                self._inbox.deliver(link.remote_cluster_id, notify.note)
                return {}
            case Resolve() as resolve:
                return self._owner.resolve(resolve)
            case _:
                raise ProtocolError(f"unexpected request {message['k']!r}")

    def announce_freed(self, entry: CacheEntry) -> None:
        """Owner side: ``entry``'s memory is gone; same-host peers let go of their mappings."""
        self._owner.announce_freed(entry)

    async def drop_links_using(self, entry: CacheEntry, reason: str) -> list[int]:
        """Drop the links whose peers still hold leases on ``entry``; returns their cluster ids."""
        holders = [link for link in list(self._links.links.values())
                   if any(lease.entry is entry for lease in self._states.of(link).leases.values())]
        for link in holders:
            await self._links.drop(link, LLMLinkError(reason))
        return [link.remote_cluster_id for link in holders]

    def abort_remote(self, entry: CacheEntry) -> None:
        """Owner side: ask requesters whose running transfers use ``entry`` (being released) to stop."""
        self._owner.abort_remote(entry)

    def one_sided_served(self) -> dict[int, tuple[str, OneSided]]:
        """The one-sided reads and writes the live links' I/O threads served: remote cluster -> (plane, counts)."""
        served: dict[int, tuple[str, OneSided]] = {}
        for cluster, link in self._links.links.items():
            counts = link.plane.served_one_sided()
            if counts is not None:
                served[cluster] = (link.plane.kind, counts)
        return served

    async def on_link_closed(self, link: Link, error: LLMException) -> None:
        """The link's data plane has stopped: record its final counts and drop the owner-side leases."""
        counts = link.plane.served_one_sided()
        if counts is not None:  # its data plane has stopped: these are final
            self._stats.one_sided_closed(link.remote_cluster_id, link.plane.kind, counts)
        state = self._states.pop(link)
        if state is not None:
            self._owner.link_closed(link, state)

