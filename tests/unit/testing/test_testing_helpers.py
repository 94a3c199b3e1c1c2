"""The helpers of ``aiodatadist.testing`` that need no peer: ``assert_blocks_landed`` (byte-for-byte block checks
and their messages), ``wait_until``, and ``LeakCheck``'s report of descriptors and its allowances."""

from __future__ import annotations

import asyncio
import os
import re
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from aiodatadist import CacheDesc, CacheManager, DataType, Placement
from aiodatadist.cache import Cache
from aiodatadist.testing import Leak, LeakCheck, assert_blocks_landed, fill_pattern, pattern, wait_until

DESC = CacheDesc(3, (8, 64), DataType.DT_UINT8, Placement.HOST)


@pytest.fixture
def caches(cache_manager: CacheManager) -> Iterator[tuple[Cache, Cache]]:
    """A source filled with pattern bytes and a zeroed destination, both 3 tensors of 8 blocks of 64 bytes."""
    src, dst = cache_manager.allocate_blocks_cache(DESC), cache_manager.allocate_blocks_cache(DESC)
    fill_pattern(src, 7)
    for t in dst.tensors:
        t[...] = 0
    yield src, dst


def copy_blocks(src: Cache, dst: Cache, src_blocks: list[int], dst_blocks: list[int]) -> None:
    for s, d in zip(src.tensors, dst.tensors, strict=True):
        d[dst_blocks] = s[src_blocks]


