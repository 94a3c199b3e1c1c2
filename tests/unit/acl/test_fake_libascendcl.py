"""The emulated ACL runtime (``tests/helpers/fake_acl.py``, a named fake of ``libascendcl.so``) enforces the rules
CANN documents: each test builds on the fake through ctypes and asserts one group of them.  Pending work is kept
pending with the fake's gate (``fake_hold``), never with sleeps; tests that need a second process run
``sys.executable`` with a small command loop (``_CHILD``)."""

from __future__ import annotations

import ctypes
import itertools
import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers.fake_acl import build_fake_libascendcl

_vp, _sz, _u32, _i32, _u64, _int = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_int32,
                                    ctypes.c_uint64, ctypes.c_int)
_P = ctypes.POINTER

UNINITIALIZE, REPEAT_INITIALIZE, REPEAT_FINALIZE, INVALID_PARAM = 100001, 100002, 100037, 100000
API_NOT_SUPPORT, PARAM_INVALID, INVALID_DEVICEID, CONTEXT_NULL, STREAM_CONTEXT = 200001, 107000, 107001, 107002, 107003
FEATURE_NOT_SUPPORT, MEMORY_ALLOCATION, IPC_ERROR = 207000, 207001, 507022
STREAM_SYNC_TIMEOUT, EVENT_SYNC_TIMEOUT, DEVICE_MEM_ERROR = 507046, 507047, 507053
H2H, H2D, D2H, D2D, DEFAULT = 0, 1, 2, 3, 4
HUGE_FIRST, HUGE_ONLY, NORMAL_ONLY, HUGE_ONLY_P2P = 0, 1, 2, 4
LOC_HOST, LOC_DEVICE, LOC_UNREGISTERED = 0, 1, 2
PINNED, MAPPED = 0x10000000, 0x2
STOP_ON_FAILURE = 1
MiB = 1 << 20


class MemLocation(ctypes.Structure):
    _fields_ = [("id", _u32), ("type", _int)]


class BatchAttr(ctypes.Structure):
    _fields_ = [("dstLoc", MemLocation), ("srcLoc", MemLocation), ("rsv", ctypes.c_uint8 * 16)]


class PtrAttributes(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("pageSize", _u32), ("rsv", _u32 * 4)]


_SIGNATURES: dict[str, list[Any]] = {
    "aclInit": [ctypes.c_char_p], "aclFinalize": [], "aclFinalizeReference": [_P(_u64)],
    "aclrtGetVersion": [_P(_i32), _P(_i32), _P(_i32)], "aclsysGetVersionStr": [ctypes.c_char_p, ctypes.c_char_p],
    "aclrtGetDeviceCount": [_P(_u32)], "aclrtSetDevice": [_i32], "aclrtResetDevice": [_i32],
    "aclrtGetDevice": [_P(_i32)], "aclrtGetCurrentContext": [_P(_vp)], "aclrtSetCurrentContext": [_vp],
    "aclrtCreateContext": [_P(_vp), _i32], "aclrtDestroyContext": [_vp],
    "aclrtMalloc": [_P(_vp), _sz, _int], "aclrtFree": [_vp], "aclrtMallocHost": [_P(_vp), _sz],
    "aclrtFreeHost": [_vp], "aclrtHostRegisterV2": [_vp, _u64, _u32], "aclrtHostUnregister": [_vp],
    "aclrtPointerGetAttributes": [_vp, _P(PtrAttributes)], "aclrtMemGetAddressRange": [_vp, _P(_vp), _P(_sz)],
    "aclrtGetMemInfo": [_int, _P(_sz), _P(_sz)],
    "aclrtMemcpy": [_vp, _sz, _vp, _sz, _int], "aclrtMemcpyAsync": [_vp, _sz, _vp, _sz, _int, _vp],
    "aclrtMemcpy2dAsync": [_vp, _sz, _vp, _sz, _sz, _sz, _int, _vp],
    "aclrtMemcpyBatchAsync": [_P(_vp), _P(_sz), _P(_vp), _P(_sz), _sz, _P(BatchAttr), _P(_sz), _sz, _P(_sz), _vp],
    "aclrtCreateStream": [_P(_vp)], "aclrtCreateStreamWithConfig": [_P(_vp), _u32, _u32],
    "aclrtSetStreamFailureMode": [_vp, _u64], "aclrtStreamQuery": [_vp, _P(_int)],
    "aclrtSynchronizeStream": [_vp], "aclrtSynchronizeStreamWithTimeout": [_vp, _i32], "aclrtStreamAbort": [_vp],
    "aclrtDestroyStream": [_vp], "aclrtDestroyStreamForce": [_vp],
    "aclrtCreateEvent": [_P(_vp)], "aclrtCreateEventWithFlag": [_P(_vp), _u32],
    "aclrtCreateEventExWithFlag": [_P(_vp), _u32], "aclrtRecordEvent": [_vp, _vp],
    "aclrtQueryEventStatus": [_vp, _P(_int)], "aclrtQueryEvent": [_vp, _P(_int)], "aclrtSynchronizeEvent": [_vp],
    "aclrtSynchronizeEventWithTimeout": [_vp, _i32], "aclrtDestroyEvent": [_vp],
    "aclrtIpcMemGetExportKey": [_vp, _sz, ctypes.c_char_p, _sz, _u64],
    "aclrtIpcMemSetImportPid": [ctypes.c_char_p, _P(_i32), _sz],
    "aclrtIpcMemImportByKey": [_P(_vp), ctypes.c_char_p, _u64], "aclrtIpcMemClose": [ctypes.c_char_p],
    "aclrtDeviceGetBareTgid": [_P(_i32)],
}


