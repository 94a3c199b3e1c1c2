"""Host caches on the system's huge pages (``AIODATADIST_HUGE_PAGES``: ``try`` by default, ``on``, ``off``).

Where the system has reserved huge pages (``/proc/sys/vm/nr_hugepages``) and enough of them are free, a cache
segment lies on them, in this process and as a same-host peer maps it; where they are not, ``try`` gives ordinary
pages and ``on`` fails with ``LLM_OUT_OF_MEMORY`` leaving nothing behind.  Which pages a mapping got is read from
``/proc/<pid>/smaps``, not from the library.  Tests whose outcome depends on the pool check the outcome the pool
they find calls for (CI machines usually have no huge pages; a machine with some runs the other branch).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import numpy as np
import pytest
from helpers.data import fill_rows
from helpers.internals import registry_of
from hypothesis import given
from hypothesis import strategies as st

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.memory import SharedSegment, cache_segment
from aiodatadist.memory.segment import HUGE_WASTE, PAGE, huge_page_bytes, huge_segment_size
from aiodatadist.settings.environment import env_knobs_cache_clear
from aiodatadist.testing import PeerProcess, free_port

MiB = 1 << 20
HUGE = huge_page_bytes()


def meminfo(field: str) -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def free_huge_pages() -> int:
    return meminfo("HugePages_Free") - meminfo("HugePages_Rsvd")


def kernel_page_kib(address: int, pid: int | str = "self") -> int:
    """The page size (KiB) of the mapping of process ``pid`` that holds ``address``."""
    inside = False
    with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m[1], 16) <= address < int(m[2], 16)
            elif inside and line.startswith("KernelPageSize:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping of {address:#x} in process {pid}")


def mapped_page_kib(pid: int, inode: int) -> set[int]:
    """The page sizes (KiB) of process ``pid``'s mappings of the file with ``inode``."""
    sizes, inside = set(), False
    with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            fields = line.split()
            if re.match(r"[0-9a-f]+-[0-9a-f]+$", fields[0]):
                inside = len(fields) > 4 and fields[4] == str(inode)
            elif inside and line.startswith("KernelPageSize:"):
                sizes.add(int(fields[1]))
    return sizes


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def huge_pages(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Set ``AIODATADIST_HUGE_PAGES`` with ``.setenv``; forgotten afterwards."""
    monkeypatch.delenv("AIODATADIST_HUGE_PAGES", raising=False)
    yield monkeypatch
    env_knobs_cache_clear()


# -- the size rule --------------------------------------------------------------------------------------------
@given(size=st.integers(1, 1 << 40), mode=st.sampled_from(["try", "on", "off"]),
       page=st.sampled_from([0, PAGE, 2 * MiB, 1 << 30]))
def test_a_huge_segment_is_whole_pages_and_try_wastes_little(size: int, mode: str, page: int) -> None:
    rounded = huge_segment_size(size, mode, page)
    if mode == "off" or page <= PAGE:
        assert rounded is None
        return
    whole = -(-size // page) * page
    if mode == "on" or (whole - size) * HUGE_WASTE <= size:
        assert rounded == whole
    else:
        assert rounded is None
    if rounded is not None:
        assert rounded % page == 0 and size <= rounded < size + page


def test_the_size_rule_at_its_edges() -> None:
    page = 2 * MiB
    assert huge_segment_size(32 * MiB, "try", page) == 32 * MiB
    assert huge_segment_size(32 * MiB + 1, "try", page) == 34 * MiB  # 2 MiB - 1 of 32 MiB + 1: within 1/16
    assert huge_segment_size(30 * MiB + 1, "try", page) is None  # 2 MiB - 1 of 30 MiB + 1: more
    assert huge_segment_size(2 * MiB, "try", page) == 2 * MiB  # an exact multiple, however small
    assert huge_segment_size(3 * MiB, "try", page) is None
    assert huge_segment_size(3 * MiB, "on", page) == 4 * MiB
    assert huge_segment_size(1, "on", page) == 2 * MiB


def test_the_huge_page_size_is_read_from_meminfo(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "meminfo")
    for text, want in (("MemTotal: 1 kB\nHugepagesize:       2048 kB\n", 2 * MiB),
                       ("Hugepagesize:    1048576 kB\n", 1 << 30), ("MemTotal: 1 kB\n", 0),
                       ("Hugepagesize: lots kB\n", 0), ("", 0)):
        with open(path, "w", encoding="ascii") as f:
            f.write(text)
        assert huge_page_bytes(path) == want, text
    assert huge_page_bytes(os.path.join(tmp_path, "missing")) == 0


# -- segments -------------------------------------------------------------------------------------------------
def test_try_takes_huge_pages_where_free_and_ordinary_ones_elsewhere() -> None:
    size = 32 * MiB
    expect_huge = HUGE > PAGE and free_huge_pages() * HUGE >= size
    seg = SharedSegment(size, huge_pages="try")
    try:
        assert seg.page_size == (HUGE if expect_huge else PAGE)
        assert kernel_page_kib(seg.address) * 1024 == seg.page_size
        assert seg.size == size and seg.identity.size == size
        arr = seg.array()
        assert not arr[:: 4096].any()  # zero-filled
        data = np.random.default_rng(5).integers(1, 256, size=size, dtype=np.uint8)
        arr[:] = data
        assert np.array_equal(arr, data)
        del arr
    finally:
        seg.close()


def test_off_and_small_segments_stay_on_ordinary_pages() -> None:
    for size, mode in ((32 * MiB, "off"), (3 * MiB, "try"), (PAGE, "try")):
        seg = SharedSegment(size, huge_pages=mode)
        try:
            assert seg.page_size == PAGE and kernel_page_kib(seg.address) * 1024 == PAGE, (size, mode)
        finally:
            seg.close()


def test_an_unknown_mode_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="huge_pages"):
        SharedSegment(PAGE, huge_pages="yes")


def test_on_without_enough_huge_pages_fails_cleanly_and_try_falls_back() -> None:
    """A request bigger than the free pool: ``on`` refuses it (reserving fails, nothing is touched) with no
    descriptor left open; ``try`` gets ordinary pages where that is cheap to check."""
    pages = max(free_huge_pages(), 0) + 1
    size = pages * max(HUGE, 2 * MiB)
    fds = open_fds()
    with pytest.raises(LLMException) as info:
        SharedSegment(size, huge_pages="on")
    assert info.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
    assert "AIODATADIST_HUGE_PAGES" in str(info.value) and "nr_hugepages" in str(info.value)
    assert open_fds() == fds
    if size > 64 * MiB:
        pytest.skip("this machine has too many huge pages free to fall back cheaply")
    seg = SharedSegment(size, huge_pages="try")
    try:
        assert seg.page_size == PAGE and kernel_page_kib(seg.address) == PAGE // 1024
    finally:
        seg.close()


@pytest.mark.skipif(HUGE <= PAGE, reason="no huge pages on this system")
def test_closing_a_huge_segment_returns_its_pages() -> None:
    if free_huge_pages() < 4:
        pytest.skip("fewer than 4 huge pages free")
    before = free_huge_pages()
    seg = SharedSegment(4 * HUGE, huge_pages="on")
    assert seg.page_size == HUGE
    seg.array()[:] = 7
    assert free_huge_pages() == before - 4
    seg.close()
    assert free_huge_pages() == before


def test_cache_allocation_follows_the_variable(huge_pages: pytest.MonkeyPatch) -> None:
    size = 32 * MiB
    expect_huge = HUGE > PAGE and free_huge_pages() * HUGE >= size
    for mode, want in (("off", PAGE), ("try", HUGE if expect_huge else PAGE)):
        huge_pages.setenv("AIODATADIST_HUGE_PAGES", mode)
        seg = cache_segment(size, "aiodatadist-test")
        try:
            assert seg.page_size == want, mode
        finally:
            seg.close()


async def test_on_refuses_a_cache_and_the_manager_stays_usable(huge_pages: pytest.MonkeyPatch) -> None:
    pages = max(free_huge_pages(), 0) + 1
    block = max(HUGE, 2 * MiB)
    desc = CacheDesc(1, (pages, block), DataType.DT_UINT8, Placement.HOST)
    async with LLMDataDist(LLMRole.PROMPT, 91) as dd:
        await dd.init({})
        cm = dd.cache_manager
        huge_pages.setenv("AIODATADIST_HUGE_PAGES", "on")
        with pytest.raises(LLMException) as info:
            cm.allocate_blocks_cache(desc)
        assert info.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
        huge_pages.setenv("AIODATADIST_HUGE_PAGES", "try")
        small = CacheDesc(2, (4, 4096), DataType.DT_UINT8, Placement.HOST)
        cache = cm.allocate_blocks_cache(small)
        rows = fill_rows(cache, 3)
        assert np.array_equal(cache.tensors[1].view(np.uint8).reshape(4, -1), rows[1])
        cm.deallocate_blocks_cache(cache)


# -- between processes -----------------------------------------------------------------------------------------
async def test_a_peer_pulls_and_pushes_through_huge_pages_byte_exact() -> None:
    """This process owns a 32 MiB cache (on huge pages where free); a peer process links, maps it (with the same
    pages) and pulls and pushes scattered blocks of random bytes."""
    owner, peer_id, blocks, block = 93, 94, 64, 256 << 10  # 2 tensors x 64 x 256 KiB = 32 MiB
    expect_huge = HUGE > PAGE and free_huge_pages() * HUGE >= 2 * blocks * block * 2  # both processes' caches
    port = free_port()
    desc = CacheDesc(2, (blocks, block), DataType.DT_UINT8, Placement.HOST)
    peer = await PeerProcess.start()
    try:
        async with LLMDataDist(LLMRole.PROMPT, owner) as dd:
            await dd.init({"llm.listenIpInfo": f"127.0.0.1:{port}"})
            cache = dd.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(owner, 0))
            base = cache.tensor_addrs[0]
            assert kernel_page_kib(base) * 1024 == (HUGE if expect_huge else PAGE)
            rows = fill_rows(cache, 11)
            await peer.call("init", role="DECODER", cluster_id=peer_id, options={})
            assert (await peer.call("link", cluster_id=owner, port=port))[0] == LLMStatusCode.LLM_SUCCESS
            assert (await peer.call("links"))[0]["plane"] == "shm"
            mine = await peer.call("allocate", blocks=True, num_tensors=2, shape=[blocks, block])
            src, dst = [63, 0, 17, 40, 5], [1, 62, 30, 9, 44]
            key = {"type": "blocks", "cluster_id": owner, "model_id": 0}
            await peer.call("transfer", op="pull_blocks", cache_id=mine["cache_id"], key=key,
                            src_blocks=src, dst_blocks=dst)
            inode = os.fstat(_segment_fd(dd, cache.cache_id)).st_ino
            assert mapped_page_kib(peer.pid, inode) == {HUGE // 1024 if expect_huge else PAGE // 1024}
            for t in range(2):
                for s, d in zip(src, dst, strict=True):
                    got = bytes.fromhex(await peer.call("read", cache_id=mine["cache_id"], tensor=t,
                                                        offset=d * block, nbytes=block))
                    assert got == rows[t][s].tobytes(), (t, s, d)
            await peer.call("fill", cache_id=mine["cache_id"], seed=12)
            await peer.call("transfer", op="push_blocks", cache_id=mine["cache_id"], key=key,
                            src_blocks=[dst[0]], dst_blocks=[50])
            for t in range(2):
                pushed = bytes.fromhex(await peer.call("read", cache_id=mine["cache_id"], tensor=t,
                                                       offset=dst[0] * block, nbytes=block))
                assert cache.tensors[t].view(np.uint8).reshape(blocks, -1)[50].tobytes() == pushed
                assert np.array_equal(cache.tensors[t].view(np.uint8).reshape(blocks, -1)[49], rows[t][49])
    finally:
        await peer.close()


def _segment_fd(dd: LLMDataDist, cache_id: int) -> int:
    segment = registry_of(dd.cache_manager).by_id(cache_id).segment
    assert segment is not None and segment.fd is not None
    return segment.fd
