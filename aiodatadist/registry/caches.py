"""Cache registry of one instance: ids, key indexes, lifetimes and leases.

Lifetime rules: an allocated cache is referenced by its id and by each bound ``CacheKey``; its memory is freed
once it was deallocated, every key was released, and no transfer holds a lease on it.  A released cache vanishes
from lookups at once.  Caller-owned (registered) memory cannot wait for leases, so releasing it aborts the
transfers that use it, bounded by one copy chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from .._checks import I64_MAX, require
from ..copy.device import device_identity
from ..errors import LLMException, LLMStatusCode
from ..layout.plans import CacheGeometry
from ..memory import HostMemory, SharedSegment
from ..memory.in_place import InPlaceSegment
from ..protocol.identity import SegmentIdentity
from ..types import BlocksCacheKey, CacheDesc, CacheKey, Placement
from .publication import CacheDirectory

if TYPE_CHECKING:
    from ..copy.python_pool import CopyJob

__all__ = ["MAX_REGISTERED_ADDRS", "CacheEntry", "CacheRegistry", "geometry_of"]

MAX_REGISTERED_ADDRS = 4096
"""Registered (caller-owned) tensor addresses per instance; allocated caches do not count.  The reference caps
them at 240, which stops models with separate K and V tensors beyond 120 layers; nothing here grows with the
count but a Python list per cache, so the cap is only a bound against runaway registration."""
IndexKey = tuple[str, int, int]


class DeviceMemory(Protocol):
    """An allocated DEVICE cache's memory (``copy.device.DeviceMemory``): freed once nothing uses it."""

    def close(self) -> None: ...


class Handle(Protocol):
    """What the registry needs of a user's handle: to make it invalid once its cache is released."""

    def _invalidate(self) -> None: ...


def geometry_of(desc: CacheDesc, is_blocks: bool) -> CacheGeometry:
    return CacheGeometry(desc.num_tensors, desc.size, int(desc.shape[0]), is_blocks, desc.data_type.value)


@dataclass(eq=False)
class CacheEntry:
    """Everything the manager knows about one cache."""

    cache_id: int
    desc: CacheDesc
    addrs: npt.NDArray[np.uint64]
    is_blocks: bool
    remote_accessible: bool
    segment: SharedSegment | None = None
    handle: Handle | None = None  # the user's Cache, set by the manager
    keys: set[IndexKey] = field(default_factory=set)
    released: bool = False
    leases: int = 0
    jobs: set[CopyJob] = field(default_factory=set)
    published: tuple[int, int] | None = None  # (row, stamp) in the cache directory
    device_memory: DeviceMemory | None = None  # an allocated DEVICE cache's memory
    device_addrs: npt.NDArray[np.uint64] | None = None  # host memory page-locked for GPU copies: its device view
    on_free: list[Callable[[], None]] = field(default_factory=list)  # run before the memory goes (unpin, ...)
    exported: set[bytes] = field(default_factory=set)  # CUDA IPC handles of its allocations given to peers
    freed: bool = False
    host_memory: HostMemory | None = None  # registered memory inside a HostMemory: mapped by same-host peers
    nixl: Any = None  # its registration with this instance's NIXL agent (aiodatadist.transport.nixl), if any
    on_idle: list[Callable[[], None]] = field(default_factory=list)  # told once, when its last lease ends
    tcp_readable: bool = False  # its directory row names its memory: one-sided TCP transfers may reach it

    @property
    def shared_segment(self) -> SharedSegment | InPlaceSegment | None:
        """The segment same-host peers map to reach this cache: its own (allocated) or its HostMemory's."""
        if self.segment is not None:
            return self.segment
        memory = self.host_memory
        return memory.segment if memory is not None and not memory.closed else None

    @property
    def shared_window(self) -> tuple[int, int] | None:
        """The bytes ``[low, high)`` of each tensor that :attr:`shared_segment` holds (None: all of them)."""
        memory = self.host_memory
        return memory.window(self.addrs, self.desc.size) if memory is not None and self.segment is None else None

    @functools.cached_property
    def geometry(self) -> CacheGeometry:
        return geometry_of(self.desc, self.is_blocks)  # (made once: a cache's layout never changes)

    @property
    def owned(self) -> bool:
        """True when aiodatadist allocated the memory (False for caller-registered memory)."""
        return self.segment is not None or self.device_memory is not None

    @property
    def on_device(self) -> bool:
        return self.desc.placement == Placement.DEVICE




