"""The prompt side of the LLM-DataDist conformance test, written as vllm-ascend's LLMDataDistCMgrConnector drives
LLM-DataDist, against the drop-in module.  Run as a script:

    python llmdd_prompt.py CLUSTER_ID PORT DECODER_ID LAYERS BLOCKS BLOCK_ELEMS

It registers caller memory for K and V of every layer (one blocks cache, K,V,K,V... order), fills it with
``aiodatadist.testing.pattern`` bytes (seed = its cluster id), brings up the two-sided link with the decoder,
prints ``READY``, and waits for a line on stdin before it unlinks and finalizes.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from aiodatadist.compat import llm_datadist
from aiodatadist.testing import pattern


def rank_table(prompt_port: int) -> str:
    """The 2-rank table both sides build: prefill device rank "0", decode "1" (here with host IPs and ports)."""
    return json.dumps({"version": "1.2", "server_count": "1", "status": "completed", "server_list": [
        {"server_id": "127.0.0.1", "device": [
            {"device_id": "0", "device_ip": "127.0.0.1", "rank_id": "0", "device_port": prompt_port},
            {"device_id": "1", "device_ip": "127.0.0.1", "rank_id": "1"}]}]})


def worker_init(role: llm_datadist.LLMRole, cluster_id: int, listen_port: int | None = None,
                transport: str = "auto") -> llm_datadist.LLMDataDist:
    """An initialized instance, configured as the connector's worker init does it (``transport``: the
    ``llm.Transport`` option, ``auto`` or ``tcp``)."""
    datadist = llm_datadist.LLMDataDist(role, cluster_id)
    config = llm_datadist.LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 20000
    config.enable_switch_role = True
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.link_total_time = 30
    if listen_port is not None:
        config.listen_ip_info = f"127.0.0.1:{listen_port}"
    datadist.init({**config.generate_options(), "llm.Transport": transport})
    return datadist


def main() -> int:
    cluster_id, port, decoder_id, layers, blocks, block_elems = map(int, sys.argv[1:7])
    datadist = worker_init(llm_datadist.LLMRole.PROMPT, cluster_id, port)
    cache_manager = datadist.cache_manager
    kv = [np.frombuffer(pattern(cluster_id, t, blocks * block_elems * 2), dtype=np.float16).reshape(blocks, -1).copy()
          for t in range(2 * layers)]
    desc = llm_datadist.CacheDesc(len(kv), [blocks, block_elems], llm_datadist.DataType.DT_FLOAT16,
                                  llm_datadist.Placement.HOST)  # host memory: there is no NPU here
    cache = cache_manager.register_blocks_cache(desc, [int(t.ctypes.data) for t in kv],
                                                llm_datadist.BlocksCacheKey(cluster_id=cluster_id))
    comm_id = datadist.link(f"pd_comm_{cluster_id}_{decoder_id}", {cluster_id: 0, decoder_id: 1}, rank_table(port))
    while True:
        status = datadist.query_register_mem_status(comm_id=comm_id)
        if status == llm_datadist.RegisterMemStatus.OK:
            break
        if status == llm_datadist.RegisterMemStatus.FAILED:
            print("FAILED", flush=True)
            return 1
        time.sleep(0.05)
    print("READY", flush=True)
    sys.stdin.readline()
    datadist.unlink(comm_id)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
