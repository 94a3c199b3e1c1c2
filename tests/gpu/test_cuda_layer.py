"""The CUDA layer on a real GPU: driver wrapper, the pointer-list kernel, IPC, async completion and cancellation.

Skipped without a usable GPU (see conftest.py).  Every check is byte-exact against a numpy model, with random
non-zero data so that untouched or zeroed memory never passes for copied bytes.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numpy as np
import pytest

from aiodatadist.cuda import CudaError, Device, cuda_status, get_device
from aiodatadist.cuda.driver import CUDA_SUCCESS
from aiodatadist.cuda.executor import CudaExecutor, CudaJob
from aiodatadist.errors import LLMException, LLMStatusCode
from aiodatadist.layout.plans import Spans

MiB = 1 << 20


def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8)


def upload(device: Device, data: np.ndarray) -> int:
    ptr = device.alloc(data.nbytes)
    device.copy_htod(ptr, data.ctypes.data, data.nbytes)
    return ptr


def download(device: Device, ptr: int, nbytes: int) -> np.ndarray:
    out = np.zeros(nbytes, dtype=np.uint8)
    device.copy_dtoh(out.ctypes.data, ptr, nbytes)
    return out


def spans_of(src: list[int], dst: list[int], length: list[int]) -> Spans:
    return Spans(np.array(src, dtype=np.uint64), np.array(dst, dtype=np.uint64), np.array(length, dtype=np.uint64))


class Pair:
    """A source and a destination buffer on the device, both random, and a numpy model of the destination."""

    def __init__(self, device: Device, nbytes: int, seed: int) -> None:
        self.device, self.nbytes = device, nbytes
        self.src_data = random_bytes(nbytes, seed)
        self.model = random_bytes(nbytes, seed + 1)
        self.src = upload(device, self.src_data)
        self.dst = upload(device, self.model)

    def spans(self, s_off: list[int], d_off: list[int], lengths: list[int]) -> Spans:
        """Device spans for these offsets; the model applies them too."""
        for s, d, n in zip(s_off, d_off, lengths, strict=True):
            self.model[d:d + n] = self.src_data[s:s + n]
        return spans_of([self.src + s for s in s_off], [self.dst + d for d in d_off], lengths)

    def check(self) -> None:
        got = download(self.device, self.dst, self.nbytes)
        bad = np.flatnonzero(got != self.model)
        assert not len(bad), f"{len(bad)} wrong bytes, first at offset {bad[0] if len(bad) else -1}"

    def free(self) -> None:
        self.device.free(self.src)
        self.device.free(self.dst)


@pytest.fixture
def pair(device: Device) -> Iterator[Pair]:
    p = Pair(device, 64 * MiB, 11)
    yield p
    p.free()


@pytest.fixture
def executor(device: Device) -> Iterator[CudaExecutor]:
    ex = CudaExecutor(device)
    yield ex
    ex.close()


def random_layout(rng: np.random.Generator, count: int, max_len: int, nbytes: int) -> tuple[
        list[int], list[int], list[int]]:
    """``count`` spans of 1..max_len bytes: destinations disjoint (random gaps, so random alignment),
    sources anywhere."""
    lengths = [int(n) for n in rng.integers(1, max_len + 1, count)]
    d_off, at = [], 0
    for n in lengths:
        at += int(rng.integers(0, 100))
        d_off.append(at)
        at += n
    assert at <= nbytes
    s_off = [int(rng.integers(0, nbytes - n + 1)) for n in lengths]
    return s_off, d_off, lengths


# -- driver wrapper -------------------------------------------------------------------------------------------


def test_device_and_status(device: Device) -> None:
    assert device.name and device.sm_count > 0 and device.compute_capability >= (7, 5)
    assert get_device(0) is device
    status = cuda_status()
    assert status.startswith("CUDA driver ") and device.name in status


def test_alloc_free_and_pointer_queries(device: Device) -> None:
    ptr = device.alloc(3 * MiB + 5)
    try:
        assert ptr % 256 == 0
        base, size = device.address_range(ptr + 12345)
        assert base == ptr and size >= 3 * MiB + 5
        assert device.is_device_pointer(ptr) and device.is_device_pointer(ptr + 100)
        host = np.zeros(16, dtype=np.uint8)
        assert not device.is_device_pointer(host.ctypes.data)
    finally:
        device.free(ptr)
    with pytest.raises(CudaError) as info:
        device.alloc(1 << 50)  # 1 PiB
    assert info.value.status_code == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
    assert str(info.value).startswith("cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY")


def test_htod_dtoh_dtod_memset(device: Device) -> None:
    data = random_bytes(16 * MiB + 3, 1)
    a = upload(device, data)
    b = device.alloc(data.nbytes)
    try:
        assert np.array_equal(download(device, a, data.nbytes), data)
        device.copy_dtod(b, a, data.nbytes)
        assert np.array_equal(download(device, b, data.nbytes), data)
        device.memset(b + 7, 0xAB, 1000)
        got = download(device, b, data.nbytes)
        assert (got[7:1007] == 0xAB).all() and np.array_equal(got[1007:], data[1007:])
        assert np.array_equal(got[:7], data[:7])
    finally:
        device.free(a)
        device.free(b)


def test_make_current_from_other_threads(device: Device) -> None:
    import threading

    out: list[int] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            ptr = device.alloc(MiB)
            device.memset(ptr, 1, MiB)
            out.append(int(download(device, ptr, MiB).sum()))
            device.free(ptr)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and out == [MiB] * 4


def test_pinned_and_registered_host_memory(device: Device) -> None:
    pinned = device.alloc_pinned(MiB)
    try:
        assert device.host_device_pointer(pinned) == pinned  # unified addressing
        view = np.ctypeslib.as_array((ctypes.c_uint8 * MiB).from_address(pinned))
        view[:] = random_bytes(MiB, 2)
        dev = device.alloc(MiB)
        device.copy_htod(dev, pinned, MiB)
        assert np.array_equal(download(device, dev, MiB), view)
        device.free(dev)
    finally:
        device.free_pinned(pinned)
    host = random_bytes(8 * MiB, 3)
    dptr = device.register_host(host.ctypes.data, host.nbytes)
    try:
        assert dptr == host.ctypes.data
        assert not device.is_device_pointer(dptr)
    finally:
        device.unregister_host(host.ctypes.data)


def test_ipc_handle_needs_the_base(device: Device) -> None:
    ptr = device.alloc(MiB)
    try:
        assert len(device.ipc_handle(ptr)) == 64
        with pytest.raises(LLMException) as info:
            device.ipc_handle(ptr + 256)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    finally:
        device.free(ptr)


# -- the kernel -----------------------------------------------------------------------------------------------


async def test_random_scattered_spans(pair: Pair, executor: CudaExecutor) -> None:
    rng = np.random.default_rng(5)
    await executor.run(pair.spans(*random_layout(rng, 300, 70_000, pair.nbytes)), None)
    pair.check()


async def test_every_alignment_and_length(pair: Pair, executor: CudaExecutor) -> None:
    """src/dst skew 0 (16-byte path with head and tail), 8, 4 and the byte path, every head offset mod 16,
    lengths around the vector widths."""
    s_off: list[int] = []
    d_off: list[int] = []
    lengths: list[int] = []
    at = 0
    for skew in (0, 8, 4, 12, 2, 1, 3, 15):
        for head in range(16):
            for n in (1, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 255, 1000, 4097, 70_000):
                s_off.append((1 << 20) + 4096 * len(s_off) % (32 << 20) + head)
                d_off.append(at + ((head + skew) % 16))
                lengths.append(n)
                at += n + 32
                at += -at % 16
    await executor.run(pair.spans(s_off, d_off, lengths), None)
    pair.check()


async def test_aligned_blocks(pair: Pair, executor: CudaExecutor) -> None:
    block = 32 << 10
    n = pair.nbytes // block
    rng = np.random.default_rng(6)
    s_idx, d_idx = rng.permutation(n), rng.permutation(n)
    await executor.run(pair.spans((s_idx * block).tolist(), (d_idx * block).tolist(), [block] * n), None)
    pair.check()


async def test_long_spans_are_split(pair: Pair, executor: CudaExecutor) -> None:
    # three long spans, one unaligned: pieces of choose_piece() bytes, one CTA each
    await executor.run(pair.spans([3, 20 * MiB, 40 * MiB], [1, 21 * MiB + 16, 42 * MiB],
                                  [19 * MiB, 20 * MiB, 22 * MiB - 1]), None)
    pair.check()


async def test_single_span_uses_memcpy(pair: Pair, executor: CudaExecutor) -> None:
    await executor.run(pair.spans([5], [1001], [50 * MiB]), None)
    pair.check()
    await executor.run(pair.spans([], [], []), None)
    executor.run_sync(pair.spans([0, 100], [60 * MiB, 61 * MiB], [1000, 2000]))
    pair.check()


async def test_registered_host_memory_as_source_and_destination(device: Device, executor: CudaExecutor) -> None:
    n = 32 * MiB
    host_src = random_bytes(n, 7)
    host_dst = random_bytes(n, 8)
    model = host_dst.copy()
    src = device.register_host(host_src.ctypes.data, n)
    dst = device.register_host(host_dst.ctypes.data, n)
    buf = device.alloc(n)
    try:
        rng = np.random.default_rng(9)
        s_off, d_off, lengths = random_layout(rng, 200, 70_000, n)
        # host -> device with the kernel (zero-copy reads), scattered
        await executor.run(spans_of([src + s for s in s_off], [buf + d for d in d_off], lengths), None)
        # device -> host with the kernel (zero-copy writes), scattered, to the same offsets
        await executor.run(spans_of([buf + d for d in d_off], [dst + d for d in d_off], lengths), None)
        for s, d, k in zip(s_off, d_off, lengths, strict=True):
            model[d:d + k] = host_src[s:s + k]
        assert np.array_equal(host_dst, model)
        # whole buffers with cuMemcpyAsync (one span)
        await executor.run(spans_of([src], [buf], [n]), None)
        await executor.run(spans_of([buf], [dst], [n]), None)
        assert np.array_equal(host_dst, host_src)
    finally:
        device.free(buf)
        device.unregister_host(host_src.ctypes.data)
        device.unregister_host(host_dst.ctypes.data)


async def test_many_concurrent_jobs(pair: Pair, executor: CudaExecutor) -> None:
    rng = np.random.default_rng(10)
    jobs: list[CudaJob] = []
    region = pair.nbytes // 64
    for i in range(64):  # disjoint destination regions, scattered spans inside each
        s_off, d_off, lengths = random_layout(rng, 20, 8000, region)
        jobs.append(executor.start(pair.spans(s_off, [i * region + d for d in d_off], lengths)))
    await asyncio.gather(*(executor.wait(j) for j in jobs))
    pair.check()
    assert all(j.stopped.is_set() for j in jobs)
    assert len(executor._free) == len(executor._all) <= 64


# -- IPC with another process -------------------------------------------------------------------------------


def _ipc_child(conn: Connection, nbytes: int, seed: int) -> None:
    """In a spawned process: allocate and fill device memory, send its IPC handle, keep it until told."""
    device = get_device(0)
    ptr = upload(device, random_bytes(nbytes, seed))
    conn.send(device.ipc_handle(ptr))
    conn.recv()
    device.free(ptr)
    conn.close()


async def test_ipc_from_another_process(device: Device, executor: CudaExecutor) -> None:
    nbytes, seed = 24 * MiB + 77, 12
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_child, args=(child, nbytes, seed), daemon=True)
    proc.start()
    local = device.alloc(nbytes)
    try:
        assert await asyncio.to_thread(parent.poll, 120), "the child sent no handle"
        handle = parent.recv()
        assert isinstance(handle, bytes) and len(handle) == 64
        remote = device.ipc_open(handle)
        try:
            assert device.is_device_pointer(remote)
            expected = random_bytes(nbytes, seed)
            await executor.run(spans_of([remote], [local], [nbytes]), None)  # one span: cuMemcpyAsync
            assert np.array_equal(download(device, local, nbytes), expected)
            device.memset(local, 0, nbytes)
            rng = np.random.default_rng(13)
            s_off, d_off, lengths = random_layout(rng, 300, 70_000, nbytes)
            await executor.run(spans_of([remote + s for s in s_off], [local + d for d in d_off], lengths), None)
            got = download(device, local, nbytes)
            model = np.zeros(nbytes, dtype=np.uint8)
            for s, d, k in zip(s_off, d_off, lengths, strict=True):
                model[d:d + k] = expected[s:s + k]
            assert np.array_equal(got, model)
        finally:
            device.ipc_close(remote)
    finally:
        device.free(local)
        parent.send(None)
        await asyncio.to_thread(proc.join, 60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


# -- asynchronous completion and cancellation ------------------------------------------------------------------


def stream_idle(executor: CudaExecutor, grace: float = 0.005) -> bool:
    """Whether the executor's stream has nothing queued or running.  ``grace`` covers the last stream
    callback, which may still be returning into the driver when the job's waiter wakes up (microseconds; a
    copy still running would take far longer)."""
    deadline = time.perf_counter() + grace
    while executor.device.driver.fn("cuStreamQuery")(executor._stream) != CUDA_SUCCESS:
        if time.perf_counter() > deadline:
            return False
        time.sleep(0.0001)
    return True


@pytest.fixture
def big_host_source(device: Device) -> Iterator[tuple[int, np.ndarray]]:
    """1 GiB of registered host memory (random 64 MiB pattern, repeated): read over PCIe, tens of ms."""
    data = np.tile(random_bytes(64 * MiB, 14), 16)
    ptr = device.register_host(data.ctypes.data, data.nbytes)
    yield ptr, data
    device.unregister_host(data.ctypes.data)


@pytest.fixture
def big_device_buffer(device: Device) -> Iterator[int]:
    ptr = device.alloc(1 << 30)
    yield ptr
    device.free(ptr)


def big_spans(src: int, dst: int) -> Spans:
    half = 1 << 29  # two spans: the kernel, cut into pieces
    return spans_of([src, src + half], [dst + half, dst], [half, half])


async def test_completion_does_not_block_the_loop(device: Device, executor: CudaExecutor,
                                                  big_host_source: tuple[int, np.ndarray],
                                                  big_device_buffer: int) -> None:
    src, data = big_host_source
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    job = executor.start(big_spans(src, big_device_buffer))
    started = time.perf_counter() - t0
    await executor.wait(job)
    elapsed = time.perf_counter() - t0
    task.cancel()
    assert started < 0.05, f"start() took {started * 1e3:.1f} ms"
    assert job.stopped.is_set() and stream_idle(executor)
    print(f"1 GiB host->device in {elapsed * 1e3:.1f} ms ({(1 << 30) / elapsed / 1e9:.1f} GB/s), "
          f"{ticks} loop ticks meanwhile")
    assert ticks >= 3 or elapsed < 0.01
    half = 1 << 29
    got = download(device, big_device_buffer, 1 << 30)
    assert np.array_equal(got[half:], data[:half]) and np.array_equal(got[:half], data[half:])


async def test_cancelled_wait_returns_only_after_the_gpu(device: Device, executor: CudaExecutor,
                                                         big_host_source: tuple[int, np.ndarray],
                                                         big_device_buffer: int) -> None:
    src, data = big_host_source
    device.memset(big_device_buffer, 0, 1 << 30)
    job = executor.start(big_spans(src, big_device_buffer))
    task = asyncio.create_task(executor.wait(job))
    await asyncio.sleep(0)
    assert not job.stopped.is_set(), "1 GiB over PCIe finished within one loop iteration?"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # nothing of the job is queued or running any more, and the copy ran to its end
    assert job.stopped.is_set() and stream_idle(executor)
    half = 1 << 29
    got = download(device, big_device_buffer, 1 << 30)
    assert np.array_equal(got[half:], data[:half]) and np.array_equal(got[:half], data[half:])
    # cancel(job, error): the waiter raises that error once the GPU is done
    job = executor.start(big_spans(src, big_device_buffer))
    executor.cancel(job, LLMException("deadline", status_code=LLMStatusCode.LLM_TIMEOUT))
    with pytest.raises(LLMException, match="deadline"):
        await executor.wait(job)
    assert job.stopped.is_set() and stream_idle(executor)


# -- a faulting copy fails its job (in a child process: the fault ends the CUDA context) --------------------


def _fault_child(conn: Connection) -> None:
    async def main() -> str:
        device = get_device(0)
        executor = CudaExecutor(device)
        dst = device.alloc(MiB)
        bogus = 0x10  # no memory there
        try:
            await asyncio.wait_for(executor.run(spans_of([bogus, bogus + 4096], [dst, dst + 4096],
                                                         [4096, 4096]), None), 60)
        except CudaError as exc:
            return f"CudaError {int(exc.status_code)} {exc}"
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            return f"other {type(exc).__name__}: {exc}"
        return "no error"

    try:
        conn.send(asyncio.run(main()))
    finally:
        conn.close()


def test_gpu_fault_fails_the_job_instead_of_hanging() -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_fault_child, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "the faulting copy never completed"
        result = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert result.startswith(f"CudaError {int(LLMStatusCode.LLM_DEVICE_MEM_ERROR)} "), result
    assert "CUDA_ERROR_" in result, result


# -- sharing memory with torch (same primary context) --------------------------------------------------------


async def test_torch_tensors(executor: CudaExecutor) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    src = torch.randint(1, 256, (8 * MiB,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    await executor.run(spans_of([src.data_ptr(), src.data_ptr() + 4 * MiB],
                                [dst.data_ptr() + 4 * MiB, dst.data_ptr()], [4 * MiB, 4 * MiB]), None)
    assert torch.equal(dst[4 * MiB:], src[:4 * MiB]) and torch.equal(dst[:4 * MiB], src[4 * MiB:])


def test_a_plan_launch_is_prepared_once_and_never_reused_for_other_addresses(device: Device,
                                                                            executor: CudaExecutor) -> None:
    """``start_plan`` keeps a plan's launch (from its second sight) per pair of tensor address lists: the same call
    reuses it, a call with another destination gets its own, and each lands its bytes where its addresses say."""
    from aiodatadist.layout.plans import Runs, make_plan

    tensors, block = 4, 4096
    runs = Runs(np.array([0, 3 * block], np.int64), np.array([2 * block, 0], np.int64), np.array([block, block],
                                                                                                  np.int64))
    plan = make_plan(np.arange(tensors, dtype=np.int64), np.arange(tensors, dtype=np.int64), runs)
    src = [Pair(device, 4 * block, 30 + t) for t in range(tensors)]
    first = [Pair(device, 4 * block, 40 + t) for t in range(tensors)]
    second = [Pair(device, 4 * block, 50 + t) for t in range(tensors)]
    try:
        src_addrs = np.array([p.src for p in src], np.uint64)

        def run(dst: list[Pair]) -> None:
            dst_addrs = np.array([p.dst for p in dst], np.uint64)
            for s, d in zip(src, dst, strict=True):
                d.model[2 * block:3 * block] = s.src_data[:block]
                d.model[:block] = s.src_data[3 * block:4 * block]

            async def go() -> None:
                await executor.wait(executor.start_plan(plan, src_addrs, dst_addrs))

            asyncio.run(go())
            for d in dst:
                d.check()

        run(first)
        assert len(executor._launches) == 0  # seen once: not kept
        run(first)
        prepared = dict(executor._launches)
        assert len(prepared) == 1  # seen again: kept
        run(first)
        assert dict(executor._launches) == prepared  # the same launch, not a second one
        run(second)  # the same plan into other memory: its own launch, its bytes where they belong
        run(second)
        assert len(executor._launches) == len(prepared) + 1
        for p in first:
            p.check()  # untouched by the second call
    finally:
        for p in (*src, *first, *second):
            p.free()
