"""The CUDA layer without a GPU: loading and error reporting, the shipped PTX, the pure helpers, and the
ctypes glue of the driver wrapper and the executor against a fake ``libcuda`` (compiled from C below when a C
compiler is available; "device" memory is host memory and each stream a thread)."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.examples import examples
from helpers.fake_cuda import build_fake_libcuda
from helpers.plans import draw_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiodatadist import cuda
from aiodatadist.cuda import completion as completion_module
from aiodatadist.cuda import driver, kernels
from aiodatadist.cuda import launches as launches_module
from aiodatadist.cuda.driver import CudaDriver, CudaError, CudaUnavailable, CUipcMemHandle, Device
from aiodatadist.cuda.executor import CudaExecutor, CudaJob
from aiodatadist.errors import LLMException, LLMStatusCode
from aiodatadist.layout.plans import Runs, Spans, make_plan

# -- loading and errors, whatever the machine has ----------------------------------------------------------


@pytest.mark.slow  # a fresh interpreter
def test_import_does_not_load_libcuda() -> None:
    code = ("import aiodatadist.cuda, aiodatadist.cuda.executor\n"
            "maps = open('/proc/self/maps').read()\n"
            "print('libcuda' in maps)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.fixture
def no_cached_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget a loaded driver for the test (restored afterwards) and clear the fake driver's knobs."""
    monkeypatch.setattr(driver, "_driver", None)
    for name in list(os.environ):
        if name.startswith("FAKE_CUDA_"):
            monkeypatch.delenv(name)


