"""Host memory of caches: anonymous shared-memory segments (memfd).

They must be zero-filled, page-rounded and writable, leave nothing in /dev/shm, be released by ``finalize``
(and by the kernel when the owner dies, even by SIGKILL), and be mappable by another process on the same host
that knows their identity, but only when the identity matches.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers.data import fill_rows, row_views
from helpers.ids import new_cluster_id
from helpers.internals import registry_of
from helpers.keys import resolve

from aiodatadist import (
    CacheDesc,
    CacheKey,
    CacheManager,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
)
from aiodatadist.memory import SegmentIdentity, SharedSegment, map_peer_segment
from aiodatadist.memory.segment import PAGE

MiB = 1 << 20


def shm_entries() -> set[str]:
    """Names in /dev/shm, without POSIX semaphores (other processes' multiprocessing creates those)."""
    try:
        return {n for n in os.listdir("/dev/shm") if not n.startswith("sem.")}
    except FileNotFoundError:
        return set()


def open_fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the descriptor listdir itself used
    return fds


def memfds() -> set[int]:
    """Open descriptors of memfds (CPython's mmap holds a dup of the descriptor it maps, so a mapped
    segment usually shows up twice)."""
    return {fd for fd, target in open_fds().items() if target.startswith("/memfd:")}


def memfd_inodes() -> set[int]:
    inodes = set()
    for fd in memfds():
        try:
            inodes.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            pass
    return inodes


def fd_inode(fd: int) -> int | None:
    try:
        return os.stat(f"/proc/self/fd/{fd}").st_ino
    except OSError:
        return None


def shmem_bytes() -> int:
    """Shared memory in use system-wide: ``Shmem`` and the huge pages in use (a cache may lie on either)."""
    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
    if "Shmem" not in info:
        raise AssertionError("no Shmem line in /proc/meminfo")
    huge = (info.get("HugePages_Total", 0) - info.get("HugePages_Free", 0)) * info.get("Hugepagesize", 0)
    return (info["Shmem"] + huge) * 1024


def rss_shmem_bytes(pid: int) -> int:
    """Shared memory mapped by process ``pid``: ``RssShmem`` and ``HugetlbPages``."""
    with open(f"/proc/{pid}/status") as f:
        status = {k: v.split() for k, v in (line.split(":", 1) for line in f)}
    if "RssShmem" not in status:
        raise AssertionError("no RssShmem line")
    return (int(status["RssShmem"][0]) + int(status.get("HugetlbPages", ["0"])[0])) * 1024


def read_line(proc: subprocess.Popen[str], timeout: float = 30.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError("child did not answer in time")
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"child exited early (rc={proc.poll()}): {err[-2000:]}")
    return line.strip()


def spawn_child(script: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )


def stop_child(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


# ------------------------------------------------------------------------------------------------------------
# SharedSegment
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size,pages", [(1, 1), (PAGE - 1, 1), (PAGE, 1), (PAGE + 1, 2), (5 * PAGE + 3, 6)])
def test_segment_is_page_rounded_zeroed_and_writable(size: int, pages: int) -> None:
    seg = SharedSegment(size)
    try:
        assert seg.size == pages * PAGE
        arr = seg.array()
        assert arr.dtype == np.uint8 and arr.shape == (pages * PAGE,)
        assert arr.ctypes.data == seg.address
        assert not arr.any()  # zero-filled, including the rounding tail
        pattern = np.random.default_rng(size).integers(1, 256, size=seg.size, dtype=np.uint8)
        arr[:] = pattern
        # the raw address sees the same bytes (the copier works on addresses)
        assert ctypes.string_at(seg.address, seg.size) == pattern.tobytes()
        ctypes.memset(seg.address + seg.size - 1, 0, 1)
        assert arr[-1] == 0
        del arr
        ident = seg.identity
        st = os.fstat(ident.fd)
        assert (ident.pid, ident.inode, ident.device) == (os.getpid(), st.st_ino, st.st_dev)
        assert ident.size == seg.size
        assert st.st_size == seg.size
        assert os.readlink(f"/proc/self/fd/{ident.fd}").startswith("/memfd:")
        assert not seg.closed
    finally:
        seg.close()
    assert seg.closed
    seg.close()  # idempotent


def test_segment_rejects_empty_size() -> None:
    for size in (0, -1):
        with pytest.raises(ValueError):
            SharedSegment(size)


def test_segment_close_releases_descriptor_and_keeps_live_views() -> None:
    gc.collect()  # earlier tests' garbage may still hold mappings: let it go before comparing
    before_inodes = memfd_inodes()
    plain = SharedSegment(PAGE)
    inode = plain.identity.inode
    assert memfd_inodes() - before_inodes == {inode}
    plain.close()
    assert inode not in memfd_inodes()  # no view: descriptor and mapping are gone at once
    seg = SharedSegment(3 * PAGE)
    fd, inode = seg.identity.fd, seg.identity.inode
    assert fd in memfds() and fd_inode(fd) == inode
    view = seg.array()
    view[:] = 7
    seg.close()
    assert seg.closed
    assert fd_inode(fd) != inode  # the segment's own descriptor is closed
    assert (view == 7).all()  # a view the user still holds keeps the pages readable and writable
    view[0] = 9
    assert view[0] == 9
    assert inode in memfd_inodes()  # CPython's mmap keeps its own descriptor while the view lives
    del view, seg
    assert inode not in memfd_inodes()  # with the last view the mapping (and its descriptor) is gone too


# ------------------------------------------------------------------------------------------------------------
# caches
# ------------------------------------------------------------------------------------------------------------

async def test_allocate_creates_no_dev_shm_entries(cache_manager: CacheManager) -> None:
    before_shm, before_fds = shm_entries(), memfds()
    desc = CacheDesc(4, [8, 4096], DataType.DT_UINT8, Placement.HOST)
    caches = [cache_manager.allocate_cache(desc), cache_manager.allocate_blocks_cache(desc)]
    fill_rows(caches[0], 1)
    await cache_manager.copy_cache(caches[0], caches[0], 1, 0)
    assert shm_entries() == before_shm
    # each allocated cache is backed by one anonymous memfd
    new = memfds() - before_fds
    assert len({fd_inode(fd) for fd in new}) == 2
    targets = {os.readlink(f"/proc/self/fd/{fd}") for fd in new}
    assert all(t.startswith("/memfd:aiodatadist") for t in targets), targets
    for cache in caches:
        seg = registry_of(cache_manager).by_id(cache.cache_id).segment
        assert seg is not None and seg.identity.fd in new
        assert seg.size >= desc.size * desc.num_tensors and seg.size % PAGE == 0
        assert all(seg.address <= a < seg.address + seg.size for a in cache.tensor_addrs)


async def test_finalize_closes_every_segment() -> None:
    gc.collect()  # earlier tests' garbage may still hold mappings: let it go before taking the baseline
    baseline_memfds = memfds()
    dd = LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    await dd.init(LLMConfig().generate_options())
    try:
        cm = dd.cache_manager
        after_init, init_memfds = len(open_fds()), memfds()  # init may map memfds of its own
        desc = CacheDesc(2, [4, 8192], DataType.DT_UINT8, Placement.HOST)
        caches = [cm.allocate_cache(desc) for _ in range(3)]
        caches += [cm.allocate_blocks_cache(desc) for _ in range(2)]
        keyed = cm.allocate_cache(desc, [CacheKey(1, 1)])
        cm.deallocate_cache(keyed)  # released, but alive through its key
        held = row_views(caches[0])  # the user still holds views of one cache
        data = fill_rows(caches[0], 4)
        arrays = [np.zeros(4 * 8192, np.uint8) for _ in range(2)]
        cm.register_cache(desc, [a.ctypes.data for a in arrays])  # registered memory has no descriptor
        segments = [registry_of(cm).by_id(c.cache_id).segment for c in caches]
        segments.append(resolve(registry_of(cm), CacheKey(1, 1))[0].segment)
        assert len(open_fds()) >= after_init + 6
        assert len({fd_inode(fd) for fd in memfds() - init_memfds}) == 6
        assert {s.identity.inode for s in segments} == {fd_inode(fd) for fd in memfds() - init_memfds}
        assert not any(s.closed for s in segments)
    finally:
        await dd.finalize()
    assert all(s.closed for s in segments)
    # only the cache whose views the user still holds keeps a mapping (and CPython's mmap descriptor)
    assert memfd_inodes() - {fd_inode(fd) for fd in baseline_memfds} <= {segments[0].identity.inode}
    assert len(open_fds()) <= after_init + 1
    # views the user kept still read the old bytes (the mapping dies with the last view, not before)
    assert all(np.array_equal(h, d) for h, d in zip(held, data, strict=True))
    del held, segments, caches
    assert memfds() == baseline_memfds
    assert len(open_fds()) <= after_init


_KILLED_CHILD = r"""
import asyncio, os
from aiodatadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement

async def main():
    dd = LLMDataDist(LLMRole.PROMPT, 4242)
    await dd.init(LLMConfig().generate_options())
    cm = dd.cache_manager
    cache = cm.allocate_cache(CacheDesc(4, [16, 1 << 20], DataType.DT_UINT8, Placement.HOST))  # 64 MiB
    for t in cache.tensors:
        t[...] = 1
    ident = cm._registry.by_id(cache.cache_id).segment.identity  # a child: no helpers.internals here
    print(os.getpid(), ident.fd, ident.inode, ident.size, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def memfd_holders(inode: int) -> set[int]:
    """Pids of every process that has the memfd with ``inode`` open or mapped."""
    holders = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:") and \
                            os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode:
                        holders.add(int(pid))
                except OSError:
                    pass
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/memfd:") and int(fields[4]) == inode:
                        holders.add(int(pid))
                        break
        except OSError:
            pass  # the process went away or is not ours to inspect
    return holders


def _kill_owner_once() -> tuple[bool, str]:
    """One SIGKILL round; hard checks assert, the system-wide Shmem checks (noisy when other processes use
    shared memory at the same time) are returned as ``(ok, details)``."""
    shm_before = shm_entries()
    before = shmem_bytes()
    proc = spawn_child(_KILLED_CHILD)
    try:
        pid, fd, inode, size = map(int, read_line(proc).split())
        assert pid == proc.pid and size >= 64 * MiB
        link = f"/proc/{pid}/fd/{fd}"
        assert os.readlink(link).startswith("/memfd:aiodatadist")
        assert os.stat(link).st_ino == inode
        assert rss_shmem_bytes(pid) >= 64 * MiB
        assert memfd_holders(inode) == {pid}
        assert shm_entries() == shm_before
        during = shmem_bytes()
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        after = shmem_bytes()
    finally:
        stop_child(proc)
    assert not os.path.exists(f"/proc/{pid}")
    assert memfd_holders(inode) == set()  # nobody keeps the memory alive: the kernel has freed it
    assert shm_entries() == shm_before
    deadline = time.monotonic() + 10.0  # (the kernel frees the dead process's memory a moment later)
    while after - before >= 24 * MiB and time.monotonic() < deadline:
        time.sleep(0.05)
        after = shmem_bytes()
    ok = during - before >= 48 * MiB and during - after >= 40 * MiB and after - before < 24 * MiB
    return ok, f"Shmem before={before} during={during} after={after}"


def test_sigkilled_owner_leaves_nothing_behind() -> None:
    for _ in range(3):  # Shmem is system-wide: retry when other processes happened to move it meanwhile
        ok, details = _kill_owner_once()
        if ok:
            break
    assert ok, details


_PEER_CHILD = r"""
import asyncio, json, sys
import numpy as np
from aiodatadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement

async def main():
    dd = LLMDataDist(LLMRole.PROMPT, 4343)
    await dd.init(LLMConfig().generate_options())
    cm = dd.cache_manager
    cache = cm.allocate_blocks_cache(CacheDesc(3, [16, 4096], DataType.DT_UINT8, Placement.HOST))
    rng = np.random.default_rng(777)
    for t in cache.tensors:
        t[...] = rng.integers(1, 256, size=t.shape, dtype=np.uint8)
    seg = cm._registry.by_id(cache.cache_id).segment  # a child: no helpers.internals here
    i = seg.identity
    print(json.dumps({"pid": i.pid, "fd": i.fd, "inode": i.inode, "device": i.device, "size": i.size,
                      "offsets": [a - seg.address for a in cache.tensor_addrs]}), flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            ok = bool((cache.tensors[1][5] == 0xAB).all()) and bool((cache.tensors[1][4] != 0xAB).any())
            print("ok" if ok else "bad", flush=True)
        else:
            break
    await dd.finalize()

asyncio.run(main())
"""


def test_map_peer_segment_from_another_process() -> None:
    proc = spawn_child(_PEER_CHILD)
    try:
        info = json.loads(read_line(proc))
        ident = SegmentIdentity(info["pid"], info["fd"], info["inode"], info["device"], info["size"])
        assert ident.pid == proc.pid
        rng = np.random.default_rng(777)
        expected = [rng.integers(1, 256, size=(16, 4096), dtype=np.uint8) for _ in range(3)]
        mapping = map_peer_segment(ident)
        whole: np.ndarray | None = None
        try:
            whole = np.frombuffer(mapping, dtype=np.uint8)
            assert len(whole) >= ident.size
            for off, want in zip(info["offsets"], expected, strict=True):
                assert np.array_equal(whole[off:off + want.size].reshape(16, 4096), want)
            # the mapping is shared both ways: the owner sees what the peer writes
            block = info["offsets"][1] + 5 * 4096
            whole[block:block + 4096] = 0xAB
            assert proc.stdin is not None
            proc.stdin.write("check\n")
            proc.stdin.flush()
            assert read_line(proc) == "ok"
            # any identity that does not match the live segment is refused
            other_fd = os.memfd_create("aiodatadist-test-other")
            os.ftruncate(other_fd, ident.size)
            wrong = [
                SegmentIdentity(ident.pid, ident.fd, ident.inode + 1, ident.device, ident.size),
                SegmentIdentity(ident.pid, ident.fd, ident.inode, ident.device + 1, ident.size),
                SegmentIdentity(ident.pid, ident.fd, ident.inode, ident.device, ident.size + PAGE),
                SegmentIdentity(ident.pid, ident.fd + 1000, ident.inode, ident.device, ident.size),
                # our own process holds the peer's segment too (mmap keeps a dup of the descriptor), so the
                # wrong-pid case names one of our descriptors that is some other file
                SegmentIdentity(os.getpid(), other_fd, ident.inode, ident.device, ident.size),
            ]
            try:
                for bad in wrong:
                    with pytest.raises(OSError):
                        map_peer_segment(bad)
            finally:
                os.close(other_fd)
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            assert proc.wait(30) == 0
            # the owner is gone: its identity can no longer be mapped, but our mapping stays valid
            with pytest.raises(OSError):
                map_peer_segment(ident)
            assert np.array_equal(whole[info["offsets"][2]:][:16 * 4096].reshape(16, 4096), expected[2])
        finally:
            whole = None  # release the buffer export before unmapping
            mapping.close()
    finally:
        stop_child(proc)


def test_map_peer_segment_in_same_process() -> None:
    seg = SharedSegment(2 * PAGE)
    try:
        seg.array()[:] = 3
        mapping = map_peer_segment(seg.identity)
        view: np.ndarray | None = np.frombuffer(mapping, dtype=np.uint8)
        try:
            assert (view == 3).all()
            view[7] = 99
            assert seg.array()[7] == 99
        finally:
            view = None
            mapping.close()
        stale = seg.identity
    finally:
        seg.close()
    # a closed segment's descriptor number is either free or reused by another file: refused either way
    other = SharedSegment(2 * PAGE)
    try:
        with pytest.raises(OSError):
            map_peer_segment(stale)
    finally:
        other.close()
