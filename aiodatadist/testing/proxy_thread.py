"""A :class:`~aiodatadist.testing.fault_proxy.FaultProxy` on an event loop of its own thread.

The proxy then forwards whatever the test's loop does (blocked, or another loop than the one that started it),
and its methods may be called from any thread or loop.  :class:`ThreadedFaultProxy` is what
:class:`~aiodatadist.testing.FaultInjector` puts in front of a prompt's control port.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from .fault_proxy import FaultProxy

__all__ = ["ThreadedFaultProxy"]

T = TypeVar("T")
_COMMAND_TIMEOUT_S = 10.0


class ThreadedFaultProxy:
    """A fault proxy from ``127.0.0.1:port`` to ``127.0.0.1:target_port`` on its own thread; see
    :class:`FaultProxy` for the modes.  Created listening; :meth:`close` stops it and joins the thread."""

    def __init__(self, target_port: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._proxy = FaultProxy(target_port)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aiodatadist-fault-proxy")
        self._thread.start()
        self._run_here(self._proxy.start())
        self.port = self._proxy.port
        """The port to connect to (instead of ``target_port``)."""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def _run_here(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_COMMAND_TIMEOUT_S)

    @property
    def mode(self) -> str:
        return self._proxy.mode

    def set(self, mode: str) -> None:
        """``pass``, ``stall`` or ``cut``; in effect when this returns."""
        if mode not in ("pass", "stall", "cut"):
            raise ValueError(f"mode must be 'pass', 'stall' or 'cut', not {mode!r}")

        async def apply() -> None:
            self._proxy.set(mode)

        self._run_here(apply())

    @property
    def target_port(self) -> int:
        return self._proxy.target_port

    @target_port.setter
    def target_port(self, port: int) -> None:
        """Later connections go to ``port`` (a server restarted elsewhere)."""
        self._proxy.target_port = port  # read by the proxy's thread at each new connection

    def close(self) -> None:
        """Cut every connection, stop listening and join the thread.  Idempotent."""
        if not self._thread.is_alive():
            return
        try:
            self._run_here(self._proxy.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_COMMAND_TIMEOUT_S)
