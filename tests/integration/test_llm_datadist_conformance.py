"""A program written for LLM-DataDist, run on ``aiodatadist.compat.llm_datadist``: the prompt and decoder sides of
vllm-ascend's ``LLMDataDistCMgrConnector``, step by step, in two processes.

Both sides register caller memory for K and V of every layer as one blocks cache (``register_blocks_cache`` with
``BlocksCacheKey(cluster_id=...)``), build the same 2-rank table and call the two-sided ``link`` concurrently, poll
``query_register_mem_status`` until ``OK``, and the decoder pulls each request's blocks: all of them, then a
request whose first blocks the decoder already holds (a prefix-cache hit: the last N remote blocks).  Every byte is
checked.  The decoder side is this test (the blocking drop-in module, from the test's thread); the prompt side is
``helpers/llmdd_prompt.py`` in its own process.  The caches are HOST memory (there is no NPU here).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from helpers.ids import new_cluster_id
from helpers.llmdd_prompt import rank_table, worker_init

from aiodatadist.compat import llm_datadist
from aiodatadist.testing import free_port, pattern

LAYERS, BLOCKS, BLOCK_ELEMS = 6, 16, 2048  # float16: 4 KiB per block and tensor
PROMPT_SCRIPT = Path(__file__).resolve().parent.parent / "helpers" / "llmdd_prompt.py"


def test_vllm_ascend_flow_through_the_drop_in_module() -> None:
    prompt_id, decoder_id, port = new_cluster_id(), new_cluster_id(), free_port()
    prompt = subprocess.Popen([sys.executable, str(PROMPT_SCRIPT), str(prompt_id), str(port), str(decoder_id),
                               str(LAYERS), str(BLOCKS), str(BLOCK_ELEMS)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        datadist = worker_init(llm_datadist.LLMRole.DECODER, decoder_id)  # as the connector's worker does it
        cache_manager = datadist.cache_manager
        # register_kv_caches: K then V of each layer, one blocks cache.
        kv = [np.zeros((BLOCKS, BLOCK_ELEMS), dtype=np.float16) for _ in range(2 * LAYERS)]
        for t in kv:
            t[...] = 7  # not what the prompt holds
        desc = llm_datadist.CacheDesc(len(kv), [BLOCKS, BLOCK_ELEMS], llm_datadist.DataType.DT_FLOAT16,
                                      llm_datadist.Placement.HOST)
        cache = cache_manager.register_blocks_cache(desc, [int(t.ctypes.data) for t in kv],
                                                    llm_datadist.BlocksCacheKey(cluster_id=decoder_id))
        # connect_to_remote_agent: both sides link concurrently, then poll.
        comm_id = datadist.link(f"pd_comm_{prompt_id}_{decoder_id}", {prompt_id: 0, decoder_id: 1},
                                rank_table(port))
        deadline = time.monotonic() + 60
        while (status := datadist.query_register_mem_status(comm_id=comm_id)) != llm_datadist.RegisterMemStatus.OK:
            assert status != llm_datadist.RegisterMemStatus.FAILED, "link FAILED"
            assert time.monotonic() < deadline, "link never came up"
            time.sleep(0.05)
        assert prompt.stdout is not None and prompt.stdout.readline().strip() == "READY"

        def expected(remote_block: int, tensor: int) -> np.ndarray:
            data = np.frombuffer(pattern(prompt_id, tensor, BLOCKS * BLOCK_ELEMS * 2), dtype=np.float16)
            return data.reshape(BLOCKS, -1)[remote_block]

        remote_cache_key = llm_datadist.BlocksCacheKey(cluster_id=prompt_id)
        # Request 1: every block P sent.
        remote_block_ids, local_block_ids = [3, 9, 4, 12], [0, 1, 2, 3]
        cache_manager.pull_blocks(remote_cache_key, cache, remote_block_ids, local_block_ids)
        # Request 2: D's prefix cache holds the first 3 of P's 5 blocks: only the last 2 remote ids are pulled.
        remote_block_ids2, local_block_ids2 = [5, 6, 7, 13, 14], [8, 9]
        cache_manager.pull_blocks(remote_cache_key, cache, remote_block_ids2[-len(local_block_ids2):],
                                  local_block_ids2)
        pairs = list(zip(remote_block_ids, local_block_ids)) + list(zip(remote_block_ids2[-2:], local_block_ids2))
        for t in range(2 * LAYERS):
            for remote, local in pairs:
                assert np.array_equal(kv[t][local].view(np.uint16), expected(remote, t).view(np.uint16)), (t, local)
            untouched = sorted(set(range(BLOCKS)) - {local for _, local in pairs})
            assert (kv[t][untouched] == 7).all()

        prompt.stdin.write("done\n")  # type: ignore[union-attr]
        prompt.stdin.flush()  # type: ignore[union-attr]
        assert prompt.wait(30) == 0
        datadist.unlink(comm_id)
        cache_manager.unregister_cache(cache.cache_id)
        datadist.finalize()
    finally:
        if prompt.poll() is None:
            prompt.kill()
            prompt.wait()