class FakeServer:
    """Stands for a PromptServer: what ``expected`` gives."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    def expected(self, name: str = "kv", blocks: list[int] | None = None) -> list[np.ndarray]:
        assert name == "k"
        return [np.asarray(t)[blocks].copy() for t in self.cache.tensors]


# -- assert_blocks_landed ------------------------------------------------------------------------------------
def test_blocks_that_landed_pass_from_a_cache_a_server_or_the_rows(caches: tuple[Cache, Cache]) -> None:
    src, dst = caches
    copy_blocks(src, dst, [5, 0, 7], [1, 2, 3])
    assert_blocks_landed(dst, [1, 2, 3], src, [5, 0, 7])
    assert_blocks_landed(dst, [1, 2, 3], FakeServer(src), [5, 0, 7], name="k")
    rows = [pattern(7, t, DESC.size).reshape(8, 64)[[5, 0, 7]] for t in range(3)]
    assert_blocks_landed(dst, [1, 2, 3], rows)
    copy_blocks(src, dst, [4], [4])
    assert_blocks_landed(dst, [4], src)  # source_blocks defaults to the same blocks


def test_the_message_names_the_first_differing_block_tensor_and_byte(caches: tuple[Cache, Cache]) -> None:
    src, dst = caches
    copy_blocks(src, dst, [5, 0, 7], [1, 2, 3])
    dst.tensors[2][2, 37] ^= 0xFF  # block 2 (the second given), tensor 2, byte 37
    dst.tensors[1][3, 10:20] = 0  # block 3, later in the order given
    expected_byte = int(np.asarray(src.tensors[2])[0, 37])
    with pytest.raises(AssertionError) as info:
        assert_blocks_landed(dst, [1, 2, 3], src, [5, 0, 7])
    assert str(info.value) == (
        f"blocks did not land: block 2 (source block 0) of tensor 2 differs at byte offset 37 of the block "
        f"(offset {2 * 64 + 37} of the tensor): 0x{expected_byte ^ 0xFF:02x}, expected 0x{expected_byte:02x} "
        f"(1 of 64 bytes of that block differ); 2 of 3 blocks differ, in 2 of 3 tensors")
    with pytest.raises(AssertionError, match=r"block 2 \(row 1 of the expected rows\) of tensor 2"):
        assert_blocks_landed(dst, [1, 2, 3], [np.asarray(t)[[5, 0, 7]] for t in src.tensors])
    with pytest.raises(AssertionError, match=r"block 1 \(source block 1\) of tensor 0 differs at byte offset 0"):
        assert_blocks_landed(dst, [1], src)  # never written: zeros, and the pattern is never 0


def test_wrong_shapes_and_blocks_are_refused(cache_manager: CacheManager, caches: tuple[Cache, Cache]) -> None:
    src, dst = caches
    with pytest.raises(ValueError, match=r"blocks \[8\] are outside the cache's 8 blocks"):
        assert_blocks_landed(dst, [8], src, [0])
    with pytest.raises(ValueError, match=r"source_blocks \[-1\] are outside"):
        assert_blocks_landed(dst, [0], src, [-1])
    with pytest.raises(ValueError, match="2 blocks and 1 source_blocks"):
        assert_blocks_landed(dst, [0, 1], src, [0])
    with pytest.raises(ValueError, match="no blocks"):
        assert_blocks_landed(dst, [], src, [])
    with pytest.raises(ValueError, match="not with the expected rows"):
        assert_blocks_landed(dst, [0], [np.zeros((1, 64), np.uint8)] * 3, [0])
    with pytest.raises(ValueError, match="the cache has 3 tensors, the source 2"):
        assert_blocks_landed(dst, [0], [np.zeros((1, 64), np.uint8)] * 2)
    wider = cache_manager.allocate_blocks_cache(CacheDesc(3, (8, 128), DataType.DT_UINT8, Placement.HOST))
    with pytest.raises(ValueError, match="tensor 0: 1 blocks of 64 bytes here, 1 of 128 in the source"):
        assert_blocks_landed(dst, [0], wider)


# -- wait_until ----------------------------------------------------------------------------------------------
async def test_wait_until_returns_the_first_true_value_of_a_function_or_a_coroutine() -> None:
    calls: list[int] = []

    def later() -> int | None:
        calls.append(1)
        return len(calls) if len(calls) >= 3 else None

    assert await wait_until(later, interval=0.001) == 3

    async def at_once() -> str:
        return "yes"

    assert await wait_until(at_once) == "yes"


async def test_wait_until_times_out_naming_what_it_waited_for() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError, match=r"wait_until: the moon not true within 0.05 s"):
        await wait_until(lambda: False, 0.05, what="the moon")
    assert loop.time() - started < 5  # (it gave up: the predicate never holds)

    async def hangs() -> bool:
        await asyncio.sleep(10)
        return True

    with pytest.raises(TimeoutError, match="hangs not true"):  # an async predicate that never returns
        await wait_until(hangs, 0.05)
    with pytest.raises(ZeroDivisionError):
        await wait_until(lambda: 1 / 0)
    with pytest.raises(ValueError, match="must be > 0"):
        await wait_until(lambda: True, 0)


# -- LeakCheck: descriptors and allowances -------------------------------------------------------------------
@pytest.fixture
def kept() -> Iterator[list[object]]:
    """What a test leaks on purpose (closed after it)."""
    things: list[object] = []
    yield things
    for thing in things:
        if isinstance(thing, int):
            os.close(thing)
        elif isinstance(thing, socket.socket):
            thing.close()


def check() -> LeakCheck:
    leaks = LeakCheck(settle_s=0.0)
    leaks.start()
    return leaks


async def test_a_leaked_pipe_is_named_by_number_end_and_target(kept: list[object]) -> None:
    leaks = check()
    r, w = os.pipe()
    kept += [r, w]
    found = await leaks.leaks()
    assert [(leak.resource, leak.kind, leak.fd) for leak in found] == [("fd", "pipe", r), ("fd", "pipe", w)]
    inode = os.readlink(f"/proc/self/fd/{r}")
    report = leaks.report(found)
    assert report == ("the test left these behind:\n"
                      "  2 file descriptors:\n"
                      f"    fd {r}: pipe, read end ({inode}), no Python object holds it\n"
                      f"    fd {w}: pipe, write end ({inode}), no Python object holds it")


async def test_a_leaked_socket_is_named_with_its_addresses_and_holder(kept: list[object]) -> None:
    leaks = check()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    kept += [server, client]
    found = {leak.fd: leak for leak in await leaks.leaks()}
    port, local = server.getsockname()[1], client.getsockname()[1]
    listening, connected = found[server.fileno()], found[client.fileno()]
    assert listening.kind == connected.kind == "socket"
    assert listening.detail == f"tcp listening on 127.0.0.1:{port}"
    assert connected.detail == f"tcp 127.0.0.1:{local} -> 127.0.0.1:{port}"
    assert str(connected) == (f"fd {client.fileno()}: socket, tcp 127.0.0.1:{local} -> 127.0.0.1:{port} "
                              f"({connected.target}), held by socket.socket")
    client.sendall(b"still open")  # the look at it left the socket as it was
    accepted, _ = server.accept()
    kept.append(accepted)
    assert accepted.recv(100) == b"still open"


async def test_allowances_by_kind_count_and_predicate(kept: list[object]) -> None:
    leaks = check()
    leaks.allow("pipe", count=1)
    leaks.allow(lambda leak: leak.kind == "socket" and "listening" in leak.detail)
    r, w = os.pipe()
    server = socket.create_server(("127.0.0.1", 0))
    a, b = socket.socketpair()
    kept += [r, w, server, a, b]
    found = await leaks.leaks()
    assert [leak.fd for leak in found] == [w, a.fileno(), b.fileno()]  # one pipe end and the listener allowed
    assert all(leak.detail == "unix stream, unnamed, connected" for leak in found[1:])
    leaks.allow("fd")
    assert await leaks.leaks() == []
    await leaks.assert_clean()


async def test_allow_refuses_what_it_cannot_match() -> None:
    leaks = check()
    with pytest.raises(TypeError, match="a resource or kind"):
        leaks.allow(3)  # type: ignore[arg-type]
    for count in (-1, True, 1.5):
        with pytest.raises(ValueError, match="count must be None or an int"):
            leaks.allow("pipe", count)  # type: ignore[arg-type]


async def test_a_report_of_each_resource(kept: list[object]) -> None:
    leaks = check()
    r, w = os.pipe()
    kept += [r, w]
    leaks.allow(lambda leak: leak.fd == r)
    task = asyncio.create_task(asyncio.sleep(10), name="sleeper")
    try:
        found = await leaks.leaks()
        assert [leak.resource for leak in found] == ["fd", "task"]
        report = leaks.report(found + [Leak("thread", "thread", "worker"), Leak("thread", "thread", "worker")])
        lines = report.splitlines()
        assert lines[1:] == ["  2 threads: worker x2", "  1 file descriptor:",
                             f"    fd {w}: pipe, write end ({found[0].target}), no Python object holds it",
                             f"  1 pending task: sleeper ({task.get_coro().__qualname__})"]  # type: ignore[union-attr]
        with pytest.raises(AssertionError, match=re.escape(f"fd {w}: pipe, write end")):
            await leaks.assert_clean()
    finally:
        task.cancel()