class Acl:
    """The fake through ctypes, with small helpers that assert success."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            f = getattr(self.lib, name)
            f.argtypes, f.restype = argtypes, ctypes.c_int
        self.lib.aclGetRecentErrMsg.argtypes, self.lib.aclGetRecentErrMsg.restype = [], ctypes.c_char_p
        self.lib.fake_fault.argtypes, self.lib.fake_reset.argtypes = [ctypes.c_int], []

    def __getattr__(self, name: str) -> Callable[..., int]:
        return getattr(self.lib, name)  # type: ignore[no-any-return]

    def message(self) -> str:
        text = self.lib.aclGetRecentErrMsg()
        return text.decode() if text else ""

    def ok(self, result: int) -> None:
        assert result == 0, f"{result}: {self.message()}"

    def counter(self, name: str) -> int:
        return ctypes.c_int.in_dll(self.lib, name).value

    @contextmanager
    def hold(self) -> Iterator[None]:
        gate = ctypes.c_int.in_dll(self.lib, "fake_hold")
        gate.value = 1
        try:
            yield
        finally:
            gate.value = 0

    def release(self) -> None:
        ctypes.c_int.in_dll(self.lib, "fake_hold").value = 0

    def malloc(self, n: int, policy: int = NORMAL_ONLY) -> int:
        p = _vp()
        self.ok(self.aclrtMalloc(ctypes.byref(p), n, policy))
        return p.value or 0

    def malloc_host(self, n: int) -> int:
        p = _vp()
        self.ok(self.aclrtMallocHost(ctypes.byref(p), n))
        return p.value or 0

    def stream(self, stop_on_failure: bool = False) -> int:
        s = _vp()
        self.ok(self.aclrtCreateStream(ctypes.byref(s)))
        if stop_on_failure:
            self.ok(self.aclrtSetStreamFailureMode(s, STOP_ON_FAILURE))
        return s.value or 0

    def event(self) -> int:
        e = _vp()
        self.ok(self.aclrtCreateEventExWithFlag(ctypes.byref(e), 0))
        return e.value or 0

    def write(self, dev: int, data: bytes) -> None:
        self.ok(self.aclrtMemcpy(dev, len(data), data, len(data), H2D))

    def read(self, dev: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        self.ok(self.aclrtMemcpy(buf, n, dev, n, D2H))
        return buf.raw

    def attributes(self, ptr: int) -> tuple[int, int, int]:
        a = PtrAttributes()
        self.ok(self.aclrtPointerGetAttributes(ptr, ctypes.byref(a)))
        return a.location.type, a.location.id, a.pageSize

    def address_range(self, ptr: int) -> tuple[int, tuple[int, int]]:
        base, size = _vp(), _sz()
        result = self.aclrtMemGetAddressRange(ptr, ctypes.byref(base), ctypes.byref(size))
        return result, (base.value or 0, size.value)

    def query_event(self, e: int) -> tuple[int, int]:
        """(aclrtQueryEventStatus's status, the deprecated aclrtQueryEvent's)."""
        new, old = _int(-1), _int(-1)
        self.ok(self.aclrtQueryEventStatus(e, ctypes.byref(new)))
        self.ok(self.aclrtQueryEvent(e, ctypes.byref(old)))
        return new.value, old.value

    def query_stream(self, s: int) -> tuple[int, int]:
        status = _int(77)
        result = self.aclrtStreamQuery(s, ctypes.byref(status))
        return result, status.value

    def export(self, ptr: int, n: int, flags: int = 0) -> bytes:
        key = ctypes.create_string_buffer(65)
        self.ok(self.aclrtIpcMemGetExportKey(ptr, n, key, 65, flags))
        return key.value

    def whitelist(self, key: bytes, *pids: int) -> None:
        self.ok(self.aclrtIpcMemSetImportPid(key, (_i32 * len(pids))(*pids), len(pids)))


def on_thread(fn: Callable[[], Any]) -> Any:
    """fn's result, run on a new thread (which has no current context)."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 -- re-raised on the test's thread
            errors.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join(60)
    if errors:
        raise errors[0]
    return out[0]


def pinned_bytes(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)


def fill(ptr: int, data: bytes) -> None:
    ctypes.memmove(ptr, data, len(data))


# -- fixtures --------------------------------------------------------------------------------------------------------

_copies = itertools.count()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_fake_libascendcl(tmp_path_factory.mktemp("fake-acl"))
    if path is None:
        pytest.skip("no C compiler for the emulated ACL runtime")
    return path


@pytest.fixture(scope="module")
def acl(built: Path) -> Acl:
    """The fake, initialised, with device 0 set on the test thread."""
    a = Acl(built)
    a.ok(a.aclInit(None))
    a.ok(a.aclrtSetDevice(0))
    return a


@pytest.fixture(autouse=True)
def _no_leftover_hooks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "acl" in request.fixturenames:
        a: Acl = request.getfixturevalue("acl")
        a.release()
        a.fake_reset()


@pytest.fixture
def fresh(built: Path, tmp_path: Path) -> Callable[..., Acl]:
    """A separate instance of the fake (a copy of the library: its own state), loaded with env set, not yet
    initialised."""

    def load(**env: str) -> Acl:
        folder = tmp_path / f"copy{next(_copies)}"
        folder.mkdir()
        shutil.copy(built, folder / "libascendcl.so")
        return Acl(folder / "libascendcl.so")

    return load


