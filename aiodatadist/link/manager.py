"""The links of one instance, composed: the server side (:mod:`.accept`), the client side (:mod:`.dial`) and the
link table they share (:mod:`.table`), on one ZeroMQ context and one set of background tasks that
:class:`LinkManager` owns from construction to :meth:`LinkManager.close`."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

from .._aio import in_thread
from ..control.channel import TaskSet
from ..control.sockets import LINGER_MS, Context, abandon_context, new_context
from ..errors import LLMException, LLMStatusCode
from ..protocol import auth
from ..protocol.handshake import MAX_LINKS
from ..protocol.messages import Request
from ..settings.options import Settings
from ..stats import MessageCounter
from ..transport.same_host import HostProbe
from ..types import LLMClusterInfo, LLMRole
from .accept import Acceptor
from .dial import Dialer
from .fd_socket import FdSocket
from .link import Link
from .local_end import LocalEnd, Publications
from .plane_setup import PlaneSetup
from .planes import PlaneFactory
from .table import ClosedHook, LinkTable, RequestHook

__all__ = ["MAX_LINKS", "ClosedHook", "LinkManager", "Publications", "RequestHook"]

log = logging.getLogger("aiodatadist.link")


def _abandoned(ctx: Context, cluster_id: int) -> None:
    """A link manager was garbage-collected without :meth:`LinkManager.close` (its instance was never finalized,
    e.g. its event loop ended first): like an unclosed file, warn and free what it held, never blocking."""
    try:
        log.warning("cluster %d was not finalized: its sockets are closed without notifying its peers "
                    "(call LLMDataDist.finalize() or use 'async with')", cluster_id)
    except Exception:  # noqa: BLE001, S110 - logging may be gone at interpreter shutdown
        pass
    abandon_context(ctx)


class LinkManager:
    """The links of one :class:`LLMDataDist`, its server socket and its control-plane tasks.

    ``publications``: what the instance announces to its peers; ``planes``: builds its links' data planes;
    ``start_nixl``: starts its NIXL plane (raises ``LLMException``) for a link that chose it."""

    def __init__(self, cluster_id: int, role: LLMRole, settings: Settings, publications: Publications,
                 planes: PlaneFactory, start_nixl: Callable[[], object] | None = None,
                 messages: Callable[[int], MessageCounter] | None = None) -> None:
        self._ctx = new_context()
        # Dropped without close() (the instance never finalized): free the sockets and context without blocking.
        self._abandoned = weakref.finalize(self, _abandoned, self._ctx, cluster_id)
        self._abandoned.atexit = False  # at exit pyzmq leaves contexts alone; a live loop may still use them
        self._tasks = TaskSet()
        self._probe = HostProbe()
        self._local = LocalEnd(cluster_id, role, settings.transport, self._probe, publications, planes.native_net)
        self._fd_socket = FdSocket(self._probe, publications.shared_fd)
        key = settings.auth_key
        auth_key = auth.derive_key(key) if key is not None else None
        self._table = LinkTable(cluster_id, self._tasks, self._release, messages or (lambda _: MessageCounter()))
        plane_setup = PlaneSetup(settings.transport, planes, start_nixl, self._table, self._tasks)
        # (both sides of the handshake work with the same parts)
        sides = (self._local, settings, auth_key, self._ctx, self._tasks, self._table, plane_setup, self._fd_socket)
        self._accept = Acceptor(*sides)
        self._dial = Dialer(*sides)

    def _release(self, link: Link) -> None:
        """A link is being torn down: what its side handed out for it opens nothing any more."""
        self._accept.release(link)
        self._fd_socket.revoke(link)

    # -- what the instance and the transfer layer use ----------------------------------------------------------
    @property
    def role(self) -> LLMRole:
        """The role this instance announces in its handshakes (``switch_role`` sets it)."""
        return self._local.role

    @role.setter
    def role(self, role: LLMRole) -> None:
        self._local.role = role

    @property
    def links(self) -> dict[int, Link]:
        """The links, by remote cluster id."""
        return self._table.links

    @property
    def on_request(self) -> RequestHook | None:
        """Serves a peer's transfer request (set once by the transfer layer)."""
        return self._table.on_request

    @on_request.setter
    def on_request(self, hook: RequestHook | None) -> None:
        self._table.on_request = hook

    @property
    def on_link_closed(self) -> ClosedHook | None:
        """Told when a link is torn down (set once by the transfer layer)."""
        return self._table.on_link_closed

    @on_link_closed.setter
    def on_link_closed(self, hook: ClosedHook | None) -> None:
        self._table.on_link_closed = hook

    @property
    def listening(self) -> str | None:
        """The bound endpoint (``tcp://ip:port``, the real port when asked for port 0), or None."""
        return self._accept.listening

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(ip, port)`` of the bound server socket (the real port when asked for port 0), or None."""
        return self._accept.listen_address

    async def listen(self, ip: str, port: int) -> None:
        """Listen on ``ip:port`` (replacing the current address; the same address is kept as it is)."""
        await self._accept.listen(ip, port)

    async def stop_listening(self) -> None:
        """Stop serving (the links it admitted stay)."""
        await self._accept.stop_listening()

    async def link_one(self, cluster: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        """Link to ``cluster``: see :meth:`.dial.Dialer.link_one`."""
        return await self._dial.link_one(cluster, timeout_ms)

    async def unlink_one(self, remote_id: int, timeout_ms: int, force: bool) -> LLMStatusCode:
        """Unlink ``remote_id``: see :meth:`.table.LinkTable.unlink_one`."""
        return await self._table.unlink_one(remote_id, timeout_ms, force)

    async def not_linked(self, remote_id: int) -> NoReturn:
        """Raise the error of a call to ``remote_id``, which is not linked: see :meth:`.table.LinkTable.not_linked`.
        Use: ``links.get(c) or await not_linked(c)``."""
        await self._table.not_linked(remote_id)

    async def check(self, remote_id: int, timeout: float) -> None:
        """Raise unless linked to ``remote_id`` (``LLM_NOT_YET_LINK``) and its peer answers a ping within
        ``timeout`` seconds (``LLM_LINK_FAILED``)."""
        await self._table.check(remote_id, timeout)

    async def drop(self, link: Link, error: LLMException) -> None:
        """Tear a link down locally: fail its requests, stop its copies, release its leases."""
        await self._table.drop(link, error)

    def describe(self) -> list[dict[str, Any]]:
        """What ``LLMDataDist.links()`` shows."""
        return self._table.describe()

    def spawn(self, coro: Any, name: str) -> None:
        """Run a background task owned by this instance (cancelled by ``close``)."""
        self._tasks.spawn(coro, name=name)

    @staticmethod
    def notify(link: Link, msg: Request) -> None:
        """Queue a message that needs no answer (sent with the channel's next frame)."""
        link.channel.notify(msg)

    # -- lifetime ----------------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Unlink everything (peers are told), stop listening and free the sockets and context."""
        await self._table.close_all()
        await self._accept.stop_listening()
        try:
            await self._tasks.close()  # raises the background failures nobody handled, once every task ended
        finally:
            # term() waits for every socket of the context to be closed: close any that a torn-down link or
            # watcher left open (closing twice is harmless), here on the loop thread that owns them.
            for sock in list(getattr(self._ctx, "_sockets", ())):
                if not sock.closed:
                    log.debug("closing a socket left open at finalize: %r", sock)
                    sock.close(linger=LINGER_MS)
            # Closed sockets linger briefly so that the BYEs reach the peers; term() waits for that, off the loop.
            await in_thread(self._ctx.term)
            self._abandoned.detach()
            self._fd_socket.close()
            self._probe.close()
