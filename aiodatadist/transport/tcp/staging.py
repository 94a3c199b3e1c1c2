"""Whether and how an instance's TCP links move device caches: staged through page-locked rings
(:mod:`aiodatadist.copy.staging`), or refused (``llm.DeviceStaging=0``: fail closed, for deployments that want
RDMA or nothing)."""

from __future__ import annotations

from collections.abc import Callable

from ...copy.device_runtime import DeviceRuntime
from ...copy.staging import SLOTS_PER_CONNECTION, StagingRing, budget
from ...errors import LLMException, LLMStatusCode
from .native_connections import NativeConnections
from .python_connections import PythonConnections

__all__ = ["DeviceStaging"]

S = LLMStatusCode


class DeviceStaging:
    """An instance's policy for device caches on TCP links, and its device (``runtime``: opened on first use)."""

    def __init__(self, allowed: bool, runtime: Callable[[], DeviceRuntime],
                 on_ring: Callable[[], None] = lambda: None) -> None:
        self.allowed = allowed
        self._runtime = runtime
        self._on_ring = on_ring  # a link got a ring (the instance's stats report the budget from then on)

    def path(self, conns: NativeConnections | PythonConnections) -> str:
        """How a link on ``conns`` moves device caches: ``"device-staged"``, or ``"refused"``."""
        return "device-staged" if self.allowed and isinstance(conns, NativeConnections) else "refused"

    def refusal(self, conns: NativeConnections | PythonConnections, what: str) -> LLMException | None:
        """Why ``what`` (a device cache) cannot move on this link, or None."""
        if not self.allowed:
            return LLMException(f"{what} is a device cache and this link uses TCP: staging through page-locked "
                                "host memory is refused (llm.DeviceStaging=0)", status_code=S.LLM_FEATURE_NOT_ENABLED)
        if not isinstance(conns, NativeConnections):
            return LLMException(f"{what} is a device cache and this link uses TCP on Python threads "
                                "(llm.Net=python or the native helper is not built): staging needs the native I/O "
                                "threads", status_code=S.LLM_FEATURE_NOT_ENABLED)
        return None

    def prepare(self, conns: NativeConnections, receiving: bool) -> None:
        """The link's staging ring of that direction, allocated at its first device transfer (raises
        ``LLM_FEATURE_NOT_ENABLED`` without a usable device runtime)."""
        if conns.staged(receiving):
            return
        runtime = self._runtime()
        rings = budget()
        ring: StagingRing = rings.ring(runtime, SLOTS_PER_CONNECTION * max(1, conns.connections), receiving)
        try:
            conns.stage(receiving, ring, rings.give_back)
        except BaseException:  # the link closed meanwhile
            rings.give_back(ring)
            raise
        self._on_ring()