@contextmanager
def environ(**env: str) -> Iterator[None]:
    """Set env for the block (the fake reads most knobs at each use); only while no stream task runs, as
    ``setenv`` is not safe against a worker's ``getenv``."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_page_buffers: list[mmap.mmap] = []


def page_aligned(n: int) -> int:
    """The address of n bytes of page-aligned pageable host memory (kept for the session)."""
    m = mmap.mmap(-1, n)
    _page_buffers.append(m)
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


# -- init, contexts ------------------------------------------------------------------------------------------------


def test_init_finalize_and_versions(fresh: Callable[..., Acl]) -> None:
    a = fresh()
    p, n, tgid = _vp(), _u32(), _i32()
    assert a.aclrtSetDevice(0) == UNINITIALIZE
    assert a.aclrtGetDeviceCount(ctypes.byref(n)) == UNINITIALIZE
    assert a.aclrtMalloc(ctypes.byref(p), 64, NORMAL_ONLY) == UNINITIALIZE
    assert a.aclrtDeviceGetBareTgid(ctypes.byref(tgid)) == UNINITIALIZE
    assert "aclInit" in a.message()
    major, minor, patch = _i32(), _i32(), _i32()
    a.ok(a.aclrtGetVersion(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch)))
    assert (major.value, minor.value, patch.value) == (1, 17, 0)
    text = ctypes.create_string_buffer(128)
    a.ok(a.aclsysGetVersionStr(b"runtime", text))
    assert text.value == b"9.0.0"

    a.ok(a.aclInit(None))
    assert a.aclInit(None) == REPEAT_INITIALIZE
    a.ok(a.aclrtGetDeviceCount(ctypes.byref(n)))
    assert n.value == 2
    count = _u64(99)
    a.ok(a.aclFinalizeReference(ctypes.byref(count)))
    assert count.value == 1  # two inits, one given back
    a.ok(a.aclrtSetDevice(1))
    assert a.aclrtSetDevice(2) == INVALID_DEVICEID
    a.ok(a.aclFinalize())
    assert a.aclrtMalloc(ctypes.byref(p), 64, NORMAL_ONLY) == UNINITIALIZE
    assert a.aclrtSetDevice(0) == UNINITIALIZE
    assert a.aclFinalize() == REPEAT_FINALIZE


def test_init_knob_and_version_8(fresh: Callable[..., Acl], acl: Acl) -> None:
    stub = fresh()
    with environ(FAKE_ACL_INIT="100039"):
        assert stub.aclInit(None) == 100039
    assert stub.aclrtSetDevice(0) == UNINITIALIZE  # nothing works
    with environ(FAKE_ACL_DEVICES="3"):
        three = fresh()
        three.ok(three.aclInit(None))
    n = _u32()
    three.ok(three.aclrtGetDeviceCount(ctypes.byref(n)))
    assert n.value == 3
    ptr = acl.malloc(64)
    with environ(FAKE_ACL_VERSION="8"):
        major, minor, patch = _i32(), _i32(), _i32()
        acl.ok(acl.aclrtGetVersion(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch)))
        assert (major.value, minor.value) == (1, 16)
        text = ctypes.create_string_buffer(128)
        acl.ok(acl.aclsysGetVersionStr(b"runtime", text))
        assert text.value == b"8.5.0"
        assert acl.address_range(ptr)[0] == API_NOT_SUPPORT
    assert acl.address_range(ptr) == (0, (ptr, 96))
    acl.ok(acl.aclrtFree(ptr))


def test_a_thread_without_a_context_gets_107002(acl: Acl) -> None:
    ptr, s, e = acl.malloc(64), acl.stream(), acl.event()
    main_ctx = _vp()
    acl.ok(acl.aclrtGetCurrentContext(ctypes.byref(main_ctx)))
    calls_before = acl.counter("fake_set_device_calls")

    def fresh_thread() -> dict[str, Any]:
        p, status, ctx, a = _vp(), _int(), _vp(), PtrAttributes()
        base, size = _vp(), _sz()
        host = ctypes.create_string_buffer(64)
        before = {
            "malloc": acl.aclrtMalloc(ctypes.byref(p), 64, NORMAL_ONLY),
            "free": acl.aclrtFree(ptr),
            "stream": acl.aclrtCreateStream(ctypes.byref(p)),
            "query_event": acl.aclrtQueryEventStatus(e, ctypes.byref(status)),
            "query_stream": acl.aclrtStreamQuery(s, ctypes.byref(status)),
            "sync_stream": acl.aclrtSynchronizeStream(s),
            "sync_event": acl.aclrtSynchronizeEvent(e),
            "record": acl.aclrtRecordEvent(e, s),
            "copy": acl.aclrtMemcpyAsync(ptr, 64, host, 64, H2D, s),
            "memcpy": acl.aclrtMemcpy(host, 64, ptr, 64, D2H),
            "attributes": acl.aclrtPointerGetAttributes(ptr, ctypes.byref(a)),
            "range": acl.aclrtMemGetAddressRange(ptr, ctypes.byref(base), ctypes.byref(size)),
            "context": acl.aclrtGetCurrentContext(ctypes.byref(ctx)),
            "malloc_host": acl.aclrtMallocHost(ctypes.byref(p), 64),
        }
        message = acl.message()
        acl.ok(acl.aclrtSetDevice(0))
        acl.ok(acl.aclrtQueryEventStatus(e, ctypes.byref(status)))
        acl.ok(acl.aclrtGetCurrentContext(ctypes.byref(ctx)))
        mine = acl.malloc(64)
        acl.ok(acl.aclrtFree(mine))
        return {"before": before, "message": message, "context": ctx.value}

    out = on_thread(fresh_thread)
    assert out["before"] == {name: CONTEXT_NULL for name in out["before"]}
    assert "no current context" in out["message"]
    assert out["context"] == main_ctx.value  # the default context is shared by the threads
    assert acl.counter("fake_set_device_calls") == calls_before + 1

    def other_device() -> tuple[int, int]:
        acl.ok(acl.aclrtSetDevice(1))
        status = _int()
        return acl.aclrtStreamQuery(s, ctypes.byref(status)), acl.aclrtRecordEvent(e, s)

    assert on_thread(other_device) == (STREAM_CONTEXT, STREAM_CONTEXT)  # s is device 0's

    def explicit_context() -> tuple[int, int, int]:
        ctx = _vp()
        acl.ok(acl.aclrtCreateContext(ctypes.byref(ctx), 1))
        dev = _i32()
        acl.ok(acl.aclrtGetDevice(ctypes.byref(dev)))
        acl.ok(acl.aclrtDestroyContext(ctx))
        status = _int()
        return dev.value, acl.aclrtQueryEventStatus(e, ctypes.byref(status)), acl.aclrtSetCurrentContext(ctx)

    assert on_thread(explicit_context) == (1, CONTEXT_NULL, PARAM_INVALID)
    acl.ok(acl.aclrtDestroyStream(s))
    acl.ok(acl.aclrtDestroyEvent(e))
    acl.ok(acl.aclrtFree(ptr))


# -- memory -------------------------------------------------------------------------------------------------------


def test_malloc_alignment_fill_and_rounding(acl: Acl) -> None:
    small = acl.malloc(100, NORMAL_ONLY)
    assert small % 4096 == 0
    assert acl.address_range(small) == (0, (small, 160))  # 100 -> 128, plus 32
    assert acl.read(small, 160) == b"\xa5" * 160  # not zeroed
    assert acl.attributes(small) == (LOC_DEVICE, 0, 4096)
    assert acl.attributes(small + 150) == (LOC_DEVICE, 0, 4096)
    assert acl.address_range(small + 150) == (0, (small, 160))

    big = acl.malloc(3 * MiB, HUGE_FIRST)
    assert big % (2 * MiB) == 0
    assert acl.attributes(big + MiB) == (LOC_DEVICE, 0, 2 * MiB)
    assert acl.address_range(big + MiB) == (0, (big, 3 * MiB + 32))
    one_mib = acl.malloc(MiB, HUGE_FIRST)  # huge pages only above 1 MiB
    assert acl.attributes(one_mib)[2] == 4096
    tiny_huge = acl.malloc(64, HUGE_ONLY)
    assert tiny_huge % (2 * MiB) == 0
    assert acl.attributes(tiny_huge)[2] == 2 * MiB
    p2p = acl.malloc(64, HUGE_ONLY_P2P)
    assert p2p % (2 * MiB) == 0
    p = _vp()
    assert acl.aclrtMalloc(ctypes.byref(p), 64, 6) == INVALID_PARAM
    assert acl.aclrtMalloc(ctypes.byref(p), 64, 0x100) == INVALID_PARAM
    assert acl.aclrtMalloc(ctypes.byref(p), 0, NORMAL_ONLY) == INVALID_PARAM
    assert acl.aclrtFree(small + 32) == PARAM_INVALID  # not an allocation's start

    host = acl.malloc_host(1000)
    assert acl.attributes(host) == (LOC_HOST, 0, 4096)
    assert acl.address_range(host + 10) == (0, (host, 1000))
    pageable = ctypes.create_string_buffer(64)
    assert acl.attributes(ctypes.addressof(pageable))[0] == LOC_UNREGISTERED
    assert acl.address_range(ctypes.addressof(pageable))[0] == PARAM_INVALID
    for ptr in (small, big, one_mib, tiny_huge, p2p):
        acl.ok(acl.aclrtFree(ptr))
    acl.ok(acl.aclrtFreeHost(host))
    assert acl.attributes(small)[0] == LOC_UNREGISTERED


def test_memory_limit_and_info(fresh: Callable[..., Acl]) -> None:
    a = fresh()
    a.ok(a.aclInit(None))
    a.ok(a.aclrtSetDevice(0))
    with environ(FAKE_ACL_MEM_LIMIT=str(4 * MiB)):
        free, total = _sz(), _sz()
        a.ok(a.aclrtGetMemInfo(1, ctypes.byref(free), ctypes.byref(total)))
        assert (free.value, total.value) == (4 * MiB, 4 * MiB)
        ptr = a.malloc(3 * MiB, HUGE_ONLY)
        a.ok(a.aclrtGetMemInfo(1, ctypes.byref(free), ctypes.byref(total)))
        assert free.value == MiB - 32
        p = _vp()
        assert a.aclrtMalloc(ctypes.byref(p), MiB, NORMAL_ONLY) == MEMORY_ALLOCATION
        a.ok(a.aclrtSetDevice(1))  # the limit is per device
        other = a.malloc(MiB, NORMAL_ONLY)
        a.ok(a.aclrtFree(other))
        a.ok(a.aclrtSetDevice(0))
        a.ok(a.aclrtFree(ptr))
    free, total = _sz(), _sz()
    a.ok(a.aclrtGetMemInfo(1, ctypes.byref(free), ctypes.byref(total)))
    assert total.value == 16 << 30


def test_host_register(acl: Acl) -> None:
    base = page_aligned(64 * 1024)
    assert acl.aclrtHostRegisterV2(base + 64, 4096, PINNED) == INVALID_PARAM  # not 4 KiB aligned
    assert acl.aclrtHostRegisterV2(base, 4096, 0) == INVALID_PARAM
    assert acl.aclrtHostRegisterV2(base, 4096, 0x4) == INVALID_PARAM
    acl.ok(acl.aclrtHostRegisterV2(base, 16 * 1024, PINNED))
    assert acl.attributes(base + 100) == (LOC_HOST, 0, 4096)
    assert acl.attributes(base + 16 * 1024)[0] == LOC_UNREGISTERED
    assert acl.aclrtHostRegisterV2(base + 8192, 16 * 1024, PINNED) == PARAM_INVALID  # overlaps
    acl.ok(acl.aclrtHostRegisterV2(base + 32 * 1024, 4096, MAPPED))
    assert acl.aclrtHostUnregister(base + 4096) == PARAM_INVALID
    acl.ok(acl.aclrtHostUnregister(base))
    acl.ok(acl.aclrtHostUnregister(base + 32 * 1024))
    assert acl.aclrtHostUnregister(base) == PARAM_INVALID
    with environ(FAKE_ACL_NO_HOST_REGISTER_V2="1"):
        assert acl.aclrtHostRegisterV2(base, 4096, PINNED) == FEATURE_NOT_SUPPORT


# -- copies -------------------------------------------------------------------------------------------------------


def test_async_copies_from_pageable_memory_run_in_the_call(acl: Acl) -> None:
    s, dev = acl.stream(), acl.malloc(4096)
    data = os.urandom(4096)
    pageable = ctypes.create_string_buffer(data, 4096)
    sync0, async0 = acl.counter("fake_sync_copies"), acl.counter("fake_async_copies")
    with acl.hold():
        acl.ok(acl.aclrtMemcpyAsync(dev, 4096, pageable, 4096, H2D, s))
        assert acl.counter("fake_sync_copies") == sync0 + 1  # ran here, despite the gate
        assert acl.query_stream(s) == (0, 0)  # nothing queued: COMPLETE
        assert acl.read(dev, 4096) == data

        pinned = acl.malloc_host(4096)
        second = os.urandom(4096)
        fill(pinned, second)
        acl.ok(acl.aclrtMemcpyAsync(dev, 4096, pinned, 4096, H2D, s))
        assert acl.counter("fake_async_copies") == async0 + 1
        assert acl.query_stream(s) == (0, 1)  # NOT_READY: held
        assert acl.read(dev, 4096) == data  # not copied yet
    acl.ok(acl.aclrtSynchronizeStream(s))
    assert acl.read(dev, 4096) == second

    # a pageable copy waits for what the stream has queued: the queued copy cannot land after it
    first = os.urandom(4096)
    fill(pinned, first)
    gate = ctypes.c_int.in_dll(acl.lib, "fake_hold")
    gate.value = 1
    acl.ok(acl.aclrtMemcpyAsync(dev, 4096, pinned, 4096, H2D, s))
    timer = threading.Timer(0.05, acl.release)
    timer.start()
    last = os.urandom(4096)
    acl.ok(acl.aclrtMemcpyAsync(dev, 4096, ctypes.create_string_buffer(last, 4096), 4096, H2D, s))
    timer.join()
    acl.ok(acl.aclrtSynchronizeStream(s))
    assert acl.read(dev, 4096) == last

    other = acl.malloc(4096)
    acl.ok(acl.aclrtMemcpyAsync(other, 4096, dev, 4096, D2D, s))  # device to device: queued
    acl.ok(acl.aclrtMemcpyAsync(pinned, 4096, other, 4096, DEFAULT, s))  # kind deduced: D2H, page-locked
    assert acl.counter("fake_async_copies") == async0 + 4
    acl.ok(acl.aclrtSynchronizeStream(s))
    assert pinned_bytes(pinned, 4096) == last

    host2 = ctypes.create_string_buffer(64)
    assert acl.aclrtMemcpyAsync(host2, 64, pageable, 64, H2H, s) == FEATURE_NOT_SUPPORT
    acl.ok(acl.aclrtMemcpy(host2, 64, pageable, 64, H2H))  # synchronous host copies are fine
    assert acl.aclrtMemcpyAsync(dev, 64, pageable, 128, H2D, s) == INVALID_PARAM  # count > destMax
    assert acl.aclrtMemcpyAsync(dev, 64, other, 64, H2D, s) == PARAM_INVALID  # src is device memory
    assert acl.aclrtMemcpyAsync(pageable, 64, pinned, 64, D2H, s) == PARAM_INVALID  # src is host memory
    assert acl.aclrtMemcpyAsync(dev + 4000, 4096, pinned, 4096, H2D, s) == PARAM_INVALID
    assert "runs past the end" in acl.message()
    assert acl.aclrtMemcpyAsync(dev, 4096, pinned, 4096, 7, s) == INVALID_PARAM
    acl.ok(acl.aclrtDestroyStream(s))
    acl.ok(acl.aclrtFreeHost(pinned))
    acl.ok(acl.aclrtFree(dev))
    acl.ok(acl.aclrtFree(other))


def _batch(acl: Acl, dsts: list[int], srcs: list[int], sizes: list[int], attrs: list[tuple[int, int, int, int]],
           indexes: list[int] | None, s: int, dmaxs: list[int] | None = None) -> tuple[int, int]:
    """aclrtMemcpyBatchAsync: (result, failIndex); attrs as (dst type, dst id, src type, src id)."""
    n = len(dsts)
    indexes = [0] if indexes is None else indexes
    arr = (BatchAttr * max(len(attrs), 1))()
    for a, (dt, di, st, si) in zip(arr, attrs, strict=False):
        a.dstLoc.type, a.dstLoc.id, a.srcLoc.type, a.srcLoc.id = dt, di, st, si
    fail = _sz(12345)
    result = acl.aclrtMemcpyBatchAsync((_vp * max(n, 1))(*dsts), (_sz * max(n, 1))(*(dmaxs or sizes)),
                                       (_vp * max(n, 1))(*srcs), (_sz * max(n, 1))(*sizes), n, arr,
                                       (_sz * max(len(indexes), 1))(*indexes), len(attrs), ctypes.byref(fail), s)
    return result, fail.value


H2D_ATTR = (LOC_DEVICE, 0, LOC_HOST, 0)
D2H_ATTR = (LOC_HOST, 0, LOC_DEVICE, 0)


def test_batch_one_direction_and_fail_index(acl: Acl) -> None:
    s, dev, pinned = acl.stream(), acl.malloc(8192), acl.malloc_host(8192)
    d, h = [dev, dev + 1024, dev + 2048], [pinned, pinned + 1024, pinned + 2048]
    sizes = [512, 512, 512]
    mixed = _batch(acl, [d[0], d[1], h[2]], [h[0], h[1], d[2]], sizes, [H2D_ATTR], None, s)
    assert mixed == (INVALID_PARAM, 2)
    assert "one direction" in acl.message()
    assert _batch(acl, [d[0], d[1]], [h[0], d[2]], sizes[:2], [H2D_ATTR], None, s) == (INVALID_PARAM, 1)  # D2D
    assert _batch(acl, d, h, sizes, [D2H_ATTR], None, s) == (INVALID_PARAM, 0)  # attrs disagree
    assert _batch(acl, d, h, sizes, [H2D_ATTR, D2H_ATTR], [0, 2], s) == (INVALID_PARAM, 2)  # entry 2 uses attrs[1]
    assert _batch(acl, d, h, sizes, [(LOC_DEVICE, 1, LOC_HOST, 0)], None, s) == (INVALID_PARAM, 0)  # wrong device
    assert _batch(acl, d, h, sizes, [H2D_ATTR], [1], s)[0] == INVALID_PARAM  # attrsIndexes[0] != 0
    assert _batch(acl, d, h, sizes, [H2D_ATTR, H2D_ATTR], [0, 0], s)[0] == INVALID_PARAM  # not increasing
    assert _batch(acl, d[:1], h[:1], sizes[:1], [H2D_ATTR, H2D_ATTR], [0, 1], s)[0] == INVALID_PARAM  # numAttrs > n
    assert _batch(acl, [], [], [], [H2D_ATTR], None, s)[0] == INVALID_PARAM  # numBatches 0
    past = _batch(acl, [d[0], dev + 8000], h[:2], [512, 512], [H2D_ATTR], None, s)
    assert past == (PARAM_INVALID, 1)
    assert _batch(acl, d, h, sizes, [H2D_ATTR], None, s, dmaxs=[512, 100, 512]) == (INVALID_PARAM, 1)
    batches = acl.counter("fake_batches")
    assert _batch(acl, d, h, sizes, [H2D_ATTR, H2D_ATTR], [0, 2], s) == (0, 2**64 - 1)
    assert acl.counter("fake_batches") == batches + 1
    acl.ok(acl.aclrtSynchronizeStream(s))  # nothing in flight while the environment changes
    with environ(FAKE_ACL_NO_BATCH="1"):
        assert _batch(acl, d, h, sizes, [H2D_ATTR], None, s)[0] == FEATURE_NOT_SUPPORT
    acl.ok(acl.aclrtDestroyStream(s))
    acl.ok(acl.aclrtFree(dev))
    acl.ok(acl.aclrtFreeHost(pinned))


def test_batch_copies_disjoint_spans_exactly_in_any_order(acl: Acl) -> None:
    rng = random.Random(7)
    s, total = acl.stream(), 256 * 1024
    dev, src, back = acl.malloc(total), acl.malloc_host(total), acl.malloc_host(total)
    data = rng.randbytes(total)
    fill(src, data)
    fill(back, b"\0" * total)
    cuts = sorted(rng.sample(range(1, total), 63))
    spans = [(a, b - a) for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    order = list(range(len(spans)))
    rng.shuffle(order)  # device layout: the chunks in another order
    dev_off, at = {}, 0
    for i in order:
        dev_off[i], at = at, at + spans[i][1]
    dsts = [dev + dev_off[i] for i in range(len(spans))]
    srcs = [src + off for off, _ in spans]
    sizes = [n for _, n in spans]
    async0, batches = acl.counter("fake_async_copies"), acl.counter("fake_batches")
    assert _batch(acl, dsts, srcs, sizes, [H2D_ATTR], None, s)[0] == 0
    assert _batch(acl, [back + off for off, _ in spans], dsts, sizes, [D2H_ATTR], None, s)[0] == 0
    assert acl.counter("fake_async_copies") == async0 + 2  # one task per batch
    assert acl.counter("fake_batches") == batches + 2
    acl.ok(acl.aclrtSynchronizeStream(s))
    assert pinned_bytes(back, total) == data
    device = acl.read(dev, total)
    for i, (off, n) in enumerate(spans):
        assert device[dev_off[i]:dev_off[i] + n] == data[off:off + n]

    # overlapping destinations: the batch is unordered, and the fake runs it backwards
    assert _batch(acl, [dev, dev], [src, src + 4096], [4096, 4096], [H2D_ATTR], None, s)[0] == 0
    acl.ok(acl.aclrtSynchronizeStream(s))
    assert acl.read(dev, 4096) == data[:4096]
    # pageable host memory: the batch runs in the call
    sync0 = acl.counter("fake_sync_copies")
    pageable = ctypes.create_string_buffer(data[:4096], 4096)
    assert _batch(acl, [dev + 8192], [ctypes.addressof(pageable)], [4096], [H2D_ATTR], None, s)[0] == 0
    assert acl.counter("fake_sync_copies") == sync0 + 1
    acl.ok(acl.aclrtDestroyStream(s))
    acl.ok(acl.aclrtFree(dev))
    acl.ok(acl.aclrtFreeHost(src))
    acl.ok(acl.aclrtFreeHost(back))


def test_2d_copies_and_their_limits(acl: Acl) -> None:
    s, dev, pinned = acl.stream(), acl.malloc(4096), acl.malloc_host(1 << 20)
    rows = os.urandom(4 * 32)
    fill(pinned, rows)
    acl.ok(acl.aclrtMemcpy2dAsync(dev, 64, pinned, 32, 16, 4, H2D, s))
    acl.ok(acl.aclrtSynchronizeStream(s))
    got = acl.read(dev, 256)
    for r in range(4):
        assert got[r * 64:r * 64 + 16] == rows[r * 32:r * 32 + 16]
        assert got[r * 64 + 16:r * 64 + 64] == b"\xa5" * 48
    assert acl.aclrtMemcpy2dAsync(dev, 16, pinned, 32, 32, 4, H2D, s) == INVALID_PARAM  # width > dpitch
    assert acl.aclrtMemcpy2dAsync(dev, 64, pinned, 16, 32, 4, H2D, s) == INVALID_PARAM  # width > spitch
    assert acl.aclrtMemcpy2dAsync(dev, 6_000_000, pinned, 6_000_000, 5_000_001, 1, H2D, s) == INVALID_PARAM
    assert acl.aclrtMemcpy2dAsync(dev, 64, pinned, 64, 16, 5_242_881, H2D, s) == INVALID_PARAM
    assert acl.aclrtMemcpy2dAsync(dev, 64, pinned, 64, 16, 4, H2H, s) == INVALID_PARAM
    assert acl.aclrtMemcpy2dAsync(dev, 64, pinned, 64, 16, 4, DEFAULT, s) == INVALID_PARAM
    assert acl.aclrtMemcpy2dAsync(dev, 1030, pinned, 64, 16, 5, H2D, s) == PARAM_INVALID  # row 4 past the end
    other = acl.malloc(4096)
    acl.ok(acl.aclrtMemcpy2dAsync(other, 32, dev, 64, 16, 4, D2D, s))
    acl.ok(acl.aclrtSynchronizeStream(s))
    assert acl.read(other, 16) == rows[:16]
    acl.ok(acl.aclrtDestroyStream(s))
    for ptr in (dev, other):
        acl.ok(acl.aclrtFree(ptr))
    acl.ok(acl.aclrtFreeHost(pinned))


# -- streams and events ---------------------------------------------------------------------------------------------


def test_stop_on_failure_discards_later_tasks_until_abort(acl: Acl) -> None:
    s, dev, pinned = acl.stream(stop_on_failure=True), acl.malloc(4096), acl.malloc_host(4096)
    e, late = acl.event(), acl.event()
    with acl.hold():
        acl.ok(acl.aclrtMemcpyAsync(dev, 4096, pinned, 4096, H2D, s))
        acl.ok(acl.aclrtRecordEvent(e, s))
        acl.fake_fault(DEVICE_MEM_ERROR)
    assert acl.aclrtSynchronizeStream(s) == DEVICE_MEM_ERROR
    assert f"task failed with {DEVICE_MEM_ERROR} on stream" in acl.message()
    assert acl.query_stream(s) == (DEVICE_MEM_ERROR, 77)  # status untouched
    assert acl.query_event(e) == (0, 1)  # discarded: NOT_READY, and stays so
    acl.fake_reset()
    acl.ok(acl.aclrtRecordEvent(late, s))  # after the failure: discarded too
    assert acl.aclrtSynchronizeStreamWithTimeout(s, 1000) == DEVICE_MEM_ERROR
    assert acl.query_event(late) == (0, 1)
    assert acl.aclrtSynchronizeEventWithTimeout(late, 20) == EVENT_SYNC_TIMEOUT
    assert acl.aclrtSynchronizeEvent(late) == DEVICE_MEM_ERROR  # the fake does not hang forever
    acl.ok(acl.aclrtStreamAbort(s))
    assert acl.query_stream(s) == (0, 0)
    assert acl.query_event(e) == (0, 1)
    data = os.urandom(4096)
    fill(pinned, data)
    acl.ok(acl.aclrtMemcpyAsync(dev, 4096, pinned, 4096, H2D, s))
    acl.ok(acl.aclrtRecordEvent(e, s))
    acl.ok(acl.aclrtSynchronizeEvent(e))
    assert acl.query_event(e) == (1, 0)
    assert acl.read(dev, 4096) == data
    acl.ok(acl.aclrtDestroyStream(s))
    for ev in (e, late):
        acl.ok(acl.aclrtDestroyEvent(ev))
    acl.ok(acl.aclrtFree(dev))
    acl.ok(acl.aclrtFreeHost(pinned))


def test_continue_on_failure_and_freed_memory(acl: Acl) -> None:
    s, e = acl.stream(), acl.event()
    a, b = acl.malloc(4096), acl.malloc(4096)
    acl.fake_fault(DEVICE_MEM_ERROR)
    acl.ok(acl.aclrtMemcpyAsync(b, 4096, a, 4096, D2D, s))
    acl.ok(acl.aclrtRecordEvent(e, s))
    acl.ok(acl.aclrtSynchronizeEvent(e))  # CONTINUE (the default): later tasks run
    assert acl.query_stream(s)[0] == DEVICE_MEM_ERROR  # the error stays on the stream
    acl.fake_reset()
    acl.ok(acl.aclrtStreamAbort(s))
    # memory freed while a copy of it waits: the copy fails when it runs
    with acl.hold():
        acl.ok(acl.aclrtMemcpyAsync(b, 4096, a, 4096, D2D, s))
        acl.ok(acl.aclrtFree(a))
    assert acl.aclrtSynchronizeStream(s) == DEVICE_MEM_ERROR
    assert "no longer inside known memory" in acl.message()
    acl.ok(acl.aclrtStreamAbort(s))
    acl.ok(acl.aclrtDestroyStreamForce(s))
    assert acl.aclrtSynchronizeStream(s) == PARAM_INVALID  # destroyed
    acl.ok(acl.aclrtDestroyEvent(e))
    acl.ok(acl.aclrtFree(b))


def test_event_numbering_latest_record_and_timeouts(acl: Acl) -> None:
    s1, s2, dev, pinned = acl.stream(), acl.stream(stop_on_failure=True), acl.malloc(4096), acl.malloc_host(4096)
    e = acl.event()
    assert acl.query_event(e) == (1, 0)  # never recorded: COMPLETE (1 new numbering, 0 deprecated)
    with acl.hold():
        acl.ok(acl.aclrtMemcpyAsync(dev, 4096, pinned, 4096, H2D, s1))
        acl.ok(acl.aclrtRecordEvent(e, s1))
        assert acl.query_event(e) == (0, 1)  # NOT_READY
        assert acl.aclrtSynchronizeEventWithTimeout(e, 20) == EVENT_SYNC_TIMEOUT
        assert acl.aclrtSynchronizeStreamWithTimeout(s1, 20) == STREAM_SYNC_TIMEOUT
        assert acl.aclrtSynchronizeStreamWithTimeout(s1, 0) == STREAM_SYNC_TIMEOUT
        assert acl.aclrtSynchronizeStreamWithTimeout(s1, -5) == INVALID_PARAM
    acl.ok(acl.aclrtSynchronizeEvent(e))
    assert acl.query_event(e) == (1, 0)
    acl.ok(acl.aclrtSynchronizeStreamWithTimeout(s1, -1))

    # the event stands for its latest record: an earlier one completing does not complete it
    with acl.hold():
        acl.ok(acl.aclrtRecordEvent(e, s1))
        acl.ok(acl.aclrtMemcpyAsync(dev, 4096, pinned, 4096, H2D, s2))
        acl.ok(acl.aclrtRecordEvent(e, s2))  # discarded once the copy before it fails
        acl.fake_fault(DEVICE_MEM_ERROR)
    acl.ok(acl.aclrtSynchronizeStream(s1))
    assert acl.aclrtSynchronizeStream(s2) == DEVICE_MEM_ERROR
    assert acl.query_event(e) == (0, 1)
    acl.fake_reset()
    acl.ok(acl.aclrtStreamAbort(s2))
    acl.ok(acl.aclrtRecordEvent(e, s2))
    acl.ok(acl.aclrtSynchronizeEvent(e))
    assert acl.query_event(e) == (1, 0)
    for flags in (0, 1, 8):
        made = _vp()
        acl.ok(acl.aclrtCreateEventWithFlag(ctypes.byref(made), flags))
        acl.ok(acl.aclrtDestroyEvent(made))
    st = _vp()
    assert acl.aclrtCreateStreamWithConfig(ctypes.byref(st), 8, 0) == INVALID_PARAM
    assert acl.aclrtCreateStreamWithConfig(ctypes.byref(st), 0, 0x4) == INVALID_PARAM
    acl.ok(acl.aclrtCreateStreamWithConfig(ctypes.byref(st), 7, 0x3))
    assert acl.aclrtSetStreamFailureMode(st, 2) == INVALID_PARAM
    for stream in (s1, s2, st.value):
        acl.ok(acl.aclrtDestroyStream(stream))
    acl.ok(acl.aclrtDestroyEvent(e))
    assert acl.aclrtQueryEventStatus(e, ctypes.byref(_int())) == PARAM_INVALID  # destroyed
    acl.ok(acl.aclrtFree(dev))
    acl.ok(acl.aclrtFreeHost(pinned))


def test_error_message_is_per_thread(acl: Acl) -> None:
    p = _vp()
    assert acl.aclrtMalloc(ctypes.byref(p), 64, 9) == INVALID_PARAM
    mine = acl.message()
    assert "aclrtMalloc" in mine and "policy 9" in mine

    def other() -> tuple[str, str]:
        before = acl.message()
        acl.ok(acl.aclrtSetDevice(0))
        assert acl.aclrtFree(0x1000) == PARAM_INVALID
        return before, acl.message()

    before, theirs = on_thread(other)
    assert before == ""
    assert "aclrtFree" in theirs
    assert acl.message() == mine


# -- IPC ----------------------------------------------------------------------------------------------------------

_CHILD = r"""
import ctypes, json, os, sys
vp, sz = ctypes.c_void_p, ctypes.c_size_t
lib = ctypes.CDLL(os.environ["FAKE_ACL_LIB"])
for name, args in {
    "aclInit": [ctypes.c_char_p], "aclrtSetDevice": [ctypes.c_int32], "aclrtMalloc": [ctypes.POINTER(vp), sz, ctypes.c_int],
    "aclrtFree": [vp], "aclrtMemcpy": [vp, sz, vp, sz, ctypes.c_int], "aclrtMemcpyAsync": [vp, sz, vp, sz, ctypes.c_int, vp],
    "aclrtCreateStream": [ctypes.POINTER(vp)], "aclrtSynchronizeStream": [vp],
    "aclrtIpcMemImportByKey": [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_uint64], "aclrtIpcMemClose": [ctypes.c_char_p],
    "aclrtIpcMemSetImportPid": [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int32), sz],
    "aclrtDeviceGetBareTgid": [ctypes.POINTER(ctypes.c_int32)], "aclrtMemGetAddressRange": [vp, ctypes.POINTER(vp), ctypes.POINTER(sz)],
    "aclrtPointerGetAttributes": [vp, ctypes.c_char_p],
}.items():
    f = getattr(lib, name); f.argtypes = args; f.restype = ctypes.c_int
