"""Same-host peers: proving that a peer shares this host, and reaching its memory.

At link time each side announces a probe: a one-page shared-memory segment holding a random nonce.  The other
side tries the same-host mechanisms on it: mapping the segment through ``/proc/<pid>/fd`` (``map``), reading it
with ``process_vm_readv`` (``pvm``), both of which need ptrace rights over the peer, and, when neither is
allowed (a peer under another user), asking the peer's Unix socket for the segment's descriptor (``fds``,
:mod:`aiodatadist.transport.fd_passing`).  Reading the right nonce proves the peer is on this host (not just a
matching hostname) and tells which mechanism works.  :class:`PeerMemory` then turns copy spans that address the
peer's memory into native copies.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import mmap
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._checks import U64_LIMIT
from ..errors import LLMException, LLMStatusCode
from ..memory import SegmentIdentity, SharedSegment, map_peer_segment, map_segment_fd
from ..native import CopyMode, CopySpec, populate, process_vm_read, pvm_copier
from ..protocol.messages import HOST_NONCE_BYTES as NONCE_BYTES
from ..protocol.messages import MAX_ANNOUNCED_SEGMENTS, HostInfo
from ..settings.environment import env_knobs
from .fd_passing import PROBE, SEGMENT, request_fd

__all__ = ["MAX_ANNOUNCED_SEGMENTS", "NONCE_BYTES", "HostProbe", "PeerCapabilities", "PeerMemory",
           "allowed_mechanisms"]

log = logging.getLogger("aiodatadist.transport.same_host")


def allowed_mechanisms() -> frozenset[str]:
    """Same-host mechanisms this process may use: ``map`` and ``pvm`` unless restricted by the
    ``AIODATADIST_SAME_HOST`` environment variable (comma-separated; for diagnosing OS restrictions)."""
    return env_knobs().same_host


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class HostProbe:
    """This process's probe segment and nonce, announced in the handshake."""

    def __init__(self) -> None:
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.segment = SharedSegment(mmap.PAGESIZE, name="aiodatadist-probe")
        self.segment.array()[:NONCE_BYTES] = np.frombuffer(self.nonce, dtype=np.uint8)
        self.fds: str | None = None  # this process's fd socket, once it listens

    def info(self) -> HostInfo:
        """The probe as the handshake announces it (``host``)."""
        return HostInfo(_boot_id(), os.getpid(), self.segment.identity, self.segment.address, self.nonce,
                        self.fds)

    def close(self) -> None:
        self.segment.close()


@dataclass(frozen=True, slots=True)
class PeerCapabilities:
    """What this side can do with a peer's memory."""

    same_host: bool
    can_map: bool  # the peer's segments can be mapped here: through /proc (fds None) or handed over (fds)
    can_pvm: bool
    pid: int
    fds: str | None = None  # the peer's fd socket, when its segments are handed over rather than opened

    def describe(self) -> str:
        if not self.same_host:
            return "other host"
        mapped = "fds" if self.fds else "map"
        mechanisms = [m for m, ok in ((mapped, self.can_map), ("pvm", self.can_pvm)) if ok]
        return "same host (" + ("+".join(mechanisms) or "no mechanism") + ")"


def probe_peer(info: HostInfo | None) -> PeerCapabilities:
    """Test both mechanisms on a peer's announced probe (None: absent or malformed); never raises for a hostile
    or foreign probe."""
    if info is None or info.boot != _boot_id():
        return PeerCapabilities(False, False, False, 0)
    allowed = allowed_mechanisms()
    identity, pid, nonce = info.probe, info.pid, info.nonce
    can_map = can_pvm = False
    if "map" in allowed:
        try:
            mapping = map_peer_segment(identity)
            try:
                can_map = mapping[:NONCE_BYTES] == nonce
            finally:
                mapping.close()
        except (OSError, OverflowError, ValueError) as exc:
            log.debug("cannot map peer %d's memory: %s", pid, exc)
    if "pvm" in allowed:
        buf = ctypes.create_string_buffer(NONCE_BYTES)
        try:
            process_vm_read(pid, np.array([info.address], dtype=np.uint64),
                            np.array([ctypes.addressof(buf)], dtype=np.uint64),
                            np.array([NONCE_BYTES], dtype=np.uint64))
            can_pvm = buf.raw == nonce
        except (OSError, OverflowError, ValueError) as exc:
            log.debug("process_vm_readv on peer %d refused: %s", pid, exc)
    return PeerCapabilities(can_map or can_pvm, can_map, can_pvm, pid)


