"""``LLMDataDist``: one instance of the KV-cache transfer service (a cluster), asyncio-native."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Collection
from types import TracebackType
from typing import Self

from ._checks import check_bool, check_event_loop, check_int, check_isinstance, require
from .cache_manager import CacheManager
from .config import OptionKey
from .copy import release_shared_executor, shared_executor, staging
from .copy.engine import CopyEngine
from .errors import LLMException, LLMNotInitializedError, LLMStatusCode
from .link.comm_domains import ATTEMPT_MS, CommDomains
from .link.manager import LinkManager
from .link.planes import PlaneFactory
from .link.rank_table import Member, check_comm_args, members_of
from .native import native_pool
from .notifications import Notification, NotificationInbox, check_notification
from .registry.caches import CacheRegistry
from .registry.publication import CacheDirectory
from .settings.options import Settings, parse_listen_ip_info, parse_options
from .stats import StatsRecorder, StatsSnapshot
from .transfer.nixl_caches import NixlCaches
from .transfer.service import TransferService
from .transfer_configs import RegisterMemStatus
from .types import LLMClusterInfo, LLMRole, Transport

__all__ = ["LLMDataDist"]

log = logging.getLogger("aiodatadist.datadist")


class LLMDataDist:
    """A cluster: owns its caches, its links and its background tasks.

    Several instances may live in one process and one event loop.  ``async with LLMDataDist(role, id) as dd``
    finalizes on exit; call ``await dd.init(options)`` inside.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_isinstance("role", role, LLMRole)
        self._role = role
        self._cluster_id = check_int("cluster_id", cluster_id, "uint64")
        self._settings: Settings | None = None
        self._cache_manager: CacheManager | None = None
        self._links: LinkManager | None = None
        self._transfers: TransferService | None = None
        self._nixl: NixlCaches | None = None
        self._inbox: NotificationInbox | None = None  # notifications received, from init to finalize
        self._stats = StatsRecorder()  # outlives links and finalize
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of init: every coroutine runs on it
        self._domains: CommDomains | None = None  # two-sided links (link/unlink), from init to finalize

    # -- properties ------------------------------------------------------------------------------------------
    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def role(self) -> LLMRole:
        return self._role

    @property
    def is_initialized(self) -> bool:
        return self._settings is not None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            raise LLMNotInitializedError()
        return self._settings

    @property
    def cache_manager(self) -> CacheManager:
        """The :class:`CacheManager` of this instance (requires ``init``)."""
        if self._cache_manager is None:
            raise LLMNotInitializedError()
        return self._cache_manager

    # -- lifetime --------------------------------------------------------------------------------------------
    async def init(self, options: dict[str, str]) -> None:
        """Initialize from an option dict (see :meth:`LLMConfig.generate_options`); a second call is a no-op.

        With ``llm.listenIpInfo`` the instance listens there (it is a server).
        """
        check_event_loop(self._loop)
        if self._settings is not None:
            return
        loop = asyncio.get_running_loop()
        settings = parse_options(options)
        executor = shared_executor()
        directory: CacheDirectory | None = None
        links: LinkManager | None = None
        nixl: NixlCaches | None = None
        try:
            # The composition root: every service gets its collaborators here, and none reaches back.
            directory = CacheDirectory()
            registry = CacheRegistry(directory)
            engine = CopyEngine(executor, settings.device_id)
            nixl = NixlCaches(str(self._cluster_id), settings.device_id, registry)
            if settings.transport == Transport.NIXL:
                nixl.start()  # LLM_FEATURE_NOT_ENABLED here, not at the first link, when NIXL is missing
            # TCP links use the native helper's I/O threads unless llm.Net / AIODATADIST_NET says python
            planes = PlaneFactory(self._cluster_id, engine, nixl, settings.native_net and native_pool() is not None,
                                  (directory.address, directory.rows), settings.device_staging,
                                  self._stats.mark_staged)
            links = LinkManager(self._cluster_id, self._role, settings, registry, planes, nixl.start,
                                self._stats.messages)
            inbox = NotificationInbox(self._stats)
            transfers = TransferService(self._cluster_id, settings, links, registry, engine, self._stats, inbox)
            registry.on_freed = transfers.announce_freed  # peers let go of what they mapped
            manager = CacheManager(self._cluster_id, settings, registry, engine, transfers)
            if settings.listen is not None:
                await links.listen(*settings.listen)
        except BaseException:
            try:
                if links is not None:
                    await links.close()
            finally:
                if directory is not None:
                    directory.close()
                if nixl is not None:
                    nixl.close()
                await release_shared_executor()
            raise
        self._settings = settings
        self._loop = loop
        self._cache_manager = manager
        self._transfers = transfers
        self._inbox = inbox
        self._links = links
        self._nixl = nixl
        self._domains = CommDomains(self._cluster_id, self._link_member, lambda c: c in links.links,
                                    self._unlink_members, settings.link_total_time_s)
        log.debug("cluster %d initialized as %s", self._cluster_id, self._role)

    async def finalize(self) -> None:
        """Unlink every peer (they are told, so their transfers fail fast), stop running transfers, release
        every cache, the sockets and the worker threads.  A no-op when not initialized."""
        if self._settings is None:
            return
        check_event_loop(self._loop)
        links, self._links = self._links, None
        domains, self._domains = self._domains, None
        try:
            if domains is not None:
                await domains.close()
            if links is not None:
                await links.close()
        finally:
            inbox, self._inbox = self._inbox, None
            if inbox is not None:  # consumers get what was queued, then their iterators end
                inbox.close()
            manager, self._cache_manager = self._cache_manager, None
            self._settings = None
            self._loop = None
            self._transfers = None
            try:
                if manager is not None:
                    await manager.close()
            finally:
                nixl, self._nixl = self._nixl, None
                if nixl is not None:  # after the caches: their NIXL registrations went with them
                    nixl.close()
                await release_shared_executor()
        log.debug("cluster %d finalized", self._cluster_id)

    def _links_or_raise(self) -> LinkManager:
        if self._links is None:
            raise LLMNotInitializedError()
        return self._links

    # -- links -----------------------------------------------------------------------------------------------
    def _check_clusters(self, clusters: object, timeout: object) -> tuple[list[LLMClusterInfo], int]:
        check_isinstance("clusters", clusters, (list, tuple))
        assert isinstance(clusters, (list, tuple))
        for cluster in clusters:
            check_isinstance("clusters inner", cluster, LLMClusterInfo)
        timeout_ms = check_int("timeout", timeout, "int32")
        require(timeout_ms > 0, f"timeout must be > 0, but got {timeout_ms}.")
        has_comm_res = self.settings.has_local_comm_res
        for cluster in clusters:
            if cluster.remote_cluster_id is None:
                raise TypeError("remote_cluster_id only support ['int'], but got <class 'NoneType'>.")
            require(len(cluster.remote_ip_info_list) > 0,
                    "remote_ip_info_list is empty. Call append_remote_ip_info with the server's ip and port.")
            require(has_comm_res or len(cluster.local_ip_info_list) > 0,
                    "local_ip_info_list is empty. Call append_local_ip_info to set the local ip info "
                    "(or set LLMConfig.local_comm_res).")
        return list(clusters), timeout_ms

    async def link_clusters(self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
                            timeout: int = 3000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to servers; returns ``(overall, [code per cluster])`` and never raises on link failure.

        Per cluster: ``LLM_SUCCESS``, ``LLM_ALREADY_LINK``, ``LLM_LINK_FAILED`` (unreachable or no answer
        within ``timeout`` ms) or ``LLM_CLUSTER_NUM_EXCEED_LIMIT`` (more than 512 links).
        """
        links = self._links_or_raise()
        check_event_loop(self._loop)
        items, timeout_ms = self._check_clusters(clusters, timeout)
        codes = list(await asyncio.gather(*(links.link_one(c, timeout_ms) for c in items)))
        return _overall(codes), codes

    async def unlink_clusters(self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
                              timeout: int = 3000, force: bool = False) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlink clusters; the peer is told and its transfers on the link fail fast.

        Without ``force`` the peer must acknowledge within ``timeout`` ms (else
        ``LLM_NOTIFY_PROMPT_UNLINK_FAILED``, the local end is torn down anyway); unknown clusters give
        ``LLM_UNLINK_FAILED``.  With ``force`` only the local end is torn down without waiting.
        """
        links = self._links_or_raise()
        check_event_loop(self._loop)
        check_bool("force", force)
        check_isinstance("clusters", clusters, (list, tuple))
        for cluster in clusters:
            check_isinstance("clusters inner", cluster, LLMClusterInfo)
            if cluster.remote_cluster_id is None:
                raise TypeError("remote_cluster_id only support ['int'], but got <class 'NoneType'>.")
        timeout_ms = check_int("timeout", timeout, "int32")
        require(timeout_ms > 0, f"timeout must be > 0, but got {timeout_ms}.")
        codes = list(await asyncio.gather(
            *(links.unlink_one(c.remote_cluster_id or 0, timeout_ms, force) for c in clusters)))
        return _overall(codes), codes

    async def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        """Change the role label; ``llm.listenIpInfo`` in ``switch_options`` (re)starts listening there,
        its absence stops a server listening.  Raises ``LLM_EXIST_LINK`` while links exist."""
        links = self._links_or_raise()
        check_event_loop(self._loop)
        check_isinstance("role", role, LLMRole)
        check_isinstance("switch_options", switch_options, dict, allow_none=True)
        options = switch_options or {}
        for key, value in options.items():
            check_isinstance("switch_options key", key, str)
            check_isinstance("switch_options value", value, str)
        listen = options.get(OptionKey.LISTEN_IP_INFO)
        address = parse_listen_ip_info(listen) if listen else None
        if links.links:
            raise LLMException(f"cluster {self._cluster_id} still has {len(links.links)} link(s); unlink them "
                               "before switch_role", status_code=LLMStatusCode.LLM_EXIST_LINK)
        if address is not None:
            await links.listen(*address)
        else:
            await links.stop_listening()
        self._role = role
        links.role = role

    async def check_link_status(self, remote_cluster_id: int) -> None:
        """Raise unless this instance is linked to ``remote_cluster_id`` (``LLM_NOT_YET_LINK``) and the peer answers
        a ping within ``sync_kv_timeout`` (``LLM_LINK_FAILED``); the reference's V1 check, available here in both
        modes."""
        links = self._links_or_raise()
        check_event_loop(self._loop)
        remote = check_int("remote_cluster_id", remote_cluster_id, "uint64")
        assert self._settings is not None
        await links.check(remote, self._settings.sync_kv_timeout_ms / 1000)

    # -- two-sided links -------------------------------------------------------------------------------------
    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """Start a two-sided link among the clusters of ``cluster_rank_info`` (this one included), every member
        calling ``link`` with the same arguments; returns its ``comm_id`` at once.  Poll
        :meth:`query_register_mem_status` until ``OK`` (``FAILED``: give up).  Each member links to the members
        of lower rank, which must listen where ``rank_table`` says (see docs/api.md).  Call it on the instance's
        event loop."""
        domains = self._domains_or_raise()
        ranks = check_comm_args(comm_name, cluster_rank_info, rank_table, self._cluster_id)
        listening = self.listen_address
        return domains.start(members_of(rank_table, ranks, listening[1] if listening is not None else None))

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """``PREPARING`` while the link of ``comm_id`` comes up, then ``OK`` or ``FAILED``."""
        return self._domains_or_raise().status(comm_id)

    async def unlink(self, comm_id: int) -> None:
        """Stop bringing up ``comm_id`` and unlink its members (each is told); the ``comm_id`` is forgotten."""
        await self._domains_or_raise().unlink(comm_id)

    def _domains_or_raise(self) -> CommDomains:
        if self._domains is None:
            raise LLMNotInitializedError()
        check_event_loop(self._loop)
        return self._domains

    async def _link_member(self, member: Member) -> LLMStatusCode:
        info = LLMClusterInfo()
        info.remote_cluster_id = member.cluster_id
        info.append_local_ip_info(member.ip, 0)
        info.append_remote_ip_info(member.ip, member.port or 0)
        _, codes = await self.link_clusters([info], timeout=ATTEMPT_MS)
        return codes[0]

    async def _unlink_members(self, clusters: Collection[int]) -> None:
        links = self._links_or_raise()
        await asyncio.gather(*(links.unlink_one(c, ATTEMPT_MS, True) for c in clusters if c in links.links))

    def links(self) -> list[dict[str, object]]:
        """The current links: remote cluster, side, endpoint, data plane and what this side can do."""
        return self._links_or_raise().describe()

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(ip, port)`` this instance listens on, with the port actually bound (``llm.listenIpInfo`` with port 0
        picks a free one; read it here and give it to the clients), also after :meth:`switch_role` listens
        again; None when it is not a server.  Requires ``init``."""
        return self._links_or_raise().listen_address

    # -- notifications ---------------------------------------------------------------------------------------
    async def notify(self, cluster_id: int, message: bytes) -> None:
        """Send a notification to linked cluster ``cluster_id``; returns once the peer queued it (or dropped it:
        its queue was full).  ``message``: ``bytes``, at most 4 KiB (``TypeError``/``ValueError`` otherwise, before
        anything is sent).  Raises ``LLM_NOT_YET_LINK`` when not linked, ``LLMTimeoutError`` after
        ``sync_kv_timeout``, ``LLMLinkError`` when the link breaks meanwhile."""
        transfers = self._transfers
        if transfers is None:
            raise LLMNotInitializedError()
        check_event_loop(self._loop)
        remote = check_int("cluster_id", cluster_id, "uint64")
        note = check_notification("message", message, allow_none=False)
        assert note is not None
        await transfers.notify(remote, note)

    def notifications(self) -> AsyncIterator[Notification]:
        """The notifications linked peers send this instance (with their successful transfers, or by
        :meth:`notify`), as ``Notification(cluster_id, message)``, in arrival order (per link, the order the peer
        sent them); ``finalize`` ends the iterator after what was queued.  Several consumers share one queue of
        at most 1024 notifications: what arrives while it is full is dropped (see :meth:`stats`).  Requires
        ``init``."""
        inbox = self._inbox
        if inbox is None:
            raise LLMNotInitializedError()
        return self._iterate(inbox)

    async def _iterate(self, inbox: NotificationInbox) -> AsyncIterator[Notification]:
        check_event_loop(self._loop)
        async for notification in inbox.iterate():
            yield notification

    async def get_notification(self, timeout: float | None = None) -> Notification | None:
        """The next notification (as :meth:`notifications` gives them), waiting at most ``timeout`` seconds (None:
        for ever); None if none arrived in time or the instance was finalized meanwhile.  Requires ``init``."""
        inbox = self._inbox
        if inbox is None:
            raise LLMNotInitializedError()
        check_event_loop(self._loop)
        if timeout is not None:
            check_isinstance("timeout", timeout, (int, float))
            require(timeout >= 0, f"timeout must be >= 0, but got {timeout}.")
        try:
            async with asyncio.timeout(timeout):
                return await inbox.get()
        except TimeoutError:
            return None

    def stats(self) -> StatsSnapshot:
        """Transfer statistics per remote cluster and direction, as an immutable snapshot (see
        :class:`~aiodatadist.stats.StatsSnapshot`); they survive unlinking and ``finalize``."""
        transfers = self._transfers
        return self._stats.snapshot(transfers.one_sided_served() if transfers is not None else None,
                                    staging.budget_stats() if self._stats.staged else None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.finalize()

    def __repr__(self) -> str:
        state = "initialized" if self.is_initialized else "not initialized"
        return f"LLMDataDist(role={self._role}, cluster_id={self._cluster_id}, {state})"



def _overall(codes: list[LLMStatusCode]) -> LLMStatusCode:
    """SUCCESS only if every cluster succeeded, else the first failure."""
    return next((c for c in codes if c != LLMStatusCode.LLM_SUCCESS), LLMStatusCode.LLM_SUCCESS)