lib.aclGetRecentErrMsg.restype = ctypes.c_char_p
assert lib.aclInit(None) == 0
assert lib.aclrtSetDevice(int(os.environ.get("CHILD_DEVICE", "0"))) == 0
s = vp(); assert lib.aclrtCreateStream(ctypes.byref(s)) == 0
def msg():
    m = lib.aclGetRecentErrMsg(); return m.decode() if m else ""
def tgid():
    t = ctypes.c_int32(); assert lib.aclrtDeviceGetBareTgid(ctypes.byref(t)) == 0; return t.value
def imp(key, flags=0):
    p = vp(); r = lib.aclrtIpcMemImportByKey(ctypes.byref(p), key.encode(), flags); return [r, p.value or 0, msg()]
def close(key):
    return [lib.aclrtIpcMemClose(key.encode()), msg()]
def whitelist(key, pid):
    return lib.aclrtIpcMemSetImportPid(key.encode(), (ctypes.c_int32 * 1)(pid), 1)
def read(ptr, n):
    b = ctypes.create_string_buffer(n); r = lib.aclrtMemcpy(b, n, ptr, n, 2); return [r, b.raw.hex()]
def write(ptr, hexdata):
    d = bytes.fromhex(hexdata); return lib.aclrtMemcpy(ptr, len(d), d, len(d), 1)
