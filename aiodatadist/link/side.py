"""What both sides of the handshake work with: :class:`LinkSide`, the base of the server side
(:class:`~.accept.Acceptor`) and the client side (:class:`~.dial.Dialer`)."""

from __future__ import annotations

from ..control.channel import TaskSet
from ..control.sockets import Context
from ..settings.options import Settings
from .fd_socket import FdSocket
from .local_end import LocalEnd
from .plane_setup import PlaneSetup
from .table import LinkTable

__all__ = ["LinkSide"]


class LinkSide:
    """The parts one side of the handshake shares with the other: what this end announces, the settings, the key
    derived from ``llm.AuthKey`` (or None), the instance's ZeroMQ context and background tasks, the link table,
    how a link's plane is set up, and the fd socket."""

    def __init__(self, local: LocalEnd, settings: Settings, auth_key: bytes | None, ctx: Context, tasks: TaskSet,
                 table: LinkTable, planes: PlaneSetup, fds: FdSocket) -> None:
        self._local = local
        self._settings = settings
        self._auth_key = auth_key
        self._ctx = ctx
        self._tasks = tasks
        self._table = table
        self._planes = planes
        self._fds = fds
