"""The fd socket: the segments of remote-accessible caches, handed to same-host peers under another user.

Each link's peer is given a grant (a random token) over the link; the socket hands a segment's memfd only to a
peer that presents the grant of a live link, and only for a cache this instance publishes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..transport.fd_passing import FdServer
from ..transport.same_host import HostProbe, allowed_mechanisms
from .link import Link

__all__ = ["FdSocket"]

log = logging.getLogger("aiodatadist.link")

SharedFd = Callable[[int, int], "int | None"]
"""``(inode, device)`` -> the memfd of a remote-accessible cache's segment, or None."""


class FdSocket:
    """This instance's fd socket (none where the mechanism is not allowed or cannot be set up: the grants are
    still kept) and the grants of its links.  Started at once; its name is announced in ``probe``."""

    def __init__(self, probe: HostProbe, shared_fd: SharedFd) -> None:
        self._shared_fd = shared_fd
        self._grants: dict[bytes, Link] = {}  # fd socket tokens given to peers over their admitted link
        self._server = self._start(probe)

    def _start(self, probe: HostProbe) -> FdServer | None:
        if "fds" not in allowed_mechanisms():
            return None
        probe_fd = probe.segment.fd
        try:
            assert probe_fd is not None
            server = FdServer(probe_fd, self._segment_fd)
        except OSError as exc:  # e.g. no abstract Unix sockets here
            log.debug("no fd socket: %s", exc)
            return None
        server.start()
        probe.fds = server.name
        return server

    def _segment_fd(self, token: bytes, inode: int, device: int) -> int | None:
        """The memfd of a remote-accessible cache's segment ``(inode, device)``, for the peer that holds
        ``token`` (a live link's grant); None for anyone else or any other memory."""
        link = self._grants.get(token)
        if link is None or link.closed:
            return None
        return self._shared_fd(inode, device)

    def grant(self, link: Link, grant: bytes) -> None:
        """``link``'s peer may fetch segments with ``grant`` (sent to it over the link) while the link lives."""
        link.fd_grant = grant
        self._grants[grant] = link

    def revoke(self, link: Link) -> None:
        """``link`` dropped: its grant opens nothing any more."""
        if link.fd_grant is not None:
            self._grants.pop(link.fd_grant, None)

    def close(self) -> None:
        """Stop serving (at finalize)."""
        if self._server is not None:
            self._server.close()