def span(ptr):
    base, size = vp(), sz(); r = lib.aclrtMemGetAddressRange(ptr, ctypes.byref(base), ctypes.byref(size))
    a = ctypes.create_string_buffer(28); lib.aclrtPointerGetAttributes(ptr, a)
    return [r, base.value or 0, size.value, int.from_bytes(a.raw[4:8], "little"), int.from_bytes(a.raw[8:12], "little")]
def alloc(n):
    p = vp(); assert lib.aclrtMalloc(ctypes.byref(p), n, 2) == 0; return p.value
def copy_async(dst, src, n, kind):
    r = lib.aclrtMemcpyAsync(dst, n, src, n, kind, s)
    return [r, lib.aclrtSynchronizeStream(s) if r == 0 else 0]
def copy_sync(dst, src, n, kind):
    return lib.aclrtMemcpy(dst, n, src, n, kind)
def host(n):
    global keep; keep = ctypes.create_string_buffer(n); return ctypes.addressof(keep)
print(json.dumps([os.getpid(), tgid()]), flush=True)
for line in sys.stdin:
    print(json.dumps(eval(line)), flush=True)
"""


class Child:
    """Another process with the fake loaded: ``ask("imp(key)")`` evaluates there and returns the JSON result."""

    def __init__(self, lib: Path, **env: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "FAKE_ACL_LIB": str(lib), **env})
        self.pid, self.tgid = self._line()

    def _line(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the child process died (exit {self.proc.poll()})"
        return json.loads(line)

    def ask(self, expr: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(expr + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


@contextmanager
def child(lib: Path, **env: str) -> Iterator[Child]:
    c = Child(lib, **env)
    try:
        yield c
    finally:
        c.close()


def test_export_rules_in_one_process(acl: Acl) -> None:
    ptr = acl.malloc(64 * 1024)  # 4 KiB pages; the allocation is 64 KiB + 32 bytes
    key = ctypes.create_string_buffer(65)
    assert acl.aclrtIpcMemGetExportKey(ptr, 8192, key, 64, 0) == INVALID_PARAM  # the key is 65 bytes
    assert acl.aclrtIpcMemGetExportKey(ptr, 8192, key, 65, 2) == INVALID_PARAM
    assert acl.aclrtIpcMemGetExportKey(ptr + 32, 4096, key, 65, 0) == PARAM_INVALID
    assert "unaligned" in acl.message()
    assert acl.aclrtIpcMemGetExportKey(ptr, 4000, key, 65, 0) == PARAM_INVALID  # neither whole pages nor the end
    assert acl.aclrtIpcMemGetExportKey(ptr, 128 * 1024, key, 65, 0) == PARAM_INVALID  # past the allocation
    host = acl.malloc_host(4096)
    assert acl.aclrtIpcMemGetExportKey(host, 4096, key, 65, 0) == PARAM_INVALID  # not device memory
    middle = acl.export(ptr + 4096, 8192)
    assert middle.startswith(b"acl-") and len(middle) <= 64
    assert acl.aclrtIpcMemGetExportKey(ptr, 64 * 1024 + 32, key, 65, 0) == IPC_ERROR  # overlaps the first
    tail = acl.export(ptr + 16384, 64 * 1024 + 32 - 16384)  # reaches the end: not whole pages, still fine
    p = _vp()
    assert acl.aclrtIpcMemImportByKey(ctypes.byref(p), middle, 0) == IPC_ERROR  # its own export
    assert acl.aclrtFree(ptr) == IPC_ERROR  # keys still open
    assert "aclrtIpcMemClose" in acl.message()
    acl.whitelist(middle, 12345)
    acl.ok(acl.aclrtIpcMemClose(middle))
    assert acl.aclrtIpcMemClose(middle) == IPC_ERROR  # closed already
    acl.ok(acl.aclrtIpcMemClose(tail))
    acl.ok(acl.aclrtFree(ptr))
    huge = acl.malloc(4 * MiB, HUGE_ONLY)
    assert acl.aclrtIpcMemGetExportKey(huge + 4096, 4096, key, 65, 0) == PARAM_INVALID  # 2 MiB pages there
    second_half = acl.export(huge + 2 * MiB, 2 * MiB + 32, 1)
    acl.ok(acl.aclrtIpcMemClose(second_half))
    acl.ok(acl.aclrtFree(huge))
    acl.ok(acl.aclrtFreeHost(host))


def test_ipc_whitelist_by_bare_tgid_and_data(acl: Acl, built: Path) -> None:
    size = 64 * 1024
    ptr = acl.malloc(size)
    data = os.urandom(size)
    acl.write(ptr, data)
    key = acl.export(ptr, size)
    with child(built, FAKE_ACL_TGID_OFFSET="100000") as peer:
        assert peer.tgid == peer.pid + 100000  # a container: the bare TGID is not os.getpid()
        acl.whitelist(key, peer.pid)
        result, _, message = peer.ask(f"imp({key.decode()!r})")
        assert result == IPC_ERROR and "pid not in whitelist" in message
        assert peer.ask(f"whitelist({key.decode()!r}, {peer.tgid})") == IPC_ERROR  # only the exporter whitelists
        acl.whitelist(key, peer.tgid)
        result, imported, _ = peer.ask(f"imp({key.decode()!r})")
        assert result == 0
        assert peer.ask(f"imp({key.decode()!r})")[0] == IPC_ERROR  # once per process
        assert peer.ask(f"span({imported} + 100)") == [0, imported, size, LOC_DEVICE, 4096]  # type, page size
        result, text = peer.ask(f"read({imported}, {size})")
        assert result == 0 and bytes.fromhex(text) == data
        news = os.urandom(4096)
        assert peer.ask(f"write({imported} + 8192, {news.hex()!r})") == 0
        assert acl.read(ptr + 8192, 4096) == news  # the same memory
        assert acl.aclrtIpcMemClose(key) == IPC_ERROR
        assert "importer must close first" in acl.message()
        assert acl.aclrtFree(ptr) == IPC_ERROR
        assert peer.ask(f"close({key.decode()!r})")[0] == 0
        assert peer.ask(f"read({imported}, 16)")[0] == PARAM_INVALID  # unmapped
    acl.ok(acl.aclrtIpcMemClose(key))
    acl.ok(acl.aclrtFree(ptr))


def test_ipc_without_pid_validation(acl: Acl, built: Path) -> None:
    ptr = acl.malloc(8192)
    key = acl.export(ptr, 8192, 1).decode()  # DISABLE_PID_VALIDATION
    with child(built, FAKE_ACL_TGID_OFFSET="7") as peer:
        result, imported, _ = peer.ask(f"imp({key!r}, 1)")
        assert result == 0
        assert peer.ask(f"read({imported}, 64)") == [0, (b"\xa5" * 64).hex()]
        assert peer.ask(f"close({key!r})")[0] == 0
    acl.ok(acl.aclrtIpcMemClose(key.encode()))
    acl.ok(acl.aclrtFree(ptr))


def test_ipc_from_another_device_only_async_device_copies(acl: Acl, built: Path) -> None:
    size = 16 * 1024
    ptr = acl.malloc(size)
    data = os.urandom(size)
    acl.write(ptr, data)
    key = acl.export(ptr, size, 1).decode()
    with child(built, CHILD_DEVICE="1") as peer:
        result, imported, _ = peer.ask(f"imp({key!r}, 1)")
        assert result == 0
        own, buf = peer.ask(f"alloc({size})"), peer.ask(f"host({size})")
        assert peer.ask(f"copy_async({imported}, {buf}, 4096, 1)")[0] == PARAM_INVALID  # H2D
        assert peer.ask(f"copy_async({buf}, {imported}, 4096, 2)")[0] == PARAM_INVALID  # D2H
        assert peer.ask(f"copy_sync({buf}, {imported}, 4096, 2)") == PARAM_INVALID
        assert peer.ask(f"copy_async({own}, {imported}, 4096, 4)")[0] == PARAM_INVALID  # DEFAULT
        assert peer.ask(f"copy_sync({own}, {imported}, 4096, 3)") == PARAM_INVALID  # synchronous D2D
        assert peer.ask(f"copy_async({own}, {imported}, {size}, 3)") == [0, 0]  # asynchronous D2D works
        result, text = peer.ask(f"read({own}, {size})")
        assert result == 0 and bytes.fromhex(text) == data
        assert peer.ask(f"close({key!r})")[0] == 0
    acl.ok(acl.aclrtIpcMemClose(key.encode()))
    acl.ok(acl.aclrtFree(ptr))
