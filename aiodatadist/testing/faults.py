"""Faults for a :class:`~aiodatadist.testing.PromptServer`: its process (kill, SIGSTOP/SIGCONT, restart), its
control connection (stalled or cut by a proxy) and its TCP data connections (shut down).

A decoder sees control-connection faults only when it linked through the proxy: link to
``faults.cluster_info()`` (or ``faults.address``) instead of the server's own address.  The proxy follows the
server when :meth:`FaultInjector.restart` (or ``server.restart``) moves it to another port.
``await faults.taken_effect(decoder)`` returns once a decoder has dropped its link to the server (it noticed the
fault), instead of sleeping.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from ..types import LLMClusterInfo
from ._opening import Opening
from .netcut import cut_data_connections
from .peer import Exit, Stopped
from .prompt_server import PromptAddress, PromptServer
from .proxy_thread import ThreadedFaultProxy
from .waiting import DEFAULT_TIMEOUT_S, wait_unlinked

if TYPE_CHECKING:
    from ..datadist import LLMDataDist
    from ..errors import LinkDropReason

__all__ = ["FaultInjector"]


class FaultInjector:
    """Faults for ``server``; ``await FaultInjector.start(server)`` (or ``async with``) puts the proxy in front
    of it.  Every method may be called from any event loop; the proxy runs on a thread of its own."""

    def __init__(self, server: PromptServer) -> None:
        """Use :meth:`start`."""
        self.server = server
        self._proxy = ThreadedFaultProxy(server.port)
        server.restarted.append(self._follow)

    @classmethod
    def start(cls, server: PromptServer) -> Opening[FaultInjector]:
        """A fault injector for ``server``, its proxy listening (await it, or ``async with`` it)."""

        async def open_() -> FaultInjector:
            return cls(server)

        return Opening(open_)

    def _follow(self, server: PromptServer) -> None:
        self._proxy.target_port = server.port

    # -- where to link ---------------------------------------------------------------------------------------
    @property
    def address(self) -> PromptAddress:
        """The server's address through the proxy: ``(127.0.0.1, proxy port, cluster id)``."""
        return PromptAddress("127.0.0.1", self._proxy.port, self.server.cluster_id)

    def cluster_info(self) -> LLMClusterInfo:
        """The ``LLMClusterInfo`` to link to the server through the proxy."""
        return self.address.cluster_info()

    # -- the control connection ------------------------------------------------------------------------------
    def stall_control(self) -> None:
        """Hold every byte of the proxied control connections, both ways (they stay open) until
        :meth:`pass_control`; new connections are held too."""
        self._proxy.set("stall")

    def cut_control(self) -> None:
        """Reset every proxied control connection and refuse new ones until :meth:`pass_control`."""
        self._proxy.set("cut")

    def pass_control(self) -> None:
        """Forward again (bytes held by a stall are delivered now)."""
        self._proxy.set("pass")

    @property
    def control_mode(self) -> str:
        """``pass``, ``stall`` or ``cut``."""
        return self._proxy.mode

    # -- the data connections --------------------------------------------------------------------------------
    def cut_data(self) -> int:
        """Shut down this process's TCP data connections to the server (links over the ``tcp`` plane have
        them; same-host links have none); returns how many were cut."""
        return cut_data_connections(self.server.pid, self.server.port)

    # -- the process -----------------------------------------------------------------------------------------
    def kill(self) -> Exit:
        """SIGKILL the server's process (``await`` it to wait for the exit)."""
        return self.server.kill()

    def stop(self) -> Stopped:
        """SIGSTOP the server's process until :meth:`cont` (``await`` it to wait until it has stopped)."""
        return self.server.stop()

    def cont(self) -> None:
        """SIGCONT the server's process."""
        self.server.cont()

    @contextlib.asynccontextmanager
    async def stopped(self) -> AsyncIterator[None]:
        """SIGSTOP the server for the ``async with`` block (it has stopped when the block starts), SIGCONT after
        it (also on error)."""
        try:
            await self.stop()
            yield
        finally:
            self.cont()

    async def restart(self, *, port: int | None = None) -> None:
        """``server.restart(port=port)``; the proxy forwards to the new process."""
        await self.server.restart(port=port)

    # -- its effect ------------------------------------------------------------------------------------------
    async def taken_effect(self, decoder: LLMDataDist, timeout: float = DEFAULT_TIMEOUT_S) -> LinkDropReason | None:
        """Return once ``decoder`` has no link to the server any more: it noticed the fault (a kill or a cut at
        once; a stop or a stall once its heartbeats ran out, about 6 s).  Returns the drop's reason
        (:class:`~aiodatadist.errors.LinkDropReason`, what the decoder's later calls to the server raise), or
        None when the decoder does not know it.  ``TimeoutError`` after ``timeout`` seconds; call it on the
        decoder's event loop (:func:`~aiodatadist.testing.wait_unlinked` for the server's cluster)."""
        return await wait_unlinked(decoder, self.server.cluster_id, timeout)

    async def close(self) -> None:
        """Stop the proxy (its connections are cut); the server stays as it is.  Idempotent."""
        with contextlib.suppress(ValueError):
            self.server.restarted.remove(self._follow)
        self._proxy.close()

    def __repr__(self) -> str:
        return f"FaultInjector({self.server!r}, proxy port {self._proxy.port}, {self._proxy.mode})"