def _apart(starts: npt.NDArray[np.uint64], size: int) -> bool:
    """Whether tensors of ``size`` bytes at ascending ``starts`` do not overlap (a table row's condition)."""
    return size > 0 and bool((np.diff(starts) >= np.uint64(size)).all())


def not_exist(message: str) -> LLMException:
    return LLMException(message, status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)


class CacheRegistry:
    """Indexes: by id (from 1), by ``CacheKey`` (req/prefix id + model id) and blocks caches by ``model_id``."""

    def __init__(self, directory: CacheDirectory | None = None) -> None:
        self.directory = directory
        self.on_freed: Callable[[CacheEntry], None] | None = None  # told once an entry's memory is gone
        self.on_added: Callable[[CacheEntry], None] | None = None  # told of every new entry (before it is used)
        self._next_id = 1
        self._by_id: dict[int, CacheEntry] = {}
        self._by_key: dict[IndexKey, tuple[CacheEntry, int]] = {}
        self._taken: dict[IndexKey, tuple[CacheEntry, int]] = {}  # keys that running pulls by CacheKey consume
        self._by_model: dict[int, CacheEntry] = {}
        self._registered_addrs = 0

    # -- adding ----------------------------------------------------------------------------------------------
    def check_keys(self, keys: list[CacheKey], slots: int) -> list[tuple[IndexKey, int]]:
        """Validate ``CacheKey`` bindings (slot i <- keys[i]) before anything is created."""
        require(len(keys) <= slots, f"{len(keys)} cache_keys exceed the batch size {slots}.")
        bound: dict[IndexKey, int] = {}
        for slot, key in enumerate(keys):
            if key.is_placeholder:
                continue
            index = key.index_key()
            require(index not in self._by_key, f"cache key {key} is already bound to a cache.")
            require(index not in bound, f"cache key {key} appears twice.")
            bound[index] = slot
        return list(bound.items())

    def check_registered_addrs(self, count: int) -> None:
        require(
            self._registered_addrs + count <= MAX_REGISTERED_ADDRS,
            f"registering {count} more addresses exceeds the limit of {MAX_REGISTERED_ADDRS} "
            f"({self._registered_addrs} registered).",
        )

    def add(
        self,
        desc: CacheDesc,
        addrs: list[int],
        *,
        is_blocks: bool,
        remote_accessible: bool,
        segment: SharedSegment | None,
        device_memory: DeviceMemory | None = None,
        keys: list[tuple[IndexKey, int]] = (),  # type: ignore[assignment]
        blocks_key: BlocksCacheKey | None = None,
        host_memory: HostMemory | None = None,
    ) -> CacheEntry:
        cache_id = self._next_id
        self._next_id += 1
        entry = CacheEntry(cache_id, desc, np.asarray(addrs, dtype=np.uint64), is_blocks, remote_accessible, segment,
                           device_memory=device_memory, host_memory=host_memory)
        if host_memory is not None:
            host_memory._registered.add(entry)
        self._by_id[cache_id] = entry
        for index, slot in keys:
            self._by_key[index] = (entry, slot)
            entry.keys.add(index)
        model = -1
        if blocks_key is not None:
            previous = self._by_model.get(blocks_key.model_id)
            if previous is not None and previous.published is not None and self.directory is not None:
                self.directory.set_model(previous.published[0], -1)
            self._by_model[blocks_key.model_id] = entry  # last wins, as in the reference
            model = blocks_key.model_id if blocks_key.model_id <= I64_MAX else -1
        if remote_accessible and self.directory is not None:
            self._publish(entry, model, segment, host_memory)
        if segment is None and device_memory is None:
            self._registered_addrs += len(addrs)
        if self.on_added is not None:
            self.on_added(entry)
        return entry

    def _publish(self, entry: CacheEntry, model: int, segment: SharedSegment | None,
                 host_memory: HostMemory | None) -> None:
        """Publish a remote-accessible cache in the directory, with the memory one-sided TCP transfers may reach:
        an allocated cache's segment; inside a HostMemory, the span of its tensors; other caller memory (in place
        too: the span of its tensors may hold anything else of the process) and device memory (served through a
        link's staging rings), each tensor's own bytes and nothing between them (a table of their starts)."""
        directory = self.directory
        assert directory is not None
        cache_id, size, addrs = entry.cache_id, entry.desc.size, entry.addrs
        if segment is not None:
            entry.published = directory.publish(cache_id, model, segment.address, segment.size)
        elif host_memory is not None and not host_memory.is_in_place:
            low = int(addrs.min())
            entry.published = directory.publish(cache_id, model, low, int(addrs.max()) + size - low)
        elif len(addrs) and _apart(starts := np.sort(addrs), size):
            entry.published = directory.publish(cache_id, model, 0, size, tensors=starts, device=entry.on_device)
        else:  # same-host peers only (process_vm_readv): no byte of it is served over TCP
            entry.published = directory.publish(cache_id, model, 0, 0)
            return
        entry.tcp_readable = entry.published is not None

    # -- lookups ---------------------------------------------------------------------------------------------
    def by_id(self, cache_id: int) -> CacheEntry:
        entry = self._by_id.get(cache_id)
        if entry is None:
            raise not_exist(f"cache {cache_id} does not exist.")
        return entry

    def entry_of(self, handle: Handle, cache_id: int) -> CacheEntry:
        """The live entry behind a handle of this registry (``cache_id`` is the handle's)."""
        entry = self._by_id.get(cache_id)
        if entry is None or entry.handle is not handle:
            raise not_exist(f"cache {cache_id} is not a live cache of this instance.")
        return entry

    def resolve_wire(self, kind: str, a: int, b: int) -> tuple[CacheEntry, int]:
        """Resolve a key sent by a peer: ``("id", cache_id, batch)``, ``("blocks", model_id, _)``,
        ``("req"|"prefix", id, model_id)``."""
        if kind == "id":
            return self.by_id(a), b
        if kind == "blocks":
            entry = self._by_model.get(a)
            if entry is None:
                raise not_exist(f"no blocks cache with model_id {a}.")
            return entry, 0
        if kind in ("req", "prefix"):
            found = self._by_key.get((kind, a, b))
            if found is None:
                raise not_exist(f"no cache bound to {kind}_id {a}, model_id {b}.")
            return found
        raise LLMException(f"unknown key kind {kind!r}", status_code=LLMStatusCode.LLM_PARAM_INVALID)

    def entries(self) -> list[CacheEntry]:
        return list(self._by_id.values())

    # -- what peers are told at link time --------------------------------------------------------------------
    def announced_segments(self) -> tuple[tuple[SegmentIdentity, int], ...]:
        """The shared segments of remote-accessible caches (once each: a HostMemory may hold several caches),
        with their addresses here, announced at link time so that same-host peers map them early."""
        found: dict[SegmentIdentity, int] = {}
        for entry in self._by_id.values():
            shared = entry.shared_segment
            if shared is not None and entry.remote_accessible:
                found.setdefault(shared.identity, shared.address)
        return tuple(found.items())

    def directory_identity(self) -> SegmentIdentity | None:
        """The cache directory's segment, as the handshake announces it to same-host peers."""
        return self.directory.identity if self.directory is not None else None

    def device_identity(self) -> tuple[str, int] | None:
        """This process's device runtime and the PID its IPC imports present, once it opened one."""
        return device_identity()

    def shared_fd(self, inode: int, device: int) -> int | None:
        """The memfd of a remote-accessible cache's segment ``(inode, device)``, or None."""
        for entry in self._by_id.values():
            shared = entry.shared_segment
            if (shared is not None and entry.remote_accessible
                    and (shared.identity.inode, shared.identity.device) == (inode, device)):
                return shared.fd
        return None

    def locate(self, addr: int) -> tuple[CacheEntry, int, int, int]:
        """The remote-accessible cache whose tensor holds ``addr`` at a whole slot (block) from the tensor's base:
        ``(entry, tensor, slot, model)`` (model: the ``model_id`` a blocks cache answers to, -1 if none)."""
        for entry in self._by_id.values():
            if not entry.remote_accessible or entry.released:
                continue
            slot_bytes = entry.desc.size // max(1, entry.desc.shape[0])
            offsets = addr - entry.addrs.astype(np.int64, copy=False)
            hits = np.nonzero((offsets >= 0) & (offsets < entry.desc.size))[0]
            if len(hits) and int(offsets[hits[0]]) % slot_bytes == 0:
                tensor = int(hits[0])
                model = next((m for m, e in self._by_model.items() if e is entry), -1)
                return entry, tensor, int(offsets[tensor]) // slot_bytes, model
        raise not_exist(f"no remote-accessible cache holds address {addr:#x} at a slot boundary.")

    # -- releasing -------------------------------------------------------------------------------------------
    def release(self, entry: CacheEntry) -> list[CopyJob]:
        """Remove the id (and, for registered memory, every key); returns jobs that must be aborted."""
        if self._by_id.get(entry.cache_id) is entry:
            del self._by_id[entry.cache_id]
        for model, cached in list(self._by_model.items()):
            if cached is entry:
                del self._by_model[model]
        if entry.handle is not None:
            entry.handle._invalidate()
        if entry.published is not None and self.directory is not None:
            self.directory.withdraw(entry.published[0])
            entry.published = None
        if not entry.owned:
            for index in list(entry.keys):
                for table in (self._by_key, self._taken):  # (a taken key may be bound anew to another cache)
                    if index in table and table[index][0] is entry:
                        del table[index]
            entry.keys.clear()
            self._registered_addrs -= len(entry.addrs)
            entry.released = True
            return list(entry.jobs)
        entry.released = True
        self._maybe_free(entry)
        return []

    def remove_key(self, key: CacheKey) -> None:
        index = key.index_key()
        for found in (self._by_key.pop(index, None), self._taken.pop(index, None)):
            if found is not None:
                found[0].keys.discard(index)
                self._maybe_free(found[0])

    def is_taken(self, index: IndexKey) -> bool:
        """Whether a running pull by ``CacheKey`` has taken the key (:meth:`take_key`)."""
        return index in self._taken

    def take_key(self, index: IndexKey) -> None:
        """A pull by ``CacheKey`` begins: the key stops resolving at once, so it is gone by the time the pull
        returns; its cache keeps it until :meth:`settle_key`."""
        self._taken[index] = self._by_key.pop(index)

    def settle_key(self, index: IndexKey, entry: CacheEntry, consumed: bool) -> None:
        """The pull that took the key from ``entry`` ended: a successful one (``consumed``) releases the key; a
        failed one binds it again, unless the key was removed, bound anew or its cache released meanwhile."""
        found = self._taken.get(index)
        if found is None or found[0] is not entry:  # removed meanwhile (and perhaps taken anew from another cache)
            return
        del self._taken[index]
        if not consumed and index not in self._by_key:
            self._by_key[index] = found
            return
        entry.keys.discard(index)
        self._maybe_free(entry)

    def _maybe_free(self, entry: CacheEntry) -> None:
        if entry.released and not entry.keys and entry.leases == 0:
            self.free_now(entry)

    def free_now(self, entry: CacheEntry) -> None:
        """Run the entry's release hooks, free memory aiodatadist allocated (once nothing here uses it) and tell
        :attr:`on_freed` (peers that mapped it let go of their mappings)."""
        if entry.freed:
            return
        entry.freed = True
        hooks, entry.on_free = entry.on_free, []
        for hook in hooks:
            hook()
        if entry.host_memory is not None:
            entry.host_memory._registered.discard(entry)
        if self.on_freed is not None and entry.cache_id > 0:
            self.on_freed(entry)
        if entry.segment is not None:
            entry.segment.close()
        if entry.device_memory is not None:
            entry.device_memory.close()

    def acquire(self, entry: CacheEntry) -> None:
        """Take a lease that outlives a call (owner side of a peer's transfer); see :meth:`release_lease`."""
        entry.leases += 1

    def release_lease(self, entry: CacheEntry) -> None:
        entry.leases -= 1
        if entry.leases == 0 and entry.on_idle:
            hooks, entry.on_idle = entry.on_idle, []
            for hook in hooks:
                hook()
        self._maybe_free(entry)

    def lease(self, *entries: CacheEntry) -> _Lease:
        """Keep the entries' memory alive for the duration of a transfer (a context manager)."""
        return _Lease(self, entries)

    def close_all(self) -> list[CopyJob]:
        """Release everything (``finalize``); returns jobs still running on registered memory."""
        jobs: list[CopyJob] = []
        for entry in list(self._by_id.values()):
            jobs.extend(self.release(entry))
        for entry, _ in [*self._by_key.values(), *self._taken.values()]:
            entry.keys.clear()
            self._maybe_free(entry)
        self._by_key.clear()
        self._taken.clear()
        return jobs


class _Lease:
    """:meth:`CacheRegistry.lease`: a class rather than a generator, as it wraps every transfer."""

    __slots__ = ("_entries", "_registry")

    def __init__(self, registry: CacheRegistry, entries: tuple[CacheEntry, ...]) -> None:
        self._registry, self._entries = registry, entries

    def __enter__(self) -> None:
        for entry in self._entries:
            entry.leases += 1

    def __exit__(self, *exc: object) -> None:
        for entry in self._entries:
            self._registry.release_lease(entry)