@pytest.mark.usefixtures("no_cached_driver")
def test_not_found_is_feature_not_enabled_and_says_where(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(driver.ENV_LIBCUDA, "/nonexistent/libcuda.so.1")
    with pytest.raises(CudaUnavailable) as info:
        driver.cuda_driver()
    assert isinstance(info.value, LLMException)
    assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert "not found" in str(info.value) and "/nonexistent/libcuda.so.1" in str(info.value)
    assert driver.cuda_status().startswith("CUDA unavailable: ")


def test_default_search_list(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(driver.ENV_LIBCUDA, raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(driver, "_SEARCH_DIRS", ("/usr/lib/x86_64-linux-gnu", "/opt/cuda/lib64/stubs"))
    paths = driver.search_paths()
    assert paths[:2] == ["libcuda.so.1", "libcuda.so"]
    assert "/usr/lib/x86_64-linux-gnu/libcuda.so.1" in paths
    assert str(tmp_path / "lib64" / "libcuda.so.1") in paths
    assert not [p for p in paths if "stubs" in p]


def test_cuda_status_never_raises() -> None:
    status = driver.cuda_status()
    assert isinstance(status, str) and "\n" not in status
    assert status.startswith(("CUDA driver ", "CUDA unavailable: "))


def test_ipc_handle_is_a_64_byte_struct() -> None:
    assert ctypes.sizeof(CUipcMemHandle) == 64
    raw = bytes(range(64))  # NULs inside must survive (the c_char array attribute would stop at them)
    assert bytes(CUipcMemHandle.from_buffer_copy(raw)) == raw
    assert driver._SIGNATURES["cuIpcOpenMemHandle_v2"][1] is CUipcMemHandle  # by value, not a pointer


def test_cuda_error_status_and_pickling() -> None:
    oom = CudaError("cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)",
                    status_code=driver._status_for(driver.CUDA_ERROR_OUT_OF_MEMORY), result=2,
                    function="cuMemAlloc_v2")
    assert oom.status_code == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
    assert driver._status_for(700) == LLMStatusCode.LLM_DEVICE_MEM_ERROR
    copy = pickle.loads(pickle.dumps(oom))
    assert type(copy) is CudaError and str(copy) == str(oom)
    assert (copy.result, copy.function, copy.status_code) == (2, "cuMemAlloc_v2", oom.status_code)
    assert isinstance(CudaUnavailable("x"), LLMException)


def test_every_symbol_has_a_signature() -> None:
    for name, argtypes in driver._SIGNATURES.items():
        assert name.startswith("cu") and isinstance(argtypes, list)
    for name in ("cuMemAlloc_v2", "cuMemFree_v2", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyDtoD_v2",
                 "cuMemcpyHtoDAsync_v2", "cuMemsetD8_v2", "cuMemHostRegister_v2", "cuMemHostGetDevicePointer_v2",
                 "cuStreamDestroy_v2", "cuEventDestroy_v2", "cuIpcOpenMemHandle_v2",
                 "cuDevicePrimaryCtxRelease_v2", "cuMemGetAddressRange_v2", "cuLaunchHostFunc",
                 "cuStreamAddCallback", "cuLaunchKernel", "cuModuleLoadData"):
        assert name in driver._SIGNATURES, name


# -- the PTX -----------------------------------------------------------------------------------------------


def test_ptx_text() -> None:
    ptx = cuda.ptx_text()
    assert ptx.endswith(b"\0") and ptx.count(b"\0") == 1
    assert b".visible .entry adt_copy_spans(" in ptx
    assert re.search(rb"^\.version \d+\.\d+$", ptx, re.MULTILINE)
    assert b".target sm_75" in ptx and b".address_size 64" in ptx
    assert cuda.KERNEL_NAME == "adt_copy_spans"


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_ptxas_accepts_the_shipped_ptx(arch: str, tmp_path: Path) -> None:
    path = tmp_path / "copy_kernel.ptx"
    path.write_bytes(cuda.ptx_text()[:-1])
    subprocess.run(["ptxas", f"-arch={arch}", str(path), "-o", os.devnull], check=True, timeout=120)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_shipped_ptx_matches_the_source(tmp_path: Path) -> None:
    """The committed PTX is what scripts/gen_ptx.sh makes of copy_kernel.cu (with the same nvcc release)."""
    shipped = cuda.ptx_text()[:-1].decode()
    release = re.search(r"^// Cuda compilation tools, (.*)$", shipped, re.MULTILINE)
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True).stdout
    if release is None or release.group(1) not in nvcc:
        pytest.skip("the PTX was generated by another nvcc release")
    source = Path(kernels.__file__).with_name("copy_kernel.cu")
    out = tmp_path / "k.ptx"
    subprocess.run(["nvcc", "-ptx", "-arch=compute_75", "-O3", str(source), "-o", str(out)], check=True,
                   timeout=300)
    fresh = re.sub(r"^\.version .*$", "", out.read_text(), flags=re.MULTILINE)
    assert re.sub(r"^\.version .*$", "", shipped, flags=re.MULTILINE) == fresh, "run scripts/gen_ptx.sh"


# -- pure helpers --------------------------------------------------------------------------------------------


@settings(max_examples=examples(300), deadline=None)
@given(st.integers(0, 10**7), st.integers(0, 1 << 40), st.integers(1, 512))
def test_launch_geometry(num_spans: int, max_span: int, sm_count: int) -> None:
    grid, block = cuda.launch_geometry(num_spans, max_span, sm_count=sm_count)
    assert block in (64, 128, 256)
    assert block == 64 or block * 64 < max_span * 2  # the smallest block that covers the span in one pass
    assert block == 256 or block * 64 >= max_span
    if num_spans == 0:
        assert grid == 0
    else:
        assert 1 <= grid <= num_spans
        assert grid <= sm_count * (2048 // block)
        assert grid == min(num_spans, sm_count * (2048 // block))
    assert cuda.launch_geometry(num_spans, max_span + 1, sm_count=sm_count)[1] >= block


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(0, 1 << 44), st.integers(1, 512))
def test_choose_piece(total: int, sm_count: int) -> None:
    piece = cuda.choose_piece(total, sm_count=sm_count)
    assert kernels.MIN_PIECE <= piece <= kernels.MAX_PIECE
    assert piece & (piece - 1) == 0 and piece % 16 == 0
    if piece < kernels.MAX_PIECE:
        assert total <= piece * sm_count * kernels.PIECES_PER_SM


SPANS = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 20), st.integers(0, 5000)),
                 max_size=60)


@settings(max_examples=examples(300), deadline=None)
@given(SPANS, st.integers(1, 2048))
def test_split_long_spans_covers_each_span_in_order(spans: list[tuple[int, int, int]], piece: int) -> None:
    base = 1 << 40
    src = np.array([base + s for s, _, _ in spans], dtype=np.uint64)
    dst = np.array([2 * base + d for _, d, _ in spans], dtype=np.uint64)
    length = np.array([n for _, _, n in spans], dtype=np.uint64)
    out = cuda.split_long_spans(src, dst, length, piece)
    assert out.src.dtype == out.dst.dtype == out.length.dtype == np.uint64
    assert len(out.src) == len(out.dst) == len(out.length)
    assert all(int(n) <= piece for n in out.length)
    k = 0
    for s, d, n in spans:  # every span: consecutive pieces from its start, in order, exactly its bytes
        count = max(1, -(-n // piece))
        offsets = np.cumsum([0, *out.length[k:k + count].tolist()])
        assert int(offsets[-1]) == n
        assert out.src[k:k + count].tolist() == [base + s + int(o) for o in offsets[:-1]]
        assert out.dst[k:k + count].tolist() == [2 * base + d + int(o) for o in offsets[:-1]]
        assert all(int(x) == piece for x in out.length[k:k + count - 1])
        k += count
    assert k == len(out.length)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.integers(0, 100_000), max_size=30), st.sampled_from([16, 64, 4096, 65536]))
def test_split_long_spans_keeps_16_byte_alignment(lengths: list[int], piece: int) -> None:
    src = np.arange(len(lengths), dtype=np.uint64) * np.uint64(1 << 20) + np.uint64(1 << 32)
    out = cuda.split_long_spans(src, src + np.uint64(1 << 30), np.array(lengths, dtype=np.uint64), piece)
    assert not (out.src % np.uint64(16)).any() and not (out.dst % np.uint64(16)).any()
    assert int(out.length.sum()) == sum(lengths)


def test_split_long_spans_rejects_a_bad_piece() -> None:
    with pytest.raises(ValueError):
        cuda.split_long_spans(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.ones(1, np.uint64), 0)


# -- the ctypes glue against a fake libcuda ----------------------------------------------------------------------



@pytest.fixture(scope="session")
def fake_so(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = build_fake_libcuda(tmp_path_factory.mktemp("fakecuda"))
    if built is None:
        pytest.skip("no C compiler for the fake libcuda")
    return built


@pytest.fixture
def fake_path(fake_so: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_cached_driver: None) -> Path:
    """A private copy of the fake (a fresh instance: its state does not leak between tests), selected with
    AIODATADIST_LIBCUDA."""
    path = tmp_path / "lib" / "libcuda.so.1"
    path.parent.mkdir()
    shutil.copy(fake_so, path)
    monkeypatch.setenv(driver.ENV_LIBCUDA, str(path))
    return path


@pytest.fixture
def drv(fake_path: Path) -> CudaDriver:
    return driver.cuda_driver()


@pytest.fixture
def dev(drv: CudaDriver) -> Device:
    return driver.get_device(0)


@pytest.fixture
def executor(dev: Device) -> Iterator[CudaExecutor]:
    ex = CudaExecutor(dev)
    yield ex
    ex.close()


def test_fake_driver_loads(drv: CudaDriver, fake_path: Path) -> None:
    assert drv.path == str(fake_path)
    assert (drv.version, drv.version_string, drv.device_count) == (13000, "13.0", 1)
    assert driver.cuda_driver() is drv
    assert driver.cuda_status() == "CUDA driver 13.0, 1 device(s): Fake GPU 0"
    assert drv.describe(700) == "CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)"
    assert drv.describe(12345) == "CUresult 12345"
    # cuEventElapsedTime_v2 is missing from the fake: the older symbol is bound instead
    assert drv.fn("cuEventElapsedTime_v2") is not None


def test_fake_status_with_several_devices(fake_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "3")
    assert driver.cuda_status() == "CUDA driver 13.0, 3 device(s): Fake GPU 0, Fake GPU 1, Fake GPU 2"


def test_cuinit_failure_says_why(fake_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_INIT", "100")
    with pytest.raises(CudaUnavailable) as info:
        driver.cuda_driver()
    assert "cuInit failed: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)" in str(info.value)
    assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    monkeypatch.delenv("FAKE_CUDA_INIT")
    assert driver.cuda_driver().device_count == 1  # a failure is not cached


def test_no_device(fake_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "0")
    with pytest.raises(CudaUnavailable, match="no CUDA device"):
        driver.cuda_driver()


def test_ordinal_out_of_range(drv: CudaDriver) -> None:
    with pytest.raises(CudaUnavailable, match="CUDA device 1 out of range: 1 device"):
        Device(1, drv)


def test_stub_libraries_are_skipped(fake_so: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    no_cached_driver: None) -> None:
    stub = tmp_path / "cuda" / "lib64" / "stubs" / "libcuda.so"
    stub.parent.mkdir(parents=True)
    shutil.copy(fake_so, stub)
    monkeypatch.setenv(driver.ENV_LIBCUDA, str(stub))
    with pytest.raises(CudaUnavailable, match="stubs") as info:
        driver.cuda_driver()
    assert "not found" in str(info.value)
    maps = Path("/proc/self/maps").read_text()
    assert str(stub) not in maps  # never even loaded
    # a stub elsewhere says so through cuInit
    other = tmp_path / "other" / "libcuda.so.1"
    other.parent.mkdir()
    shutil.copy(fake_so, other)
    monkeypatch.setenv(driver.ENV_LIBCUDA, f"{other}{os.pathsep}/nonexistent/libcuda.so.1")
    monkeypatch.setenv("FAKE_CUDA_INIT", str(driver.CUDA_ERROR_STUB_LIBRARY))
    with pytest.raises(CudaUnavailable, match="CUDA_ERROR_STUB_LIBRARY"):
        driver.cuda_driver()


def test_not_a_driver(monkeypatch: pytest.MonkeyPatch, no_cached_driver: None) -> None:
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to stand in for a wrong library")
    monkeypatch.setenv(driver.ENV_LIBCUDA, libm)
    with pytest.raises(CudaUnavailable, match="cuInit"):
        driver.cuda_driver()


def test_device_memory(dev: Device) -> None:
    assert (dev.name, dev.ordinal, dev.sm_count, dev.compute_capability) == ("Fake GPU 0", 0, 4, (9, 0))
    data = np.random.default_rng(1).integers(1, 256, 10_000, dtype=np.uint8)
    a, b = dev.alloc(10_000), dev.alloc(10_000)
    try:
        dev.copy_htod(a, data.ctypes.data, 10_000)
        dev.copy_dtod(b, a, 10_000)
        back = np.zeros_like(data)
        dev.copy_dtoh(back.ctypes.data, b, 10_000)
        assert np.array_equal(back, data)
        dev.memset(b + 10, 7, 100)
        dev.copy_dtoh(back.ctypes.data, b, 10_000)
        assert (back[10:110] == 7).all() and np.array_equal(back[110:], data[110:])
        assert dev.address_range(a + 1234) == (a, 10_000)
        assert dev.is_device_pointer(a + 5) and not dev.is_device_pointer(data.ctypes.data)
    finally:
        dev.free(a)
        dev.free(b)
    with pytest.raises(CudaError) as info:
        dev.free(a)
    assert str(info.value) == "cuMemFree_v2 failed: CUDA_ERROR_INVALID_VALUE (invalid argument)"
    assert info.value.status_code == LLMStatusCode.LLM_DEVICE_MEM_ERROR
    assert (info.value.result, info.value.function) == (1, "cuMemFree_v2")


def test_out_of_memory_status(dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_MEM_LIMIT", str(1 << 20))
    with pytest.raises(CudaError) as info:
        dev.alloc(2 << 20)
    assert info.value.status_code == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
    assert "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)" == str(info.value)


def test_context_made_current_once_per_thread(dev: Device, drv: CudaDriver) -> None:
    calls = ctypes.c_int.in_dll(drv.lib, "fake_set_current_calls")
    dev.make_current()
    before = calls.value
    for _ in range(5):
        dev.free(dev.alloc(64))
    assert calls.value == before  # already current: no cuCtxSetCurrent
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(dev.alloc(64)))  # the fake needs a current context
    thread.start()
    thread.join()
    assert len(result) == 1 and calls.value == before + 1
    dev.free(result[0])


@pytest.mark.parametrize("native", [True, False], ids=["native", "ctypes"])
def test_copy_calls_make_the_context_current_and_say_what_failed(dev: Device, drv: CudaDriver,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 native: bool) -> None:
    """The launch path's driver calls (native, or through ctypes without the helper) make the device's context
    current when another one is (and only then), return the driver's result, and a context that cannot be made
    current fails the call as ``cuCtxSetCurrent``, calling nothing else."""
    from aiodatadist.cuda import copy_calls

    if not native:
        monkeypatch.setattr(copy_calls, "native_extension", lambda: None)
    elif getattr(copy_calls.native_extension(), "cuda_bind", None) is None:
        pytest.skip("the native helper is not built")
    calls = copy_calls.CopyCalls(dev)
    switches = ctypes.c_int.in_dll(drv.lib, "fake_set_current_calls")
    dev.make_current()
    stream, event = ctypes.c_void_p(), ctypes.c_void_p()
    drv.call("cuStreamCreate", ctypes.byref(stream), 1)
    drv.call("cuEventCreate", ctypes.byref(event), 2)
    try:
        drv.call("cuCtxSetCurrent", None)  # another context current on this thread
        before = switches.value
        assert calls.record(event.value, stream.value) == 0
        assert calls.record(event.value, stream.value) == 0
        assert switches.value == before + 1  # made current once
        deadline = time.monotonic() + 10
        while (result := calls.query(event.value)) == 600:  # CUDA_ERROR_NOT_READY
            assert time.monotonic() < deadline
        assert result == 0
        drv.call("cuCtxSetCurrent", None)
        monkeypatch.setenv("FAKE_CUDA_FAIL_SET_CURRENT", "1")
        failed = calls.query(event.value)
        assert failed == copy_calls.CTX_FAILED | 201
        error = calls.error("cuEventQuery", failed)
        assert (error.function, error.result) == ("cuCtxSetCurrent", 201)
        assert str(error) == "cuCtxSetCurrent failed: CUDA_ERROR_INVALID_CONTEXT (invalid device context)"
        assert calls.error("cuLaunchKernel", 1).function == "cuLaunchKernel"
        monkeypatch.delenv("FAKE_CUDA_FAIL_SET_CURRENT")
        monkeypatch.setenv("FAKE_CUDA_FAIL_HTOD", "1")  # a table that cannot be staged: nothing is launched
        staged = np.arange(3, dtype=np.uint64)
        host, device_buffer = dev.alloc_pinned(staged.nbytes), dev.alloc(staged.nbytes)
        try:
            with pytest.raises(ValueError, match="needs a staging buffer"):
                calls.launch(0, 1, 1, stream.value, 0, staged, staged.nbytes, 0, device_buffer)
            with pytest.raises(ValueError, match="shorter than the bytes"):
                calls.launch(0, 1, 1, stream.value, 0, staged[:2], staged.nbytes, host, device_buffer)
            failed = calls.launch(0, 1, 1, stream.value, 0, staged, staged.nbytes, host, device_buffer)
        finally:
            dev.free_pinned(host)
            dev.free(device_buffer)
        assert failed == copy_calls.STAGE_FAILED | 1
        assert calls.error("cuLaunchKernel", failed).function == "cuMemcpyHtoDAsync_v2"
        monkeypatch.delenv("FAKE_CUDA_FAIL_HTOD")
        executor = CudaExecutor(dev)  # its launches stage their tables through these calls
        arena = Arena(dev, 1 << 20, 12)
        try:
            for offsets in ([0, 10, 5000], [70, 9000, 100]):
                executor.run_sync(arena.spans(offsets, [100, 300, 20000], [40, 1000, 3000]))
            arena.check()
        finally:
            arena.free()
            executor.close()
    finally:
        monkeypatch.delenv("FAKE_CUDA_FAIL_SET_CURRENT", raising=False)
        dev.make_current()
        drv.call("cuStreamSynchronize", stream)
        drv.call("cuEventDestroy_v2", event)
        drv.call("cuStreamDestroy_v2", stream)


def test_host_memory(dev: Device) -> None:
    host = np.zeros(1 << 20, dtype=np.uint8)
    dptr = dev.register_host(host.ctypes.data, host.nbytes)
    try:
        assert dptr == host.ctypes.data
        assert not dev.is_device_pointer(dptr)
        with pytest.raises(CudaError, match="CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"):
            dev.register_host(host.ctypes.data, host.nbytes)
    finally:
        dev.unregister_host(host.ctypes.data)
    pinned = dev.alloc_pinned(4096)
    assert pinned and dev.host_device_pointer(pinned) == pinned
    dev.free_pinned(pinned)


def test_ipc_handle_round_trip(dev: Device) -> None:
    ptr = dev.alloc(4096)
    try:
        handle = dev.ipc_handle(ptr)
        assert isinstance(handle, bytes) and len(handle) == 64
        opened = dev.ipc_open(handle)  # the fake checks both ends of the by-value struct
        assert opened == ptr and dev.is_device_pointer(opened)
        dev.ipc_close(opened)
        with pytest.raises(LLMException) as info:
            dev.ipc_handle(ptr + 16)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(LLMException):
            dev.ipc_open(handle[:63])
    finally:
        dev.free(ptr)


class Arena:
    """Two device buffers with random contents and a numpy model of them."""

    def __init__(self, dev: Device, nbytes: int, seed: int) -> None:
        self.dev, self.nbytes = dev, nbytes
        rng = np.random.default_rng(seed)
        self.src_data = rng.integers(1, 256, nbytes, dtype=np.uint8)
        self.dst_data = rng.integers(1, 256, nbytes, dtype=np.uint8)
        self.src, self.dst = dev.alloc(nbytes), dev.alloc(nbytes)
        dev.copy_htod(self.src, self.src_data.ctypes.data, nbytes)
        dev.copy_htod(self.dst, self.dst_data.ctypes.data, nbytes)

    def spans(self, s_off: list[int], d_off: list[int], lengths: list[int]) -> Spans:
        for s, d, n in zip(s_off, d_off, lengths, strict=True):
            self.dst_data[d:d + n] = self.src_data[s:s + n]
        return Spans(np.array(s_off, dtype=np.uint64) + np.uint64(self.src),
                     np.array(d_off, dtype=np.uint64) + np.uint64(self.dst), np.array(lengths, dtype=np.uint64))

    def check(self) -> None:
        back = np.zeros(self.nbytes, dtype=np.uint8)
        self.dev.copy_dtoh(back.ctypes.data, self.dst, self.nbytes)
        assert np.array_equal(back, self.dst_data)

    def free(self) -> None:
        self.dev.free(self.src)
        self.dev.free(self.dst)


def random_layout(rng: np.random.Generator, count: int, max_len: int, nbytes: int) -> tuple[
        list[int], list[int], list[int]]:
    """Non-overlapping destinations (random gaps), random sources."""
    lengths = rng.integers(1, max_len, count).tolist()
    gaps = rng.integers(0, 64, count).tolist()
    d_off, at = [], 0
    for n, g in zip(lengths, gaps, strict=True):
        d_off.append(at + g)
        at += g + n
    assert at <= nbytes
    s_off = [int(rng.integers(0, nbytes - n)) for n in lengths]
    return s_off, d_off, lengths


async def test_executor_scattered_spans(dev: Device, executor: CudaExecutor) -> None:
    arena = Arena(dev, 24 << 20, 2)
    try:
        rng = np.random.default_rng(3)
        await executor.run(arena.spans(*random_layout(rng, 300, 70_000, arena.nbytes)), None)
        arena.check()
        # long spans are cut into pieces (the fake checks each piece's bounds)
        await executor.run(arena.spans([5, 3 << 20], [10 << 20, 16 << 20], [(3 << 20) - 7, 5 << 20]), None)
        arena.check()
        # one span: cuMemcpyAsync; zero-length spans are dropped
        await executor.run(arena.spans([100, 0], [200, 300], [1 << 20, 0]), None)
        arena.check()
        await executor.run(arena.spans([], [], []), None)
        executor.run_sync(arena.spans([1, 2], [3 << 20, 4 << 20], [1000, 2000]))
        arena.check()
    finally:
        arena.free()


async def test_executor_small_pieces(dev: Device) -> None:
    with CudaExecutor(dev, piece_bytes=4096) as executor:
        arena = Arena(dev, 4 << 20, 4)
        try:
            job = executor.start(arena.spans([0, 1 << 20], [2 << 20, 3 << 20], [100_000, 77_777]))
            await executor.wait(job)
            arena.check()
        finally:
            arena.free()


async def test_executor_registered_host_memory_and_ipc(dev: Device, executor: CudaExecutor) -> None:
    host_src = np.random.default_rng(5).integers(1, 256, 1 << 20, dtype=np.uint8)
    host_dst = np.zeros(1 << 20, dtype=np.uint8)
    src = dev.register_host(host_src.ctypes.data, host_src.nbytes)
    dst = dev.register_host(host_dst.ctypes.data, host_dst.nbytes)
    buf = dev.alloc(1 << 20)
    opened = dev.ipc_open(dev.ipc_handle(buf))
    try:
        half = 1 << 19
        spans = Spans(np.array([src, src + half], np.uint64), np.array([opened + half, opened], np.uint64),
                      np.array([half, half], np.uint64))
        await executor.run(spans, None)
        await executor.run(Spans(np.array([buf], np.uint64), np.array([dst], np.uint64),
                                 np.array([1 << 20], np.uint64)), None)
        assert np.array_equal(host_dst[half:], host_src[:half]) and np.array_equal(host_dst[:half], host_src[half:])
    finally:
        dev.ipc_close(opened)
        dev.free(buf)
        dev.unregister_host(host_src.ctypes.data)
        dev.unregister_host(host_dst.ctypes.data)


async def test_completion_does_not_block_the_loop(drv: CudaDriver, dev: Device,
                                                  executor: CudaExecutor) -> None:
    """The copy stays on the "GPU" until the loop has ticked five times: neither ``start()`` nor the wait may
    block the loop for it (a held copy is let go after 60 s at most, far past these bounds)."""
    arena = Arena(dev, 1 << 20, 6)
    hold = _hold(drv)
    hold.value = 1
    try:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        task = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        job = executor.start(arena.spans([0, 1000], [5000, 9000], [1000, 1000]))
        started = time.perf_counter() - t0
        assert not job.future.done() and not job.stopped.is_set()
        assert started < 10, f"start() took {started:.3f} s: it waited for the (held) copy?"
        waiter = asyncio.create_task(executor.wait(job))
        while ticks < 5:
            await asyncio.sleep(0.005)
            assert time.perf_counter() - t0 < 30, f"{ticks} loop ticks in 30 s"
        assert not waiter.done() and not job.stopped.is_set()  # (still held)
        hold.value = 0
        await asyncio.wait_for(waiter, 30)
        task.cancel()
        assert job.stopped.is_set()
        arena.check()
    finally:
        hold.value = 0
        arena.free()


async def test_cancelled_wait_returns_after_the_gpu(drv: CudaDriver, dev: Device,
                                                   executor: CudaExecutor) -> None:
    arena = Arena(dev, 1 << 20, 7)
    hold = _hold(drv)
    hold.value = 1  # the copy stays on the "GPU" until let go
    try:
        job = executor.start(arena.spans([0, 4096], [8192, 65536], [4096, 4096]))
        task = asyncio.create_task(executor.wait(job))
        await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.sleep(0.05)  # (many loop iterations: a wait that gave up at the cancellation has ended)
        assert not task.done() and not job.stopped.is_set()  # the cancelled wait waits for the held copy
        hold.value = 0
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        assert job.stopped.is_set()
        arena.check()  # the copy ran to its end
        # cancel with an error: the waiter gets it, once the GPU is done
        job = executor.start(arena.spans([0, 4096], [8192, 65536], [4096, 4096]))
        executor.cancel(job, LLMException("deadline", status_code=LLMStatusCode.LLM_TIMEOUT))
        with pytest.raises(LLMException, match="deadline"):
            await executor.wait(job)
        assert job.stopped.is_set()
    finally:
        hold.value = 0
        arena.free()


async def test_descriptor_buffers_are_reused(drv: CudaDriver, dev: Device, executor: CudaExecutor) -> None:
    arena = Arena(dev, 4 << 20, 8)
    hold = _hold(drv)
    try:
        for i in range(5):
            await executor.run(arena.spans([i, 10_000 + i], [1 << 20, 2 << 20], [1000, 3000]), None)
        assert len(executor._all) == 1 and len(executor._free) == 1
        hold.value = 1  # three copies on the "GPU" at once: none gives its buffer back before the next starts
        jobs = [executor.start(arena.spans([i, 10_000 + i], [(1 << 20) + 8192 * i, (2 << 20) + 8192 * i],
                                           [1000, 3000])) for i in range(3)]
        hold.value = 0
        await asyncio.gather(*(executor.wait(j) for j in jobs))
        assert len(executor._all) == 3 and len(executor._free) == 3
        arena.check()
    finally:
        hold.value = 0
        arena.free()


_RUNS = Runs(np.array([0, 5000], np.int64), np.array([2048, 0], np.int64), np.array([1000, 1500], np.int64))
_PLAN = make_plan(np.zeros(1, np.int64), np.zeros(1, np.int64), _RUNS)  # two runs of a single tensor


def _plan_jobs(executor: CudaExecutor, arena: Arena, count: int) -> list[CudaJob]:
    """``count`` copies of one plan between other addresses each (so each has its own cached launch), started
    and recorded in the arena's model."""
    runs, plan = _RUNS, _PLAN
    jobs = []
    for i in range(count):
        s, d = 64 * i, 8192 * i
        for so, do, n in zip(runs.src_offset, runs.dst_offset, runs.length, strict=True):
            arena.dst_data[d + do:d + do + n] = arena.src_data[s + so:s + so + n]
        jobs.append(executor.start_plan(plan, np.array([arena.src + s], np.uint64),
                                        np.array([arena.dst + d], np.uint64)))
    return jobs


def _hold(drv: CudaDriver) -> ctypes.c_int:
    """The fake's gate (``fake_hold``): while it is set, each copy and kernel waits before it runs (60 s at
    most), so a copy stays on the "GPU" until the test lets it go, however slow the machine."""
    return ctypes.c_int.in_dll(drv.lib, "fake_hold")


def _launch_spans(launch: Any) -> list[tuple[int, int, int]]:
    """A prepared launch's copies as (src, dst, length), merged where they continue each other."""
    if launch.single is not None:
        dst, src, n = launch.single
        pieces = [(src, dst, n)]
    elif launch.table is not None:
        n = launch.n
        pieces = list(zip(*(launch.table[k * n:(k + 1) * n].tolist() for k in range(3)), strict=True))
    else:
        pieces = []
    merged: list[tuple[int, int, int]] = []
    for src, dst, n in pieces:
        if merged and merged[-1][0] + merged[-1][2] == src and merged[-1][1] + merged[-1][2] == dst:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + n)
        else:
            merged.append((src, dst, n))
    return merged


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_plans_table_from_the_native_walk_is_the_span_arrays_one(executor: CudaExecutor, data: st.DataObject) -> None:
    """The native helper's one-pass walk of a plan's grid gives the launch the span arrays give: the same pieces
    (merged across runs and tensors where both sides continue, cut at the piece size), the single-copy case and
    the geometry; with zero-length runs (skipped by the walk) the same bytes go to the same places."""
    from aiodatadist.layout.plans import plan_to_spans

    if launches_module._grid_table is None:
        pytest.skip("no native helper")
    zero = data.draw(st.booleans())
    plan, src_addrs, dst_addrs = draw_plan(data, zero_lengths=zero)
    preparer = launches_module.LaunchPreparer(executor.device, data.draw(st.sampled_from([16, 4096, 65536, None])))
    native = preparer.for_plan(plan, src_addrs, dst_addrs)
    spans = preparer.for_spans(plan_to_spans(plan, src_addrs, dst_addrs))
    assert native.nbytes == spans.nbytes == plan.total_bytes
    assert _launch_spans(native) == _launch_spans(spans)
    if not zero:
        assert native.single == spans.single and (native.grid, native.block, native.n) == (spans.grid, spans.block,
                                                                                            spans.n)
        assert (native.table is None) == (spans.table is None)
        if native.table is not None:
            assert np.array_equal(native.table, spans.table)


async def test_a_repeated_plan_launches_from_its_table_on_the_device(dev: Device, executor: CudaExecutor) -> None:
    """A launch seen once is not kept (its table staged in a pooled buffer, back in the pool after the copy); seen
    again, it is kept and keeps its descriptors on the device; a repeat is one launch from that table (no buffer
    taken from the pool), and still copies the bytes the source holds now."""
    arena = Arena(dev, 1 << 20, 12)
    try:
        for round_ in range(4):
            await executor.wait(_plan_jobs(executor, arena, 1)[0])
            arena.check()
            launches = [launch for _, launch in executor._launches.values()]
            if round_ == 0:
                assert launches == [] and len(executor._free) == len(executor._all) == 1
            else:
                assert len(launches) == 1 and launches[0].resident is not None
                assert executor._free == [] and len(executor._all) == 1
            arena.src_data[:] = np.random.default_rng(round_).integers(1, 256, arena.nbytes, dtype=np.uint8)
            dev.copy_htod(arena.src, arena.src_data.ctypes.data, arena.nbytes)
    finally:
        arena.free()


async def test_an_evicted_launch_keeps_its_table_until_the_stream_is_past_it(
        drv: CudaDriver, dev: Device, executor: CudaExecutor) -> None:
    """A launch pushed out of the cache while its copy still waits in the stream gives its descriptor buffer
    back only once the stream is past that copy: handed to a later copy at once, the later copy's descriptors
    would overwrite the staged ones before the stream read them, and the earlier copy would land elsewhere."""
    from aiodatadist.cuda import executor as executor_module

    arena = Arena(dev, 1 << 20, 13)
    count = executor_module.LAUNCH_CACHE + 8
    hold = _hold(drv)
    try:
        await asyncio.gather(*(executor.wait(j) for j in _plan_jobs(executor, arena, count)))  # seen once: not kept
        assert len(executor._launches) == 0
        hold.value = 1
        blocker = executor.start(arena.spans([0], [(1 << 20) - 4096], [4096]))  # held: the stream waits on it
        await asyncio.sleep(0.05)
        jobs = _plan_jobs(executor, arena, count)
        assert not blocker.stopped.is_set()
        assert len(executor._retired) == count - executor_module.LAUNCH_CACHE  # evicted, still in the stream
        await asyncio.sleep(0.05)
        assert len(executor._retired) == count - executor_module.LAUNCH_CACHE  # (until the stream passes)
        hold.value = 0
        await asyncio.gather(*(executor.wait(j) for j in (blocker, *jobs)))
        arena.check()
        assert executor._retired == []  # back in the pool once the stream passed them
        buffers = len(executor._all)
        await asyncio.gather(*(executor.wait(j) for j in _plan_jobs(executor, arena, count)))
        arena.check()
        assert len(executor._all) == buffers  # the evicted ones' buffers were reused
    finally:
        hold.value = 0
        arena.free()


async def test_gpu_fault_fails_the_job(dev: Device, executor: CudaExecutor) -> None:
    arena = Arena(dev, 1 << 20, 9)
    stray = np.zeros(4096, dtype=np.uint8)  # not registered: the "GPU" cannot read it
    try:
        spans = arena.spans([0, 10], [100, 200], [10, 10])
        spans.src[1] = stray.ctypes.data
        with pytest.raises(CudaError) as info:
            await executor.run(spans, None)
        assert info.value.status_code == LLMStatusCode.LLM_DEVICE_MEM_ERROR
        assert "CUDA_ERROR_ILLEGAL_ADDRESS" in str(info.value)
        assert len(executor._free) == len(executor._all) == 1
    finally:
        arena.free()


async def test_launch_errors_fail_the_job_without_leaking(dev: Device, executor: CudaExecutor,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    arena = Arena(dev, 1 << 20, 10)
    try:
        monkeypatch.setenv("FAKE_CUDA_FAIL_LAUNCH", "1")
        with pytest.raises(CudaError, match="cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE") as info:
            await executor.run(arena.spans([0, 10], [100, 200], [10, 10]), None)
        assert info.value.status_code == LLMStatusCode.LLM_DEVICE_MEM_ERROR
        assert len(executor._free) == len(executor._all) == 1
        monkeypatch.delenv("FAKE_CUDA_FAIL_LAUNCH")
        monkeypatch.setenv("FAKE_CUDA_FAIL_EVENT", "1")  # no completion event: a stream callback instead
        monkeypatch.setenv("FAKE_CUDA_FAIL_CALLBACK", "1")  # nor that
        for spans in (arena.spans([0, 10], [100, 200], [10, 10]), arena.spans([0], [300], [10])):
            job = executor.start(spans)
            assert job.stopped.is_set()  # no callback: finished (after draining the stream) at once
            with pytest.raises(CudaError, match="cuStreamAddCallback failed"):
                await executor.wait(job)
        assert len(executor._free) == len(executor._all) == 1
        monkeypatch.delenv("FAKE_CUDA_FAIL_CALLBACK")
        for spans in (arena.spans([0, 10], [100, 200], [10, 10]), arena.spans([0], [300], [10])):
            await executor.run(spans)  # without an event, completed by the stream callback
        monkeypatch.delenv("FAKE_CUDA_FAIL_EVENT")
        drv = dev.driver
        drv.call("cuCtxSetCurrent", None)
        monkeypatch.setenv("FAKE_CUDA_FAIL_SET_CURRENT", "1")  # the launch cannot make its context current
        with pytest.raises(CudaError, match="cuCtxSetCurrent failed: CUDA_ERROR_INVALID_CONTEXT"):
            await executor.run(arena.spans([0, 10], [100, 200], [10, 10]))
        monkeypatch.delenv("FAKE_CUDA_FAIL_SET_CURRENT")
        assert len(executor._free) == len(executor._all) == 1
        monkeypatch.setenv("FAKE_CUDA_FAIL_HTOD", "1")  # the table cannot be staged: nothing is launched
        with pytest.raises(CudaError, match="cuMemcpyHtoDAsync_v2 failed: CUDA_ERROR_INVALID_VALUE"):
            await executor.run(arena.spans([0, 10], [100, 200], [10, 10]))
        monkeypatch.delenv("FAKE_CUDA_FAIL_HTOD")
        assert len(executor._free) == len(executor._all) == 1
        await executor.run(arena.spans([0, 10], [100, 200], [10, 10]))
        with pytest.raises(CudaError, match="cuLaunchKernel"):
            monkeypatch.setenv("FAKE_CUDA_FAIL_LAUNCH", "1")
            executor.run_sync(arena.spans([0, 10], [100, 200], [10, 10]))
    finally:
        arena.free()


async def test_closed_executor(dev: Device) -> None:
    executor = CudaExecutor(dev)
    executor.close()
    executor.close()
    with pytest.raises(LLMException, match="closed"):
        await executor.run(Spans(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.ones(1, np.uint64)), None)


# -- the kernel's indexing, run on the CPU ------------------------------------------------------------------------

EMULATION_SHIM = r"""
// Runs copy_kernel.cu on the CPU: one (block, thread) after the other (the kernel has no barriers).
#include <cstdint>
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct dim3_ { unsigned x, y, z; };
static dim3_ threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
template <typename T> inline T __ldcs(const T* p) { return *p; }
template <typename T> inline void __stcs(T* p, T v) { *p = v; }
#include "copy_kernel.cu"
extern "C" void emulate(const u64* src, const u64* dst, const u64* len, unsigned n, unsigned grid,
                        unsigned block) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; ++b)
        for (unsigned t = 0; t < block; ++t) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
            adt_copy_spans(src, dst, len, n);
        }
}
"""


@pytest.fixture(scope="session")
def emulated_kernel(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., None]:
    """``copy_kernel.cu`` compiled for the CPU by a C++ compiler, every CTA and thread run in turn."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to emulate the kernel")
    folder = tmp_path_factory.mktemp("emulated_kernel")
    (folder / "shim.cpp").write_text(EMULATION_SHIM)
    out = folder / "emulated_kernel.so"
    source_dir = Path(kernels.__file__).parent
    subprocess.run([cxx, "-O1", "-fno-strict-aliasing", "-shared", "-fPIC", "-Wno-unknown-pragmas",
                    f"-I{source_dir}", str(folder / "shim.cpp"), "-o", str(out)], check=True, timeout=120)
    fn = ctypes.CDLL(str(out)).emulate
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_uint] * 3
    fn.restype = None
    return fn


def run_emulated(fn: Callable[..., None], src: np.ndarray, dst: np.ndarray, model: np.ndarray, s_off: list[int],
                 d_off: list[int], lengths: list[int], sm_count: int) -> None:
    """Copy with the emulated kernel as the executor would launch it (pieces, geometry) and compare."""
    for s, d, n in zip(s_off, d_off, lengths, strict=True):
        model[d:d + n] = src[s:s + n]
    length = np.array(lengths, dtype=np.uint64)
    pieces = cuda.split_long_spans(np.array(s_off, dtype=np.uint64) + np.uint64(src.ctypes.data),
                                   np.array(d_off, dtype=np.uint64) + np.uint64(dst.ctypes.data), length,
                                   cuda.choose_piece(int(length.sum()), sm_count=sm_count))
    grid, block = cuda.launch_geometry(len(pieces), int(pieces.length.max()), sm_count=sm_count)
    fn(pieces.src.ctypes.data, pieces.dst.ctypes.data, pieces.length.ctypes.data, len(pieces), grid, block)
    bad = np.flatnonzero(dst != model)
    assert not len(bad), f"{len(bad)} wrong bytes, first at {bad[0]}"


@pytest.mark.parametrize("seed", range(3))
def test_kernel_random_spans_emulated(emulated_kernel: Callable[..., None], seed: int) -> None:
    rng = np.random.default_rng(seed)
    nbytes = 24 << 20
    src = rng.integers(1, 256, nbytes, dtype=np.uint8)
    dst = rng.integers(1, 256, nbytes, dtype=np.uint8)
    model = dst.copy()
    lengths = [int(n) for n in rng.integers(1, 70_000, 300)] + [int(n) for n in rng.integers(1, 100, 100)]
    lengths += [(3 << 20) + 5, 2 << 20]  # split into pieces
    d_off, at = [], 0
    for n in lengths:
        at += int(rng.integers(0, 64))
        d_off.append(at)
        at += n
    s_off = [int(rng.integers(0, nbytes - n)) for n in lengths]
    run_emulated(emulated_kernel, src, dst, model, s_off, d_off, lengths, sm_count=int(rng.integers(1, 4)))


def test_kernel_alignments_emulated(emulated_kernel: Callable[..., None]) -> None:
    """Every src/dst skew (16-byte path with head and tail, 8, 4, bytes), every head offset, lengths around the
    vector widths and the unrolled pass."""
    rng = np.random.default_rng(7)
    nbytes = 16 << 20
    src = rng.integers(1, 256, nbytes, dtype=np.uint8)
    dst = rng.integers(1, 256, nbytes, dtype=np.uint8)
    model = dst.copy()
    base_s = -src.ctypes.data % 16  # offsets from here are 16-aligned addresses
    base_d = -dst.ctypes.data % 16
    s_off: list[int] = []
    d_off: list[int] = []
    lengths: list[int] = []
    at = 0
    for skew in (0, 8, 4, 12, 2, 1, 3, 15):
        for head in range(16):
            for n in (1, 3, 15, 16, 17, 31, 33, 64, 65, 1023, 1024, 1025, 4097, 16_400, 70_000):
                s_off.append(base_s + (4096 * len(s_off)) % (8 << 20) + head)
                d_off.append(base_d + at + (head + skew) % 16)
                lengths.append(n)
                at += n + 32
                at += -at % 16
    assert at + 32 < nbytes
    run_emulated(emulated_kernel, src, dst, model, s_off, d_off, lengths, sm_count=2)


async def test_the_loop_learns_the_end_from_an_event(dev: Device, executor: CudaExecutor,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An awaited copy registers no stream callback: the loop queries an event recorded after it (a timer for
    most of its expected duration, then a query per loop iteration, then a thread for a late copy); the event
    is reused, and copies of 1 MiB and more teach the executor its rate."""
    from aiodatadist.cuda import executor as executor_module

    arena = Arena(dev, 4 << 20, 10)
    try:
        monkeypatch.setenv("FAKE_CUDA_DELAY_US", "20000")
        job = executor.start(arena.spans([0], [1 << 20], [2 << 20]))
        assert not completion_module._pending  # no callback is waiting for the driver's thread
        await executor.wait(job)
        assert job.stopped.is_set() and len(executor._events) == 1
        assert executor._rates != list(executor_module.FIRST_RATES)
        monkeypatch.delenv("FAKE_CUDA_DELAY_US")
        for i in range(4):  # back to back: the same event each time
            await executor.run(arena.spans([i * 1000, 10_000 + i], [3 << 20, (3 << 20) + 8192], [1000, 3000]))
        assert len(executor._events) == 1
        arena.check()
    finally:
        arena.free()


async def test_the_waiting_task_polls_the_event_and_a_cancelled_one_still_waits_for_the_gpu(
        drv: CudaDriver, dev: Device, executor: CudaExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a job's event is queried every loop iteration, the awaiting task queries it too (it goes on in the
    iteration that saw the end); cancelled there, it raises only once the GPU is done, and the bytes landed.
    (The copy is held on the "GPU", and polled for a minute past its expected end instead of 2 ms before a
    thread waits for it: a loop held up for 2 ms on a loaded machine would see the thread instead.)"""

    monkeypatch.setattr(completion_module, "POLL_FOR_S", 60.0)
    arena = Arena(dev, 1 << 20, 15)
    hold = _hold(drv)
    try:
        hold.value = 1
        job = executor.start(arena.spans([0, 5000], [100, 9000], [3000, 4000]))
        waiter = asyncio.create_task(executor.wait(job))
        for _ in range(5):
            await asyncio.sleep(0)
        watch = job.watch
        assert watch is not None and watch.polled_each_iteration() and not job.stopped.is_set()
        polled = watch.queries
        await asyncio.sleep(0)
        assert watch.queries >= polled + 2  # the loop's query and the waiting task's, each iteration
        waiter.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiter.done() and not watch.done  # cancelled, it still waits for the held copy
        hold.value = 0
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiter, 30)
        assert job.stopped.is_set() and watch.done
        arena.check()
        job = executor.start(arena.spans([10], [20_000], [100]))
        await executor.wait(job)
        assert job.stopped.is_set() and job.watch is not None and job.watch.done
        arena.check()
    finally:
        hold.value = 0
        arena.free()


async def test_timed_copies_know_their_gpu_time(dev: Device, executor: CudaExecutor,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``time_copies`` a copy runs between two timed events: its job learns the GPU's time for it (the
    emulator delays the copy 20 ms), the bytes still land, and both events go back to a pool of their own."""
    arena = Arena(dev, 1 << 20, 14)
    try:
        untimed = executor.start(arena.spans([0, 10], [100, 300], [10, 20]))
        await executor.wait(untimed)
        assert untimed.gpu_seconds == 0.0
        executor.time_copies = True
        monkeypatch.setenv("FAKE_CUDA_DELAY_US", "20000")
        for spans in (arena.spans([0], [1 << 19], [4096]), arena.spans([0, 5000], [2 << 18, 3 << 18], [100, 200])):
            job = executor.start(spans)
            await executor.wait(job)
            assert 0.015 < job.gpu_seconds < job.seen_at - job.enqueued_at
        arena.check()
        assert len(executor._timed_events) == 2 and len(executor._events) == 1
    finally:
        arena.free()


def test_the_expected_rate_is_only_raised_by_copies_found_done_after_a_timer(executor: CudaExecutor) -> None:
    """A copy seen complete at the first query after a timer may have ended long before: its apparent rate is a
    lower bound, so it doubles the expectation (or takes the apparent rate if higher) and never lowers it; a
    copy that had to be polled measures the rate within a loop iteration and moves the average; small copies and
    the cap leave it alone."""
    from aiodatadist.cuda import executor as executor_module

    event = ctypes.c_void_p(0)
    executor._rates[0] = 10e9
    executor._event_done(event, 256 << 20, 0.1, True)  # apparent 2.7 GB/s, slower than expected: no lowering
    assert executor._rates[0] == 20e9
    executor._event_done(event, 256 << 20, (256 << 20) / 1e12, True)
    assert executor._rates[0] == pytest.approx(1e12)
    executor._event_done(event, 256 << 20, (256 << 20) / 0.5e12, False)  # polled: an honest measurement
    assert executor._rates[0] == pytest.approx(0.8 * 1e12 + 0.2 * 0.5e12)
    executor._event_done(event, 4096, 1e-9, False)  # small: says nothing about the rate
    assert executor._rates[0] == pytest.approx(0.9e12)
    for _ in range(10):
        executor._event_done(event, 256 << 20, 1e-9, True)
    assert executor._rates[0] == executor_module.MAX_RATE
    executor._events.clear()  # (the null event handles above are not the executor's)


def test_latency_bound_copies_and_copies_over_the_bus_leave_the_device_rate_alone(dev: Device,
                                                                                 executor: CudaExecutor) -> None:
    """A 2 MiB copy seen ~20 us after its enqueue measures the launch's latency, not the rate (counting it made
    the next 256 MiB copy sleep on a timer for 7x its duration); copies to or from page-locked host memory keep
    a rate of their own, so a swap never makes a device copy sleep for a bus copy's time, nor the reverse."""

    event = ctypes.c_void_p(0)
    executor._rates[:] = [2e12, 50e9]
    for _ in range(50):
        executor._event_done(event, 2 << 20, 20e-6, False)
    assert executor._rates == [2e12, 50e9]
    executor._event_done(event, 256 << 20, (256 << 20) / 40e9, False, kind=launches_module.OVER_THE_BUS)
    assert executor._rates == [2e12, pytest.approx(0.8 * 50e9 + 0.2 * 40e9)]
    executor._events.clear()
    a, b, pinned = dev.alloc(4096), dev.alloc(4096), dev.alloc_pinned(4096)
    try:
        assert executor.launches.kind(a, b) == launches_module.DEVICE_ONLY
        assert executor.launches.kind(pinned, b) == executor.launches.kind(a, pinned) == launches_module.OVER_THE_BUS
    finally:
        dev.free(a)
        dev.free(b)
        dev.free_pinned(pinned)
