"""vllm-ascend's KV registration on an NPU, for the drop-in module's flow tests: each layer's K and V in memory of
torch_npu's kind (a caching-allocator segment from ``aclrtMalloc``, called here directly, not through
aiodatadist), every tensor 2 MiB-aligned inside it and none at its base, registered with a ``CacheDesc`` without
a placement (``Placement.DEVICE``) and ``data_ptr()``-style int addresses.  Run as a script it is the prompt
side:

    python llmdd_npu.py CLUSTER_ID PORT DECODER_ID LAYERS BLOCKS BLOCK_ELEMS TRANSPORT

It fills its tensors with ``aiodatadist.testing.pattern`` bytes (seed = its cluster id), links with the decoder,
prints ``READY`` and waits for a line on stdin before it unlinks and finalizes.
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

import numpy as np

if __name__ == "__main__":  # run as a script: tests/ onto the path, as pytest has it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from aiodatadist.acl.device import acl_device
from aiodatadist.compat import llm_datadist
from aiodatadist.testing import pattern
from helpers.llmdd_prompt import rank_table, worker_init

ALIGN = 2 << 20
ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST = 1, 2


class NpuKv:
    """K and V of every layer in one segment, as vllm-ascend's ``_align_memory`` slices them."""

    def __init__(self, tensors: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self.device = acl_device(0)
        self.device.bind_thread()
        lib = self.device.library
        stride = -(-nbytes // ALIGN) * ALIGN
        ptr = ctypes.c_void_p()
        lib.call("aclrtMalloc", ctypes.byref(ptr), ALIGN + tensors * stride + ALIGN, 1)  # ACL_MEM_MALLOC_HUGE_ONLY
        self.segment = ptr.value or 0
        self.addrs = [self.segment + ALIGN + i * stride for i in range(tensors)]  # aligned, none at the base

    def write(self, t: int, data: np.ndarray) -> None:
        self.device.copy(self.addrs[t], data.ctypes.data, self.nbytes, ACL_MEMCPY_HOST_TO_DEVICE)

    def read(self, t: int) -> np.ndarray:
        out = np.empty(self.nbytes, dtype=np.uint8)
        self.device.copy(out.ctypes.data, self.addrs[t], self.nbytes, ACL_MEMCPY_DEVICE_TO_HOST)
        return out

    def free(self) -> None:
        self.device.bind_thread()
        self.device.library.call("aclrtFree", ctypes.c_void_p(self.segment))


def main() -> int:
    cluster_id, port, decoder_id, layers, blocks, block_elems = map(int, sys.argv[1:7])
    datadist = worker_init(llm_datadist.LLMRole.PROMPT, cluster_id, port, sys.argv[7])
    nbytes = blocks * block_elems * 2
    kv = NpuKv(2 * layers, nbytes)
    for t in range(2 * layers):
        kv.write(t, pattern(cluster_id, t, nbytes))
    desc = llm_datadist.CacheDesc(2 * layers, [blocks, block_elems], llm_datadist.DataType.DT_FLOAT16)
    cache = datadist.cache_manager.register_blocks_cache(desc, kv.addrs,
                                                         llm_datadist.BlocksCacheKey(cluster_id=cluster_id))
    comm_id = datadist.link(f"pd_comm_{cluster_id}_{decoder_id}", {cluster_id: 0, decoder_id: 1}, rank_table(port))
    while (status := datadist.query_register_mem_status(comm_id=comm_id)) != llm_datadist.RegisterMemStatus.OK:
        if status == llm_datadist.RegisterMemStatus.FAILED:
            print("FAILED", flush=True)
            return 1
        time.sleep(0.05)
    print("READY", flush=True)
    sys.stdin.readline()
    datadist.unlink(comm_id)
    datadist.cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    kv.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
