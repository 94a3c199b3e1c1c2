"""vllm-ascend's ``LLMDataDistCMgrConnector`` flow on NPU memory, through ``aiodatadist.compat.llm_datadist``, on
the ACL runtime (an Ascend NPU, or the emulated runtime where there is none): both sides register K and V of every
layer as torch_npu hands them over (``data_ptr()`` ints inside caching-allocator segments, 2 MiB-aligned, none at a
segment's base, a ``CacheDesc`` without a placement), link with the rank table, poll ``query_register_mem_status``
and the decoder pulls blocks with the blocking ``pull_blocks`` from a single-thread executor, as the connector
does.  Two processes on one host (IPC export keys; CANN 9 and, emulated, 8.5) and over a TCP link (staged).  Every byte is checked; addresses
outside any allocation are refused."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.ids import new_cluster_id
from helpers.llmdd_npu import NpuKv
from helpers.llmdd_prompt import rank_table, worker_init

from aiodatadist.compat import llm_datadist
from aiodatadist.errors import LLMException, LLMStatusCode
from aiodatadist.testing import free_port, pattern

pytestmark = pytest.mark.usefixtures("device_runtime")
LAYERS, BLOCKS, BLOCK_ELEMS = 4, 16, 2048  # float16: 4 KiB per block and tensor
SCRIPT = Path(__file__).resolve().parent.parent / "helpers" / "llmdd_npu.py"


@pytest.fixture(autouse=True)
def _acl_only(device_runtime: str) -> None:
    if device_runtime != "acl":
        pytest.skip("the vllm-ascend flow is the ACL runtime's")


@pytest.mark.parametrize(("transport", "cann"), [("auto", 9), ("tcp", 9), ("auto", 8)],
                         ids=["same-host-ipc", "tcp-staged", "same-host-ipc-cann8"])
def test_vllm_ascend_flow_on_npu_memory(transport: str, cann: int, runtime_mode: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``cann`` 8: the emulated runtime as CANN 8.5, without ``aclrtMemGetAddressRange`` (the tensors' ranges
    rounded out to 2 MiB are exported)."""
    if cann == 8:
        if runtime_mode != "emulated":
            pytest.skip("the CANN version is the installed one")
        monkeypatch.setenv("FAKE_ACL_VERSION", "8")
    prompt_id, decoder_id, port = new_cluster_id(), new_cluster_id(), free_port()
    prompt = subprocess.Popen([sys.executable, str(SCRIPT), str(prompt_id), str(port), str(decoder_id), str(LAYERS),
                               str(BLOCKS), str(BLOCK_ELEMS), transport],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    kv: NpuKv | None = None
    try:
        datadist = worker_init(llm_datadist.LLMRole.DECODER, decoder_id, None, transport)
        cache_manager = datadist.cache_manager
        nbytes = BLOCKS * BLOCK_ELEMS * 2
        kv = NpuKv(2 * LAYERS, nbytes)
        for t in range(2 * LAYERS):
            kv.write(t, np.full(nbytes, 7, dtype=np.uint8))  # not what the prompt holds
        desc = llm_datadist.CacheDesc(2 * LAYERS, [BLOCKS, BLOCK_ELEMS], llm_datadist.DataType.DT_FLOAT16)
        assert desc.placement == llm_datadist.Placement.DEVICE
        cache = cache_manager.register_blocks_cache(desc, kv.addrs, llm_datadist.BlocksCacheKey(cluster_id=decoder_id))
        comm_id = datadist.link(f"pd_comm_{prompt_id}_{decoder_id}", {prompt_id: 0, decoder_id: 1}, rank_table(port))
        deadline = time.monotonic() + 60
        while (status := datadist.query_register_mem_status(comm_id=comm_id)) != llm_datadist.RegisterMemStatus.OK:
            assert status != llm_datadist.RegisterMemStatus.FAILED, "link FAILED"
            assert time.monotonic() < deadline, "link never came up"
            time.sleep(0.05)
        assert prompt.stdout is not None and prompt.stdout.readline().strip() == "READY"
        links = datadist.links()
        assert len(links) == 1 and links[0]["plane"] == ("tcp" if transport == "tcp" else "shm")

        remote = llm_datadist.BlocksCacheKey(cluster_id=prompt_id)
        pairs = [(3, 0), (9, 1), (4, 2), (12, 3), (13, 8), (14, 9)]
        with concurrent.futures.ThreadPoolExecutor(1) as executor:  # as the connector pulls
            executor.submit(cache_manager.pull_blocks, remote, cache, [r for r, _ in pairs[:4]],
                            [loc for _, loc in pairs[:4]]).result(60)
            executor.submit(cache_manager.pull_blocks, remote, cache, [r for r, _ in pairs[4:]],
                            [loc for _, loc in pairs[4:]]).result(60)
        touched = {loc for _, loc in pairs}
        for t in range(2 * LAYERS):
            got = kv.read(t).reshape(BLOCKS, -1)
            theirs = pattern(prompt_id, t, nbytes).reshape(BLOCKS, -1)
            for r, loc in pairs:
                assert np.array_equal(got[loc], theirs[r]), (t, loc)
            assert (got[sorted(set(range(BLOCKS)) - touched)] == 7).all()

        prompt.stdin.write("done\n")  # type: ignore[union-attr]
        prompt.stdin.flush()  # type: ignore[union-attr]
        assert prompt.wait(30) == 0
        datadist.unlink(comm_id)
        cache_manager.unregister_cache(cache.cache_id)
        datadist.finalize()
    finally:
        if prompt.poll() is None:
            prompt.kill()
        prompt.wait(10)
        if kv is not None:
            kv.free()


def test_addresses_outside_any_allocation_are_refused() -> None:
    datadist = worker_init(llm_datadist.LLMRole.DECODER, new_cluster_id())
    kv = NpuKv(2, 1 << 20)  # an 8 MiB segment: 2 MiB, the tensors at 2 and 4 MiB (2 MiB apart), 2 MiB
    try:
        desc = llm_datadist.CacheDesc(2, [16, 32768], llm_datadist.DataType.DT_FLOAT16)
        host = np.zeros(1 << 20, dtype=np.uint8)
        for addrs in ([int(host.ctypes.data)] * 2,  # host memory
                      [kv.addrs[0], kv.segment + (64 << 20)],  # past the segment's end
                      [kv.addrs[0], kv.segment + (8 << 20) - (512 << 10)]):  # running past the segment's end
            with pytest.raises(LLMException) as info:
                datadist.cache_manager.register_blocks_cache(desc, addrs)
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        cache = datadist.cache_manager.register_blocks_cache(desc, kv.addrs)  # inside: fine
        datadist.cache_manager.unregister_cache(cache.cache_id)
    finally:
        datadist.finalize()
        kv.free()
