"""switch_role: prompt and decoder swap client/server roles, then KV blocks flow the other way.

Run it with no arguments::

    python examples/switch_role.py

The flow of the reference's ``switch_role_sample.py`` (spec §6.6), with two processes.  This process is **P**
(cluster 1, first a PROMPT and a server); it starts a second process running this file as **D** (cluster 2,
first a DECODER and a client).  The two coordinate over D's stdin/stdout (lines starting with ``@``).

1. P listens and holds a paged KV cache ``BlocksCacheKey(P_ID, 0)`` full of random bytes.  D links to P, pulls
   some blocks with ``pull_blocks``, checks them and unlinks (``unlink_clusters``).
2. P ``switch_role(LLMRole.DECODER)``: with no ``llm.listenIpInfo`` it stops listening (D checks that a new
   link to P's old port now fails).  D
   ``switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:<port>"})``: it is now a server.
3. P (now the client) links to D.  D pushes newly "prefilled" blocks into P with
   ``push_blocks(BlocksCacheKey(P_ID, 0), ...)`` (the server end of a link can start transfers too), and P
   pulls more blocks from D with ``pull_blocks(BlocksCacheKey(D_ID, 0), ...)``.  P checks every block of its
   cache, unlinks and both finalize.

Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np

from aiodatadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import free_port

P_ID, D_ID = 1, 2
LAYERS = 4
TENSORS = 2 * LAYERS                       # K0, V0, K1, V1, ...
BLOCK_SHAPE = (16, 4, 64)                  # tokens x kv heads x head dim, fp16: 8 KiB per block and tensor
NUM_BLOCKS = 16                            # on both sides
SYNC_KV_TIMEOUT_MS = 3000
DEADLINE_S = 30.0

# 1. D pulls from P.
PULL_1 = ([2, 5, 6, 11], [0, 1, 2, 3])      # P blocks -> D blocks
# 3. D pushes into P; P pulls from D.
PUSH_3 = ([8, 9, 10], [12, 13, 14])         # D blocks -> P blocks
PULL_3 = ([4, 5], [0, 1])                   # D blocks -> P blocks


def kv_desc() -> CacheDesc:
    return CacheDesc(TENSORS, (NUM_BLOCKS, *BLOCK_SHAPE), DataType.DT_FLOAT16, Placement.HOST)


def block_bytes(cache: Cache) -> list[np.ndarray]:
    """Per tensor, a ``(num_blocks, bytes_per_block)`` uint8 view of the cache."""
    return [t.view(np.uint8).reshape(NUM_BLOCKS, -1) for t in cache.tensors]


def random_kv(seed: int) -> np.ndarray:
    """``(tensors, blocks, bytes_per_block)`` random bytes, never 0."""
    nbytes = kv_desc().size // NUM_BLOCKS
    return np.random.default_rng(seed).integers(1, 256, size=(TENSORS, NUM_BLOCKS, nbytes), dtype=np.uint8)


def p_bytes(seed: int) -> np.ndarray:
    return random_kv(seed)


def d_bytes(seed: int) -> np.ndarray:
    return random_kv(seed + 1)


def blocks_equal(kv: list[np.ndarray], blocks: list[int], expected: np.ndarray,
                 src_blocks: list[int]) -> bool:
    return all(np.array_equal(kv[t][blocks], expected[t, src_blocks]) for t in range(TENSORS))


def cluster_info(remote_cluster_id: int, port: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    return info


def config(listen_port: int | None = None) -> LLMConfig:
    cfg = LLMConfig()
    cfg.sync_kv_timeout = SYNC_KV_TIMEOUT_MS
    cfg.enable_switch_role = True                  # needed by the reference's V1 mode; vllm-ascend sets it
    cfg.enable_remote_cache_accessible = True      # push_blocks needs it
    if listen_port is not None:
        cfg.listen_ip_info = f"127.0.0.1:{listen_port}"
    return cfg


class Failed(Exception):
    pass


# -- P (this process) ----------------------------------------------------------------------------------------

async def run_p() -> int:
    p_port, d_port = free_port(), free_port()
    seed = int(np.random.default_rng().integers(1 << 30))
    async with LLMDataDist(LLMRole.PROMPT, P_ID) as dd:
        await dd.init(config(listen_port=p_port).generate_options())
        cache = dd.cache_manager.allocate_blocks_cache(kv_desc(), BlocksCacheKey(P_ID, 0))
        kv = block_bytes(cache)
        mine = p_bytes(seed)
        for t in range(TENSORS):
            kv[t][:] = mine[t]
        print(f"[P] pid {os.getpid()}: {dd.role}, KV cache {TENSORS} tensors x {NUM_BLOCKS} blocks, "
              f"listening on 127.0.0.1:{p_port}", flush=True)

        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "d", "--p-port", str(p_port), "--d-port", str(d_port),
            "--seed", str(seed),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert child.stdin is not None and child.stdout is not None
        stdout = child.stdout
        messages: asyncio.Queue[str] = asyncio.Queue()

        async def relay() -> None:            # echo D's output, collect its "@" messages
            while line := (await stdout.readline()).decode():
                if line.startswith("@"):
                    messages.put_nowait(line[1:].strip())
                else:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            messages.put_nowait("<exited>")

        async def expect(message: str) -> None:
            got = await messages.get()
            if got != message:
                raise Failed(f"expected {message!r} from D, got {got!r}")

        async def tell(message: str) -> None:
            assert child.stdin is not None
            child.stdin.write(f"{message}\n".encode())
            await child.stdin.drain()

        relay_task = asyncio.ensure_future(relay())
        ok = False
        try:
            async with asyncio.timeout(DEADLINE_S):
                await expect("unlinked")                                   # 1. D pulled from us and unlinked
                print(f"[P] D unlinked; links left: {dd.links()}", flush=True)
                await dd.switch_role(LLMRole.DECODER)                      # 2. stop listening
                print(f"[P] switch_role(DECODER): now {dd.role}, no longer listening", flush=True)
                await tell("switched")
                await expect("listening")                                  # D is a server now
                d = cluster_info(D_ID, d_port)
                code, per_cluster = await dd.link_clusters([d], timeout=3000)   # 3. P is the client now
                if code != LLMStatusCode.LLM_SUCCESS:
                    raise Failed(f"link_clusters to D failed: {code} {per_cluster}")
                print(f"[P] linked to D at 127.0.0.1:{d_port}", flush=True)
                await tell("linked")
                start = time.perf_counter()
                await dd.cache_manager.pull_blocks(BlocksCacheKey(D_ID, 0), cache, *PULL_3)
                print(f"[P] pull_blocks(BlocksCacheKey({D_ID}, 0)): D{PULL_3[0]} -> P{PULL_3[1]} in "
                      f"{(time.perf_counter() - start) * 1e3:.2f} ms", flush=True)
                await expect("pushed")
                theirs = d_bytes(seed)
                expected = mine.copy()
                expected[:, PUSH_3[1]] = theirs[:, PUSH_3[0]]
                expected[:, PULL_3[1]] = theirs[:, PULL_3[0]]
                pushed_ok = blocks_equal(kv, PUSH_3[1], theirs, PUSH_3[0])
                pulled_ok = blocks_equal(kv, PULL_3[1], theirs, PULL_3[0])
                whole_ok = all(np.array_equal(kv[t], expected[t]) for t in range(TENSORS))
                print(f"[P] blocks P{PUSH_3[1]} pushed by D: {'OK' if pushed_ok else 'MISMATCH'}; blocks "
                      f"P{PULL_3[1]} pulled from D: {'OK' if pulled_ok else 'MISMATCH'}; the other "
                      f"{NUM_BLOCKS - len(PUSH_3[1]) - len(PULL_3[1])} blocks unchanged: "
                      f"{'OK' if whole_ok else 'NO'}", flush=True)
                code, _ = await dd.unlink_clusters([d])
                print(f"[P] unlinked from D: {code}", flush=True)
                await tell("done")
                rc = await child.wait()
                await relay_task
                ok = pushed_ok and pulled_ok and whole_ok and code == LLMStatusCode.LLM_SUCCESS and rc == 0
                print(f"[P] D exited with {rc}", flush=True)
        except Exception as exc:   # noqa: BLE001 - Failed, TimeoutError, LLMException...: report, clean up
            print(f"[P] FAILED: {exc!r}", flush=True)
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
            relay_task.cancel()
        return 0 if ok else 1


# -- D (the child process) -----------------------------------------------------------------------------------

async def run_d(p_port: int, d_port: int, seed: int) -> int:
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)

    def tell(message: str) -> None:
        print(f"@{message}", flush=True)

    async def expect(message: str) -> None:
        got = (await stdin.readline()).decode().strip()
        if got != message:
            raise Failed(f"expected {message!r} from P, got {got!r}")

    async with LLMDataDist(LLMRole.DECODER, D_ID) as dd:
        await dd.init(config().generate_options())
        cache = dd.cache_manager.allocate_blocks_cache(kv_desc(), BlocksCacheKey(D_ID, 0))
        kv = block_bytes(cache)
        for tensor in kv:
            tensor[:] = 0
        print(f"[D] pid {os.getpid()}: {dd.role}, client", flush=True)
        p = cluster_info(P_ID, p_port)
        code, per_cluster = await dd.link_clusters([p], timeout=3000)                   # 1.
        if code != LLMStatusCode.LLM_SUCCESS:
            print(f"[D] link_clusters to P failed: {code} {per_cluster}", flush=True)
            return 1
        await dd.cache_manager.pull_blocks(BlocksCacheKey(P_ID, 0), cache, *PULL_1)
        pulled_ok = blocks_equal(kv, PULL_1[1], p_bytes(seed), PULL_1[0])
        print(f"[D] pull_blocks(BlocksCacheKey({P_ID}, 0)): P{PULL_1[0]} -> D{PULL_1[1]}, bytes "
              f"{'OK' if pulled_ok else 'MISMATCH'}", flush=True)
        code, _ = await dd.unlink_clusters([p])
        print(f"[D] unlinked from P: {code}", flush=True)
        if code != LLMStatusCode.LLM_SUCCESS:
            return 1
        tell("unlinked")

        await expect("switched")                                                          # 2.
        code, _ = await dd.link_clusters([p], timeout=500)
        gone = code == LLMStatusCode.LLM_LINK_FAILED
        print(f"[D] linking to P's old port now gives {code} ({'as expected' if gone else 'UNEXPECTED'})",
              flush=True)
        if code == LLMStatusCode.LLM_SUCCESS:
            await dd.unlink_clusters([p], force=True)
        await dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{d_port}"})
        print(f"[D] switch_role(PROMPT, listenIpInfo=127.0.0.1:{d_port}): now {dd.role}, listening",
              flush=True)
        theirs = d_bytes(seed)                     # D "prefills" new requests into its blocks 4..10
        new_blocks = sorted(set(PUSH_3[0]) | set(PULL_3[0]))
        for t in range(TENSORS):
            kv[t][new_blocks] = theirs[t, new_blocks]
        tell("listening")

        await expect("linked")                                                           # 3.
        start = time.perf_counter()
        await dd.cache_manager.push_blocks(BlocksCacheKey(P_ID, 0), cache, *PUSH_3)
        print(f"[D] push_blocks(BlocksCacheKey({P_ID}, 0)): D{PUSH_3[0]} -> P{PUSH_3[1]} in "
              f"{(time.perf_counter() - start) * 1e3:.2f} ms", flush=True)
        tell("pushed")
        await expect("done")
        print(f"[D] links left: {dd.links()}; finalizing", flush=True)
        return 0 if pulled_ok and gone else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", choices=["d"], help=argparse.SUPPRESS)
    parser.add_argument("--p-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--d-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "d":
        try:
            return asyncio.run(run_d(args.p_port, args.d_port, args.seed))
        except Exception as exc:  # noqa: BLE001
            print(f"[D] FAILED: {exc!r}", flush=True)
            return 1
    start = time.perf_counter()
    rc = asyncio.run(run_p())
    print(f"[P] {'PASS' if rc == 0 else 'FAIL'} in {time.perf_counter() - start:.2f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
