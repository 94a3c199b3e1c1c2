"""What an engine does with CUDA KV across hosts, here over a loopback TCP link: torch CUDA tensors registered
through ``aiodatadist.torch`` in two processes, the blocking API, block pulls byte-exact, with the figure.  Needs
torch with CUDA (the emulated GPU is not torch's)."""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import pytest

from aiodatadist.testing import free_port

BLOCKS, BLOCK_ELEMS, LAYERS = 256, 16384, 8  # fp16: 32 KiB blocks, K and V of 8 layers (16 tensors of 8 MiB)


def _prompt(port: int, conn: Connection) -> None:
    import torch

    from aiodatadist import BlocksCacheKey, LLMRole
    from aiodatadist.sync import LLMDataDist
    from aiodatadist.torch import register_blocks_cache_from_tensors

    gen = torch.Generator(device="cuda").manual_seed(5)
    kv = [torch.randn(BLOCKS, BLOCK_ELEMS, dtype=torch.float16, device="cuda", generator=gen)
          for _ in range(2 * LAYERS)]
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init({"llm.listenIpInfo": f"127.0.0.1:{port}", "llm.Transport": "tcp"})
    register_blocks_cache_from_tensors(dd.cache_manager, kv, BlocksCacheKey(1, 0))
    conn.send([t.cpu() for t in kv])
    conn.recv()  # the decoder is done
    dd.finalize()


@pytest.mark.real_gpu
def test_torch_cuda_kv_moves_between_processes_over_tcp_with_the_blocking_api() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from aiodatadist import BlocksCacheKey, LLMRole, LLMStatusCode
    from aiodatadist.sync import LLMDataDist
    from aiodatadist.testing import cluster_info
    from aiodatadist.torch import register_blocks_cache_from_tensors

    port = free_port()
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    prompt = ctx.Process(target=_prompt, args=(port, theirs))
    prompt.start()
    try:
        source = ours.recv()
        kv = [torch.zeros(BLOCKS, BLOCK_ELEMS, dtype=torch.float16, device="cuda") for _ in range(2 * LAYERS)]
        dd = LLMDataDist(LLMRole.DECODER, 2)
        dd.init({"llm.Transport": "tcp"})
        try:
            code, _ = dd.link_clusters([cluster_info(1, port)], timeout=10_000)
            assert code == LLMStatusCode.LLM_SUCCESS
            assert dd.links()[0]["device_path"] == "device-staged"
            cache = register_blocks_cache_from_tensors(dd.cache_manager, kv)
            src, dst = list(range(0, BLOCKS, 2)), list(range(BLOCKS // 2))
            dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src, dst)  # (the rings are made here)
            started = time.perf_counter()
            dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src, dst)
            seconds = time.perf_counter() - started
            torch.cuda.synchronize()
            for mine, want in zip(kv, source):
                assert torch.equal(mine[:BLOCKS // 2].cpu(), want[src])
            moved = 2 * LAYERS * len(src) * BLOCK_ELEMS * 2
            print(f"torch CUDA KV over TCP, blocking pull of {moved >> 20} MiB: {moved / seconds / 1e9:.2f} GB/s")
        finally:
            dd.finalize()
    finally:
        ours.send("done")
        prompt.join(30)
        if prompt.is_alive():
            prompt.kill()
