"""Device caches: their memory, the addresses a device copy uses, and what links hold of peers' device memory.

Every copy that touches a ``Placement.DEVICE`` cache runs on the device of this instance (``device_id``), through
its runtime's executor (:mod:`.device_runtime`; for CUDA one launch of the pointer-list kernel), whatever the
other end is:

* device memory of this process: its own address;
* a same-host peer's device memory: its IPC handle, opened once per process and allocation
  (:class:`IpcMappings`), closed when the peer frees it or the last link that uses it closes;
* host memory (this instance's shared-memory caches, caller-registered memory, a peer's segment mapped into this
  process): page-locked once (``register_host``) and read or written by the device over the bus.

The runtime is loaded only when the first DEVICE cache is made; without it those calls raise
``LLM_FEATURE_NOT_ENABLED`` saying why, and nothing else changes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from .._arrays import UInt64Array
from .._checks import U64_LIMIT, require
from ..errors import LLMException, LLMStatusCode
from ..memory.segment import PAGE
from .device_runtime import DeviceExecutor, DeviceRuntime, decided_runtime, open_runtime

__all__ = ["DeviceMemory", "DeviceSupport", "IpcMappings", "LinkDeviceState", "PinnedHostMemory", "device_identity",
           "merged_ranges"]

log = logging.getLogger("aiodatadist.copy.device")
ALIGN = 256  # tensors of an allocated device cache start on 256-byte boundaries (16-byte vector copies)
IPC_HANDLE_BYTES = {"cuda": 64, "acl": 65}  # each runtime's IPC handle: its length tells a peer's runtime
_identity: tuple[str, int] | None = None  # this process's device runtime, once an instance opened it


def device_identity() -> tuple[str, int] | None:
    """This process's device runtime and the PID its IPC imports present (:attr:`DeviceRuntime.ipc_pid`), as
    links announce them; None until an instance of this process opened its device (or once the settings that
    chose it changed: a test switching runtimes)."""
    identity = _identity
    return identity if identity is not None and decided_runtime() == identity[0] else None


class DeviceMemory:
    """Device memory of an allocated DEVICE cache; freed once nothing uses it (see the registry)."""

    def __init__(self, runtime: DeviceRuntime, size: int) -> None:
        self.runtime = runtime
        self.size = size
        self.address = runtime.alloc(size)

    def close(self) -> None:
        if self.address:
            address, self.address = self.address, 0
            self.runtime.free(address)


def _page_range(addr: int, nbytes: int) -> tuple[int, int]:
    start = addr // PAGE * PAGE
    return start, -(-(addr + nbytes) // PAGE) * PAGE


class DeviceSupport:
    """One instance's device: allocation, the copy executor and page-locked host ranges.  Creating it raises
    ``LLM_FEATURE_NOT_ENABLED`` (saying why) without a usable device."""

    def __init__(self, ordinal: int) -> None:
        global _identity
        self.runtime: DeviceRuntime = open_runtime(ordinal)
        self.executor: DeviceExecutor = self.runtime.executor
        _identity = (self.runtime.name, self.runtime.ipc_pid)
        self._mine: dict[tuple[int, int], int] = {}  # ranges this instance pinned (see PINNED), with counts
        self._lock = threading.Lock()

    # -- device memory ---------------------------------------------------------------------------------------
    def allocate(self, tensor_size: int, num_tensors: int) -> tuple[DeviceMemory, list[int]]:
        """Device memory for ``num_tensors`` tensors of ``tensor_size`` bytes; returns it and the tensors'
        addresses (each 256-byte aligned)."""
        stride = -(-tensor_size // ALIGN) * ALIGN
        memory = DeviceMemory(self.runtime, stride * num_tensors)
        return memory, [memory.address + i * stride for i in range(num_tensors)]

    def check_registered(self, addrs: list[int], tensor_size: int) -> None:
        """Caller-owned device addresses must be device memory of this device, each tensor inside one
        allocation."""
        runtime = self.runtime
        for addr in addrs:
            require(runtime.is_device_pointer(addr),
                    f"address {addr:#x} is not device memory of {runtime.name.upper()} device {runtime.ordinal}.")
            base, size = runtime.address_range(addr, tensor_size)
            require(addr + tensor_size <= base + size,
                    f"tensor at {addr:#x} ({tensor_size} bytes) runs past the end of its allocation "
                    f"({base:#x}, {size} bytes).")

    def ipc_export(self, addrs: UInt64Array, tensor_size: int, importer: int | None = None) -> list[list[Any]]:
        """The IPC handles a same-host peer opens to reach these device tensors: ``[handle, base, size]`` per
        distinct allocation (``importer``: the peer's :attr:`DeviceRuntime.ipc_pid`, if it said)."""
        seen: dict[int, list[Any]] = {}
        for addr in addrs.tolist():
            base, size = self.runtime.address_range(int(addr), tensor_size)
            if base not in seen:
                seen[base] = [self.runtime.ipc_handle(base, importer), base, size]
        return list(seen.values())

    def withdraw_exports(self, addrs: UInt64Array) -> None:
        """A caller-registered device cache was unregistered: the memory is its owner's again (see
        :meth:`DeviceRuntime.ipc_withdraw`)."""
        for addr in addrs.tolist():
            self.runtime.ipc_withdraw(int(addr))

    # -- host memory the GPU reaches -------------------------------------------------------------------------
    def pin(self, addr: int, nbytes: int) -> int:
        """Page-lock host memory ``[addr, addr + nbytes)`` (whole pages) for GPU copies; returns the offset to
        add to its host addresses to get device addresses.  Pair with :meth:`unpin`."""
        delta = PINNED.pin(self.runtime, addr, nbytes)
        with self._lock:
            key = (addr, nbytes)
            self._mine[key] = self._mine.get(key, 0) + 1
        return delta

    def unpin(self, addr: int, nbytes: int) -> None:
        with self._lock:
            key = (addr, nbytes)
            if not self._mine.get(key):
                return
            self._mine[key] -= 1
            if not self._mine[key]:
                del self._mine[key]
        PINNED.unpin(self.runtime, addr, nbytes)

    def close(self) -> None:
        """Stop the executor (after its work is done) and let go of every host range this instance pinned."""
        self.executor.close()
        with self._lock:
            mine, self._mine = self._mine, {}
        for (addr, nbytes), count in mine.items():
            for _ in range(count):
                PINNED.unpin(self.runtime, addr, nbytes)


class PinnedHostMemory:
    """Host ranges page-locked for the device, for the whole process (runtimes register memory process-wide,
    and CUDA refuses to register a page twice): reference-counted by range, so that several instances, caches and
    concurrent swaps over the same memory share one registration."""

    def __init__(self) -> None:
        self._ranges: dict[int, tuple[int, int, int]] = {}  # host start -> (host end, device base, users)
        self._lock = threading.Lock()

    def pin(self, runtime: DeviceRuntime, addr: int, nbytes: int) -> int:
        start, end = _page_range(addr, nbytes)
        with self._lock:
            found = self._ranges.get(start)
            if found is None:
                device_base = runtime.register_host(start, end - start)
                self._ranges[start] = (end, device_base, 1)
                return (device_base - start) % U64_LIMIT
            if found[0] < end:
                raise LLMException(f"host memory at {start:#x} is already page-locked for {found[0] - start} "
                                   f"bytes, not {end - start}", status_code=LLMStatusCode.LLM_PARAM_INVALID)
            self._ranges[start] = (found[0], found[1], found[2] + 1)
            return (found[1] - start) % U64_LIMIT

    def unpin(self, runtime: DeviceRuntime, addr: int, nbytes: int) -> None:
        start, _ = _page_range(addr, nbytes)
        with self._lock:
            found = self._ranges.get(start)
            if found is None:
                return
            if found[2] > 1:
                self._ranges[start] = (found[0], found[1], found[2] - 1)
                return
            del self._ranges[start]
        try:
            runtime.unregister_host(start)
        except LLMException as exc:
            log.warning("cannot unpin host memory at %#x: %s", start, exc)


PINNED = PinnedHostMemory()


def merged_ranges(addrs: UInt64Array, nbytes: int) -> list[tuple[int, int]]:
    """The whole-page ranges ``(start, size)`` covering tensors of ``nbytes`` at ``addrs``, overlapping and
    touching ones merged (page-locking the same page twice fails), in address order."""
    ranges: list[tuple[int, int]] = []
    for addr in sorted(int(a) for a in addrs):
        start, end = _page_range(addr, nbytes)
        if ranges and start <= ranges[-1][0] + ranges[-1][1]:
            last_start, last_size = ranges[-1]
            ranges[-1] = (last_start, max(last_start + last_size, end) - last_start)
        else:
            ranges.append((start, end - start))
    return ranges


class IpcMappings:
    """Peers' device allocations opened in this process, one mapping per allocation shared by every link
    (a process opens a handle once), closed when the last user lets go."""

    def __init__(self) -> None:
        self._open: dict[bytes, tuple[int, int]] = {}  # handle -> (local base, users)
        self._lock = threading.Lock()

    def acquire(self, runtime: DeviceRuntime, handle: bytes) -> int:
        with self._lock:
            found = self._open.get(handle)
            if found is not None:
                self._open[handle] = (found[0], found[1] + 1)
                return found[0]
            base = runtime.ipc_open(handle)
            self._open[handle] = (base, 1)
            return base

    def release(self, runtime: DeviceRuntime, handle: bytes) -> None:
        with self._lock:
            found = self._open.get(handle)
            if found is None:
                return
            if found[1] > 1:
                self._open[handle] = (found[0], found[1] - 1)
                return
            del self._open[handle]
        try:
            runtime.ipc_close(found[0])
        except LLMException as exc:
            log.warning("cannot close a peer's device memory: %s", exc)


IPC = IpcMappings()


class LinkDeviceState:
    """What one link holds of its peer for device copies: opened IPC allocations and pinned peer segments.

    Released (after every copy on the link stopped) when the link closes, before the segments are unmapped.
    """

    def __init__(self, support: DeviceSupport, same_process: bool) -> None:
        self.support = support
        self.same_process = same_process
        self._handles: dict[bytes, int] = {}  # handle -> local base
        self._views: dict[int, tuple[UInt64Array, UInt64Array]] = {}  # id(remote addrs) -> (them, their view)
        self._busy: dict[bytes, int] = {}  # GPU copies running on an opened allocation
        self._forgotten: set[bytes] = set()  # freed by the peer while busy: closed when idle
        self._pinned: dict[int, tuple[int, int]] = {}  # local mapping address -> (size, device offset)

    def remote_delta(self, ipc: list[tuple[bytes, int, int]], remote_addrs: UInt64Array,
                     tensor_size: int) -> UInt64Array:
        """Addresses in this process for a peer's device tensors (each inside one of the ``ipc`` allocations);
        computed once per described cache (a descriptor never changes)."""
        if self.same_process:
            return remote_addrs
        known = self._views.get(id(remote_addrs))
        if known is not None and known[0] is remote_addrs:
            return known[1]
        runtime = self.support.runtime
        expected = IPC_HANDLE_BYTES.get(runtime.name)
        if any(len(handle) != expected for handle, _, _ in ipc):
            theirs = next((n for n, size in IPC_HANDLE_BYTES.items() if size != expected), "another runtime")
            raise LLMException(f"the peer's device caches are {theirs.upper()} memory and this process uses "
                               f"{runtime.name.upper()}: IPC cannot join two device runtimes; link over TCP "
                               "(transport tcp) to stage them through host memory",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        bases = np.array([base for _, base, _ in ipc], dtype=np.uint64)
        ends = np.array([base + size for _, base, size in ipc], dtype=np.uint64)
        local = np.empty(len(ipc), dtype=np.uint64)
        for i, (handle, _, _) in enumerate(ipc):
            found = self._handles.get(handle)
            if found is None:
                found = self._handles[handle] = IPC.acquire(self.support.runtime, handle)
            local[i] = found
        which = np.searchsorted(bases, remote_addrs, side="right") - 1
        inside = (which >= 0) & (remote_addrs + np.uint64(tensor_size) <= ends[np.maximum(which, 0)])
        if not bool(inside.all()):
            raise LLMException("the peer described device tensors outside its IPC allocations",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        view = remote_addrs - bases[which] + local[which]
        self._views[id(remote_addrs)] = (remote_addrs, view)  # holding remote_addrs keeps its id unique
        return view

    def pinned_delta(self, local_base: int, size: int) -> int:
        """Page-lock a peer segment mapped at ``local_base`` in this process (once per link); returns the offset
        from its addresses here to device addresses."""
        found = self._pinned.get(local_base)
        if found is None:
            found = self._pinned[local_base] = (size, self.support.pin(local_base, size))
        return found[1]

    def forget_pinned(self, local_base: int) -> None:
        """A peer segment mapped at ``local_base`` is about to be unmapped: unpin it first."""
        found = self._pinned.pop(local_base, None)
        if found is not None:
            self.support.unpin(local_base, found[0])

    def hold(self, ipc: list[tuple[bytes, int, int]]) -> None:
        for handle, _, _ in ipc:
            self._busy[handle] = self._busy.get(handle, 0) + 1

    def release(self, ipc: list[tuple[bytes, int, int]]) -> None:
        for handle, _, _ in ipc:
            left = self._busy.get(handle, 0) - 1
            if left > 0:
                self._busy[handle] = left
            else:
                self._busy.pop(handle, None)
                if handle in self._forgotten:
                    self.forget_handle(handle)

    def forget_handle(self, handle: bytes) -> None:
        """The peer freed the allocation of ``handle``: close it here once no copy uses it."""
        if self._busy.get(handle):
            self._forgotten.add(handle)
            return
        self._forgotten.discard(handle)
        if self._handles.pop(handle, None) is not None:
            self._views.clear()
            IPC.release(self.support.runtime, handle)

    def close(self) -> None:
        for handle in self._handles:
            IPC.release(self.support.runtime, handle)
        self._handles.clear()
        self._views.clear()
        for base, (size, _) in self._pinned.items():
            self.support.unpin(base, size)
        self._pinned.clear()
