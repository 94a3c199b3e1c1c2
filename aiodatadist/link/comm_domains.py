"""Two-sided links, as in LLM-DataDist: ``link`` returns a ``comm_id`` at once, and the link comes up in the
background while every member calls ``link`` with the same arguments; ``query_register_mem_status`` says how far
it got.

Here a communication domain is a set of one-sided links: each member links (``link_clusters``) to every member
of a lower rank, and waits for the members of a higher rank to link to it.  So every member but the highest
rank must listen (``llm.listenIpInfo``) at the address its rank table entry gives.  The domain is ``OK`` once
all its links exist, ``FAILED`` when a link is refused or the bring-up outlasts ``llm.LinkTotalTime`` seconds
(default :data:`DEFAULT_BRING_UP_S`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

from .._checks import check_int, require
from ..errors import LLMException, LLMStatusCode
from ..transfer_configs import RegisterMemStatus
from .rank_table import Member

__all__ = ["ATTEMPT_MS", "DEFAULT_BRING_UP_S", "MAX_COMM_DOMAINS", "CommDomains"]

log = logging.getLogger("aiodatadist.link.comm_domains")

DEFAULT_BRING_UP_S = 120
"""Bring-up bound without ``llm.LinkTotalTime`` (as HCCL's default connect timeout)."""
MAX_COMM_DOMAINS = 512
RETRY_S = 0.2  # a member of lower rank not listening yet: try again this much later
ATTEMPT_MS = 2000  # one link attempt

LinkOne = Callable[[Member], Awaitable[LLMStatusCode]]
"""Link to one member (``link_clusters`` of one cluster): its status code."""
UnlinkAll = Callable[[Collection[int]], Awaitable[None]]


@dataclass
class _Domain:
    members: list[Member]
    status: RegisterMemStatus = RegisterMemStatus.PREPARING
    task: asyncio.Task[None] | None = None
    error: str = ""
    peers: set[int] = field(default_factory=set)  # the members' cluster ids but this instance's


class CommDomains:
    """The communication domains of one instance (event loop thread only)."""

    def __init__(self, own_cluster_id: int, link_one: LinkOne, linked: Callable[[int], bool],
                 unlink: UnlinkAll, bring_up_s: float) -> None:
        self._own = own_cluster_id
        self._link_one = link_one
        self._linked = linked
        self._unlink = unlink
        self._bring_up_s = bring_up_s or DEFAULT_BRING_UP_S
        self._domains: dict[int, _Domain] = {}
        self._next_id = 1

    def start(self, members: list[Member]) -> int:
        """Start bringing up a domain of ``members`` (this instance among them); returns its ``comm_id``."""
        if len(self._domains) >= MAX_COMM_DOMAINS:
            raise LLMException("Link num is over limit", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        comm_id = self._next_id
        self._next_id += 1
        domain = _Domain(members, peers={m.cluster_id for m in members if m.cluster_id != self._own})
        domain.task = asyncio.ensure_future(self._bring_up(comm_id, domain))
        self._domains[comm_id] = domain
        return comm_id

    def status(self, comm_id: int) -> RegisterMemStatus:
        return self._domain(comm_id).status

    def _domain(self, comm_id: object) -> _Domain:
        cid = check_int("comm_id", comm_id, "uint64")
        domain = self._domains.get(cid)
        require(domain is not None, f"comm_id {cid} does not exist.")
        assert domain is not None
        return domain

    async def _bring_up(self, comm_id: int, domain: _Domain) -> None:
        own_rank = next(m.rank for m in domain.members if m.cluster_id == self._own)
        try:
            async with asyncio.timeout(self._bring_up_s):
                await asyncio.gather(*(self._link_lower(m) if m.rank < own_rank else self._await_higher(m)
                                       for m in domain.members if m.cluster_id != self._own))
            domain.status = RegisterMemStatus.OK
        except TimeoutError:
            missing = sorted(c for c in domain.peers if not self._linked(c))
            domain.error = f"not linked within {self._bring_up_s:g} s to clusters {missing}"
            domain.status = RegisterMemStatus.FAILED
        except LLMException as exc:
            domain.error = str(exc)
            domain.status = RegisterMemStatus.FAILED
        if domain.status == RegisterMemStatus.FAILED:
            log.warning("two-sided link %d of cluster %d failed: %s", comm_id, self._own, domain.error)

    async def _link_lower(self, member: Member) -> None:
        if member.port is None:
            raise LLMException(f"no port for rank {member.rank} (cluster {member.cluster_id}): give its rank table "
                               "entry a device_port, or listen on the same port here",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        while True:
            code = await self._link_one(member)
            if code in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
                return
            if code != LLMStatusCode.LLM_LINK_FAILED:  # refused for good (authentication, limits...)
                raise LLMException(f"linking to cluster {member.cluster_id} at {member.ip}:{member.port} failed: "
                                   f"{code.name}", status_code=code)
            await asyncio.sleep(RETRY_S)

    async def _await_higher(self, member: Member) -> None:
        while not self._linked(member.cluster_id):
            await asyncio.sleep(RETRY_S / 4)

    async def unlink(self, comm_id: int) -> None:
        """Stop the bring-up and unlink the domain's members; the ``comm_id`` is forgotten."""
        domain = self._domain(comm_id)
        del self._domains[comm_id]
        if domain.task is not None and not domain.task.done():
            domain.task.cancel()
            await asyncio.wait([domain.task])
        await self._unlink(domain.peers)

    async def close(self) -> None:
        """Stop every bring-up (``finalize``; the links themselves go with the instance)."""
        tasks = [d.task for d in self._domains.values() if d.task is not None and not d.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._domains.clear()