async def probe_peer_fds(info: HostInfo | None, caps: PeerCapabilities) -> PeerCapabilities:
    """When neither ``map`` nor ``pvm`` reaches a peer that says it shares this kernel (a peer under another
    user), try ``fds``: its socket hands over a read-only descriptor of its probe, which must hold the nonce."""
    if (caps.same_host or info is None or info.fds is None or info.boot != _boot_id()
            or "fds" not in allowed_mechanisms()):
        return caps
    name = info.fds
    try:
        fd = await asyncio.to_thread(request_fd, name, PROBE)
        try:
            mapping = map_segment_fd(fd, info.probe, writable=False)
        finally:
            os.close(fd)
        try:
            same = mapping[:NONCE_BYTES] == info.nonce
        finally:
            mapping.close()
    except (OSError, OverflowError, ValueError) as exc:
        log.debug("peer %d's fd socket refused its probe: %s", info.pid, exc)
        return caps
    return PeerCapabilities(True, True, False, info.pid, name) if same else caps


class PeerMemory:
    """Copy functions that reach a same-host peer's memory; peer segments are mapped once and cached."""

    def __init__(self, caps: PeerCapabilities) -> None:
        self.caps = caps
        self.fd_token: bytes | None = None  # what the peer's fd socket asks of this side (the link's grant)
        self._mappings: dict[tuple[int, int], tuple[mmap.mmap, int]] = {}
        self._populating: dict[tuple[int, int], asyncio.Task[Any]] = {}
        self._holds: dict[tuple[int, int], int] = {}  # copies running on a mapping
        self._forgotten: dict[tuple[int, int], Callable[[int], None]] = {}  # freed by the peer, unmap when idle
        self._copiers: dict[tuple[int, int, bool, bool], CopySpec] = {}  # (local base, remote base, ...) -> spec

    def local_base(self, identity: SegmentIdentity) -> int:
        """Where a peer segment is mapped in this process (mapped on first use, then cached; with ``fds``,
        :meth:`ensure` maps it first)."""
        key = (identity.inode, identity.device)
        found = self._mappings.get(key)
        if found is None:
            if self.caps.fds:
                raise OSError(0, f"peer segment {identity.inode} was not handed over (PeerMemory.ensure)")
            mapping = map_peer_segment(identity)  # lazy: O(1) whatever the size
            fd = os.open(f"/proc/{identity.pid}/fd/{identity.fd}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                extents = data_extents(fd, identity.size)
            finally:
                os.close(fd)
            found = self._adopt(key, mapping, extents)
        return found[1]

    def _adopt(self, key: tuple[int, int], mapping: mmap.mmap, extents: list[tuple[int, int]]) -> tuple[mmap.mmap, int]:
        found = (mapping, ctypes.addressof(ctypes.c_char.from_buffer(mapping)))
        self._mappings[key] = found
        # Fault the page tables in the background (GIL released); transfers need not wait for it.  Only where the
        # file has pages: memory shared in place has holes, which faulting would fill.
        task = asyncio.ensure_future(asyncio.to_thread(_populate_extents, found[1], extents))
        self._populating[key] = task
        task.add_done_callback(lambda _: self._populated(key))
        return found

    async def ensure(self, identity: SegmentIdentity) -> None:
        """With ``fds``: have the peer hand over the segment (once), then map it; otherwise nothing to do."""
        name = self.caps.fds
        key = (identity.inode, identity.device)
        if name is None or key in self._mappings:
            return
        token = self.fd_token or bytes(16)
        fd = await asyncio.to_thread(request_fd, name, SEGMENT, token, identity.inode, identity.device)
        try:
            if key not in self._mappings:  # (another transfer may have mapped it meanwhile)
                self._adopt(key, map_segment_fd(fd, identity), data_extents(fd, identity.size))
        finally:
            os.close(fd)

    def handed_over(self, identity: SegmentIdentity) -> bool:
        """Whether ``identity`` needs no hand-over (:meth:`ensure`) before a copy maps it."""
        return self.caps.fds is None or (identity.inode, identity.device) in self._mappings

    def _populated(self, key: tuple[int, int]) -> None:
        self._populating.pop(key, None)
        self._unmap_if_idle(key)

    def hold(self, identity: SegmentIdentity) -> tuple[int, int]:
        """A copy is about to use the mapping of ``identity``: it is not unmapped before :meth:`release`."""
        key = (identity.inode, identity.device)
        self._holds[key] = self._holds.get(key, 0) + 1
        return key

    def release(self, key: tuple[int, int]) -> None:
        left = self._holds.get(key, 0) - 1
        if left > 0:
            self._holds[key] = left
        else:
            self._holds.pop(key, None)
            self._unmap_if_idle(key)

    def forget(self, key: tuple[int, int], before_unmap: Callable[[int], None]) -> None:
        """The peer freed the segment ``(inode, device)``: unmap it once no copy uses it (``before_unmap`` gets
        its address here first, e.g. to unpin it), so that its pages go back to the system."""
        if key in self._mappings:
            self._forgotten[key] = before_unmap
            self._unmap_if_idle(key)

    def _unmap_if_idle(self, key: tuple[int, int]) -> None:
        if key not in self._forgotten or self._holds.get(key) or key in self._populating:
            return
        before_unmap = self._forgotten.pop(key)
        mapping, base = self._mappings.pop(key)
        before_unmap(base)
        try:
            mapping.close()
        except BufferError:  # still exported somewhere: the next collection unmaps it
            pass

    def premap(self, segments: Sequence[tuple[SegmentIdentity, int]]) -> list[asyncio.Task[Any]]:
        """Map the segments a peer announced at link time (``segs``, already parsed); returns the page-table
        population tasks.

        Segments that cannot be mapped are skipped: a wrong announcement only costs the lazy mapping at first use.
        """
        if not self.caps.can_map:
            return []
        if self.caps.fds:
            return [asyncio.ensure_future(self._ensure_quietly(identity))
                    for identity, _ in segments if identity.pid == self.caps.pid]
        tasks = []
        for identity, _ in segments:
            if identity.pid != self.caps.pid:
                continue
            try:
                self.local_base(identity)
            except (OSError, ValueError) as exc:
                log.debug("peer segment %r not mapped at link time: %s", identity, exc)
                continue
            task = self._populating.get((identity.inode, identity.device))
            if task is not None:
                tasks.append(task)
        return tasks

    async def _ensure_quietly(self, identity: SegmentIdentity) -> None:
        try:
            await self.ensure(identity)
        except (OSError, ValueError) as exc:
            log.debug("peer segment %r not handed over at link time: %s", identity, exc)

    def copier(self, *, remote_is_src: bool, segment: tuple[SegmentIdentity, int] | None,
               streaming: bool) -> CopySpec:
        """How to copy spans whose ``src`` (pull) or ``dst`` (push) addresses are the peer's."""
        if segment is not None and self.caps.can_map:
            identity, remote_base = segment
            local_base = self.local_base(identity)
            key = (local_base, remote_base, remote_is_src, streaming)
            spec = self._copiers.get(key)  # (every call's: built once per mapping and direction)
            if spec is None:
                if len(self._copiers) >= 256:
                    self._copiers.clear()
                delta = (local_base - remote_base) % U64_LIMIT
                spec = self._copiers[key] = CopySpec(CopyMode.MEMCPY, streaming=streaming,
                                                     src_delta=delta if remote_is_src else 0,
                                                     dst_delta=0 if remote_is_src else delta)
            return spec
        if self.caps.can_pvm:
            return pvm_copier(self.caps.pid, remote_is_src=remote_is_src)
        raise LLMException(_unreachable_reason(self.caps, segment), status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)

    async def close(self) -> None:
        """Unmap the peer's segments (callers first stop every copy that uses them)."""
        if self._populating:  # let the background madvise finish before unmapping (cancelling cannot stop it)
            await asyncio.gather(*self._populating.values(), return_exceptions=True)
        for mapping, _ in self._mappings.values():
            try:
                mapping.close()
            except BufferError:
                pass
        self._mappings.clear()
        self._forgotten.clear()


def data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The ``(offset, length)`` ranges of a segment's file that hold pages (all of it for aiodatadist's own
    segments; memory shared in place has holes between its ranges)."""
    if os.fstat(fd).st_blocks * 512 >= size:
        return [(0, size)]
    extents: list[tuple[int, int]] = []
    offset = 0
    try:
        while offset < size:
            start = os.lseek(fd, offset, os.SEEK_DATA)
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            extents.append((start, end - start))
            offset = end
    except OSError:  # ENXIO: no data past offset
        pass
    return extents


def _populate_extents(base: int, extents: list[tuple[int, int]]) -> None:
    for offset, length in extents:
        populate(base + offset, length, write=True)


def _unreachable_reason(caps: PeerCapabilities, segment: tuple[SegmentIdentity, int] | None) -> str:
    allowed = allowed_mechanisms()
    missing = []
    if segment is None:
        missing.append("the peer's cache is caller-registered memory outside any shareable segment, which only "
                       "process_vm_readv/writev can reach")
    elif not caps.can_map:
        missing.append(f"mapping the peer's shared memory through /proc/{caps.pid}/fd is not permitted")
    if "pvm" not in allowed:
        missing.append("process_vm_readv/writev is disabled by AIODATADIST_SAME_HOST")
    else:
        missing.append("process_vm_readv/writev is refused by the OS (ptrace restrictions: "
                       "/proc/sys/kernel/yama/ptrace_scope, seccomp or a missing CAP_SYS_PTRACE)")
    return ("no same-host mechanism reaches the peer's memory: " + "; ".join(missing) + ".  To fix it, on the "
            "owner register the cache inside memory from CacheManager.allocate_host_memory (or allocate it with "
            "allocate_cache/allocate_blocks_cache), or allow process_vm_readv/writev (ptrace_scope 0 or "
            "CAP_SYS_PTRACE), or link with llm.Transport=tcp")
