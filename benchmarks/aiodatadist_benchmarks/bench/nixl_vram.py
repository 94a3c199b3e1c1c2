"""Raw NIXL between two processes on one GPU, device memory (VRAM) registered, at its fair settings: the anchor the
GPU check script prints beside aiodatadist's own device rows.

``python -m aiodatadist_benchmarks.bench.nixl_vram [--repeat N]``: a target process allocates 512 MiB of device
memory (torch, the default allocator: legacy IPC handles) filled with seeded random bytes; an initiator READs
from it and WRITEs into it, in two shapes: 8192 scattered 32 KiB blocks (256 MiB) and 4 contiguous 64 MiB blocks
(256 MiB).  Each shape is checked byte-exact once.  Settings (``../shared/design/device_across_hosts.md``):
``UCX_TLS=cuda_ipc,cuda_copy,tcp,self``, ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``, ``UCX_PROTO_INFO=used`` (UCX prints
the protocol it chose on stderr).  Needs torch with CUDA and NIXL; prints one line per figure, GB/s medians.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

FAIR_UCX = {"UCX_TLS": "cuda_ipc,cuda_copy,tcp,self", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "UCX_PROTO_INFO": "used"}
TOTAL = 512 << 20
BLOCK = 32 << 10
SCATTERED = 8192
BIG = 64 << 20
TIMEOUT_S = 60.0

__all__ = ["main"]


def _setup(name: str) -> tuple[Any, Any]:
    os.environ.update(FAIR_UCX)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import torch

    from .peers import load_nixl

    api: Any = load_nixl()
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=[]))
    agent.create_backend("UCX", {})
    return torch, agent


def _target(conn: Connection) -> None:
    torch, agent = _setup("target")
    gen = torch.Generator(device="cuda").manual_seed(7)
    memory = torch.randint(1, 256, (TOTAL,), dtype=torch.uint8, device="cuda", generator=gen)
    reg = agent.register_memory([(memory.data_ptr(), TOTAL, 0, "")], "VRAM")
    conn.send((agent.get_agent_metadata(), memory.data_ptr()))
    while True:
        message = conn.recv()
        if message == "stop":
            break
        offset, nbytes = message  # the initiator checks what it read against these bytes
        conn.send(memory[offset:offset + nbytes].cpu().numpy().tobytes())
    agent.deregister_memory(reg)


def _shape(name: str, base: int, local: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(local, remote) descriptors: scattered blocks (a seeded permutation) or contiguous 64 MiB ones."""
    import numpy as np

    if name == "scattered":
        perm = np.random.default_rng(1).permutation(TOTAL // BLOCK)[:SCATTERED]
        remote = [(base + int(b) * BLOCK, BLOCK, 0) for b in perm]
        return [(local + i * BLOCK, BLOCK, 0) for i in range(SCATTERED)], remote
    return [(local + i * BIG, BIG, 0) for i in range(4)], [(base + i * BIG, BIG, 0) for i in range(4)]


def _post(agent: Any, handle: Any) -> float:
    start = time.perf_counter()
    state = agent.transfer(handle)
    while state == "PROC":
        if time.perf_counter() - start > TIMEOUT_S:
            raise TimeoutError("a NIXL transfer did not end in 60 s")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer failed: {state}")
    return time.perf_counter() - start


def _initiator(conn: Connection, repeat: int, out: Connection) -> None:
    torch, agent = _setup("initiator")
    metadata, base = conn.recv()
    remote = agent.add_remote_agent(metadata)
    local = torch.zeros(TOTAL // 2, dtype=torch.uint8, device="cuda")
    reg = agent.register_memory([(local.data_ptr(), local.numel(), 0, "")], "VRAM")
    for shape in ("scattered", "contiguous"):
        mine, theirs = _shape(shape, base, local.data_ptr())
        local_list = agent.get_xfer_descs(mine, "VRAM")
        remote_list = agent.get_xfer_descs(theirs, "VRAM")
        for op in ("READ", "WRITE"):
            handle = agent.initialize_xfer(op, local_list, remote_list, remote)
            times = [_post(agent, handle) for _ in range(repeat + 1)][1:]
            gbps = (TOTAL // 2) / statistics.median(times) / 1e9
            checked = ""
            if op == "READ":  # the first and last descriptors, against the target's own bytes
                torch.cuda.synchronize()
                same = True
                for (here, nbytes, _), (there, _, _) in (zip(mine, theirs) if len(mine) < 3 else
                                                        ((mine[0], theirs[0]), (mine[-1], theirs[-1]))):
                    conn.send((there - base, nbytes))
                    want = conn.recv()
                    got = local[here - local.data_ptr():here - local.data_ptr() + nbytes].cpu().numpy().tobytes()
                    same = same and got == want
                checked = " (byte-exact)" if same else " (BYTES DIFFER)"
            agent.release_xfer_handle(handle)
            out.send(f"raw NIXL {op} {shape} ({len(mine)} x {mine[0][1] >> 10} KiB, VRAM): {gbps:.2f} GB/s{checked}")
    agent.deregister_memory(reg)
    conn.send("stop")
    out.send("done")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiodatadist_benchmarks.bench.nixl_vram", description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    results, sink = ctx.Pipe()
    procs = [ctx.Process(target=_target, args=(a,)), ctx.Process(target=_initiator, args=(b, args.repeat, sink))]
    for proc in procs:
        proc.start()
    sys.stdout.write(f"raw NIXL, settings: {' '.join(f'{k}={v}' for k, v in FAIR_UCX.items())}\n")
    status = 1
    while results.poll(120):
        line = results.recv()
        if line == "done":
            status = 0
            break
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
