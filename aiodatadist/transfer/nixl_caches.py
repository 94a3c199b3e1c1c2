"""An instance's caches on its NIXL plane (:mod:`aiodatadist.transport.nixl`): started on first need
(``llm.Transport=nixl`` at ``init``, or a link choosing the nixl plane), then every cache is registered with the
agent as it is created, and deregistered when its memory goes."""

from __future__ import annotations

import logging

from ..errors import LLMException
from ..layout.plans import CopyPlan
from ..registry.caches import CacheEntry, CacheRegistry
from ..transport.nixl import NixlJob, NixlPlane, Registration, RemoteCache

__all__ = ["NixlCaches"]

log = logging.getLogger("aiodatadist.nixl")


class NixlCaches:
    """The NIXL plane of one instance and its caches' registrations."""

    def __init__(self, name: str, device_id: int, registry: CacheRegistry) -> None:
        self._name = name
        self._device_id = device_id
        self._registry = registry
        self._plane: NixlPlane | None = None

    @property
    def plane(self) -> NixlPlane | None:
        """The plane, if started."""
        return self._plane

    def start(self) -> NixlPlane:
        """Start the plane (once) and register every cache; raises ``LLM_FEATURE_NOT_ENABLED`` without NIXL."""
        if self._plane is None:
            self._plane = NixlPlane(self._name, self._device_id)
            for entry in self._registry.entries():
                self._register_new(entry)
            self._registry.on_added = self._register_new
        return self._plane

    def _register_new(self, entry: CacheEntry) -> None:
        # A cache being created: a failure is logged, and a NIXL transfer of it tries again and says why.
        try:
            self.registration(entry)
        except LLMException as exc:
            log.warning("cache %d is not registered with NIXL: %s", entry.cache_id, exc)

    def registration(self, entry: CacheEntry) -> Registration:
        """``entry`` registered with the agent (now, if it was not yet); undone when its memory goes."""
        plane = self.start()
        registration = entry.nixl
        if isinstance(registration, Registration):
            return registration
        geometry = entry.geometry
        registration = plane.register(entry.addrs, entry.desc.size, entry.on_device, geometry.stride, geometry.slots)
        entry.nixl = registration

        def deregister() -> None:
            entry.nixl = None
            plane.deregister(registration)

        entry.on_free.append(deregister)
        return registration

    def reach(self, entry: CacheEntry) -> tuple[bytes, str, int]:
        """What a peer needs to reach ``entry`` (see :meth:`NixlPlane.reach`)."""
        return self.start().reach(self.registration(entry))

    def transfer(self, plan: CopyPlan, local: CacheEntry, remote: RemoteCache, pull: bool) -> NixlJob:
        """Start a READ (``pull``) or WRITE of ``plan`` between ``local`` and a peer's cache."""
        return self.start().start(plan, self.registration(local), remote, pull)

    def close(self) -> None:
        if self._plane is not None:
            self._plane.close()
