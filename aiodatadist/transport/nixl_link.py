"""The NIXL data plane of one link: READs and WRITEs by this instance's NIXL agent (:mod:`.nixl`).

The requester's agent loads the peer's agent metadata (sent in the descriptor of the first transfer of each
cache) and prepares the peer's caches as descriptor lists, once per cache; the owner only resolves, leases and
describes.  A cache the peer freed leaves a region NIXL cannot forget alone, so the peer's agent is loaded
again, from its live caches only, before the next transfer.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from .._aio import wait_through_cancellation
from ..errors import LLMException, LLMLinkError
from ..layout.plans import CopyPlan
from ..protocol.messages import Freed, NixlReach
from .nixl import NixlJob, NixlPlane, RemoteCache
from .plane import DataPlane, OnUntrusted, Transfer
from .same_host import PeerCapabilities

__all__ = ["NixlAgentCaches", "NixlLinkPlane"]


class NixlAgentCaches(Protocol):
    """This instance's NIXL agent and its caches' registrations (``transfer.nixl_caches.NixlCaches``)."""

    @property
    def plane(self) -> NixlPlane | None: ...

    def reach(self, entry: Any) -> tuple[bytes, str, int]: ...

    def transfer(self, plan: CopyPlan, local: Any, remote: RemoteCache, pull: bool) -> NixlJob: ...


class NixlLinkPlane(DataPlane):
    """A link whose bytes NIXL moves (both ends chose ``llm.Transport=nixl``)."""

    kind = "nixl"

    @property
    def device_path(self) -> str:
        return "nixl"

    def __init__(self, peer: int, name: str, caps: PeerCapabilities, on_untrusted: OnUntrusted,
                 agent: NixlAgentCaches) -> None:
        super().__init__(peer, name, caps, on_untrusted)
        self._agent = agent
        # requester side: the peer's agent, its caches as prepared descriptor lists, running jobs
        self._peer_agent: str | None = None
        self._remote: dict[int, RemoteCache] = {}
        self._stale = False  # the peer freed a cache it described: its agent's view here must be rebuilt
        self._rebuilt: asyncio.Future[None] | None = None  # set while that view is being rebuilt
        # owner side: the caches described to the peer (told when they are freed)
        self._described: set[int] = set()

    # -- requester side --------------------------------------------------------------------------------------
    async def move(self, transfer: Transfer) -> None:
        """READ (pull) or WRITE (push) the bytes; the caller holds a lease on the local cache."""
        plane = self._agent.plane
        if plane is None:
            raise LLMLinkError("the NIXL plane is not running")
        while self._rebuilt is not None:
            await asyncio.shield(self._rebuilt)
        remote = self._remote.get(transfer.cache_id)
        if remote is None:
            remote = await self._prepare(plane, transfer)
        job = self._agent.transfer(transfer.plan, transfer.local, remote, transfer.pull)
        self._jobs[transfer.tid] = job
        try:
            await plane.wait(job)
        except LLMLinkError as exc:  # NIXL's connection to the peer broke, as a TCP data connection would
            if self.closed is None:
                await wait_through_cancellation(self.untrusted(exc))
            raise
        finally:
            self._jobs.pop(transfer.tid, None)
            if job.stuck and self.closed is None:  # NIXL may still move bytes of it: the peer cannot be trusted
                await wait_through_cancellation(self.untrusted(LLMLinkError(
                    f"a cancelled NIXL transfer with cluster {self.peer} did not stop; link dropped")))

    async def _prepare(self, plane: NixlPlane, transfer: Transfer) -> RemoteCache:
        reach = transfer.descriptor.nixl
        if reach is None:
            raise LLMLinkError(f"cluster {self.peer} described cache {transfer.cache_id} without NIXL metadata")
        if self._stale:
            await self._rebuild_peer(plane)
        self._peer_agent = plane.add_peer(reach.metadata)
        remote = self._remote[transfer.cache_id] = plane.prepare_remote(
            self._peer_agent, transfer.descriptor.geometry, transfer.descriptor.addrs, reach.mem, reach.dev,
            reach.metadata)
        return remote

    async def _rebuild_peer(self, plane: NixlPlane) -> None:
        """The peer freed caches this agent loaded: their stale regions could shadow a new cache at the same
        addresses (NIXL cannot forget one region), so load the peer agent again from its live caches only, once
        the link's running NIXL jobs are done (new ones wait)."""
        self._stale = False
        rebuilt = self._rebuilt = asyncio.get_running_loop().create_future()
        try:
            while self._jobs:
                await wait_through_cancellation(asyncio.wait([job.future for job in self._jobs.values()]))
            if self._peer_agent is not None:
                for remote in self._remote.values():
                    plane.release_remote(remote)
                plane.remove_peer(self._peer_agent)
                self._peer_agent = None
            for cid, remote in list(self._remote.items()):
                self._peer_agent = plane.add_peer(remote.metadata)
                self._remote[cid] = plane.prepare_remote(self._peer_agent, remote.geometry, remote.addrs, remote.mem,
                                                         remote.dev, remote.metadata)
        finally:
            self._rebuilt = None
            rebuilt.set_result(None)

    def _cancel(self, job: Any, error: LLMException) -> None:
        plane = self._agent.plane
        if plane is not None:
            plane.cancel(job, error)

    async def _wait_stopped(self, job: Any) -> None:
        plane = self._agent.plane
        if plane is not None:
            await plane.wait_stopped(job)

    def freed(self, message: Freed) -> None:
        remote = self._remote.pop(message.cid, None)
        plane = self._agent.plane
        if remote is not None and plane is not None:
            plane.release_remote(remote)
            self._stale = True

    # -- owner side ------------------------------------------------------------------------------------------
    def reach(self, entry: Any) -> NixlReach | None:
        if self._agent.plane is None:
            return None
        self._described.add(entry.cache_id)
        return NixlReach(*self._agent.reach(entry))

    def tells_freed(self, cache_id: int, mapped: bool) -> bool:
        described = cache_id in self._described
        self._described.discard(cache_id)
        return described or super().tells_freed(cache_id, mapped)

    # -- lifetime --------------------------------------------------------------------------------------------
    async def stop(self, error: LLMException) -> None:
        await super().stop(error)
        await self._stop_jobs(error)

    async def close(self) -> None:
        plane = self._agent.plane
        if plane is None:
            return
        for remote in self._remote.values():
            plane.release_remote(remote)
        self._remote.clear()
        if self._peer_agent is not None:
            plane.remove_peer(self._peer_agent)
            self._peer_agent = None
