"""The bench workloads run on NIXL, so the bench CLI can print "aiodatadist / NIXL" ratios from one run.

Written against NIXL 1.5.1 (``pip install 'aiodatadist[nixl]'``, i.e. ``nixl-cu12``; CPU-only, numpy buffers),
UCX backend.

A *prompt* process owns a source cache and a *decoder* process owns a destination cache, both 64 tensors x
256 blocks x 32 KiB (one 8 MiB numpy array per tensor, registered as DRAM; the source holds seeded random
non-zero bytes).  The decoder READs (pulls) from the prompt, exactly the byte layouts of ``aiodatadist bench``:

* ``paged``: 128 scattered blocks per tensor, source blocks ``permutation[:128]`` into destination blocks
  ``permutation[128:]``: 8192 descriptors of 32 KiB, 256 MiB.  Median GB/s over ``repeat`` runs after one
  warm-up; the destination is zeroed (untimed) before every run, and after the last run it is compared
  byte for byte with the source (``RuntimeError`` if wrong).
* ``whole``: the first 128 blocks of each tensor, contiguous: 64 descriptors of 4 MiB, 256 MiB.  Median GB/s.
* ``small``: block 7 into block 9 of every tensor: 64 descriptors of 32 KiB, 2 MiB.  p50 / p99 latency in ms
  over ``max(200, 20 * repeat)`` READs after one warm-up.

How it is driven (NIXL's tuned path, measured best on a 2-vCPU VM; see docs/performance.md):

* Prepared descriptor lists, as NIXL recommends for descriptors used more than once: per workload the decoder
  prepares its local list (``prep_xfer_dlist("NIXL_INIT_AGENT", ...)``) and the prompt's list
  (``prep_xfer_dlist(<prompt>, ...)``) once, makes one READ handle with ``make_prepped_xfer`` outside the timed
  loop and re-posts it (NIXL allows re-posting a handle once its previous transfer is done): one timed run is
  ``transfer`` (post) + ``check_xfer_state`` until ``DONE``.
* Decoder (initiator): progress thread OFF, UCX backend created with ``num_threads=2`` (two dedicated UCX
  workers, each with its own thread, the ``nixlbench --num_threads`` knob) and ``split_batch_size=16`` (a post is
  cut into chunks of 16 descriptors spread over those threads: paged 512 chunks, whole and small 4 each; the
  default 1024 would leave whole and small in one chunk, on one thread).  The Python thread checks
  ``check_xfer_state`` every 100 us (``time.sleep(1e-4)``) instead of busy-polling, so the two copy threads have
  both cores.  Measured on 2 vCPUs: busy-polling instead costs paged ~30 %; ``num_threads=0`` (the copy in the
  posting thread) gives paged ~4.4, whole ~5.5 GB/s against ~6.5 / ~9.5; the decoder's progress thread costs
  another ~25 %.
* Prompt (target) in ``nixl-ucx``: progress thread OFF; once it has sent its metadata it calls
  ``get_new_notifs`` once a millisecond (to answer UCX wire-up) and otherwise sleeps: the ``cma`` reads are
  ``process_vm_readv`` calls made by the decoder, which need nothing from the owner.  Busy-polling here (or the
  progress thread, which NIXL's Python API runs with no delay, so it spins too) takes a core from the copy.
* Prompt in ``nixl-ucx-tcp``: progress thread ON and the Python thread blocked on the control pipe: over TCP,
  UCX emulates the READ with active messages the owner must answer, so the owner needs steady progress; the
  progress thread gives the best latency of the options tried (busy-polling ``get_new_notifs``, polling it once
  a millisecond).

Variants, each in a fresh pair of spawned processes (UCX reads its environment when the agent starts); the
settings above apply to both:

* ``nixl-ucx``: UCX picks its transports (on one host: ``cma`` for the reads, TCP on ``lo`` for wire-up);
* ``nixl-ucx-tcp``: ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=lo`` in both processes; without the device
  restriction UCX stripes the reads over ``lo`` and every other up interface.

No other UCX setting helped here (tried: ``UCX_TLS=cma,tcp``, ``NIXL_UCX_SGL_ENABLE``, ``UCX_TCP_SEG_SIZE``,
``UCX_TCP_SNDBUF``/``RCVBUF``), so UCX keeps its defaults.

``python -m aiodatadist_benchmarks.bench.peers`` prints both variants with ``repeat=5``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from aiodatadist import LLMException
from aiodatadist.transport import nixl
from aiodatadist.transport.nixl import nixl_available

__all__ = ["VARIANTS", "WORKLOADS", "nixl_available", "run_nixl"]

TENSORS = 64
BLOCKS = 256
BLOCK_BYTES = 32 << 10
MOVED_BLOCKS = 128
TENSOR_BYTES = BLOCKS * BLOCK_BYTES
TIMEOUT_S = 120.0
SEED = 3

WORKLOADS = ("paged", "whole", "small")
"""Workload names, in the order they run."""

VARIANTS: dict[str, dict[str, str | None]] = {
    "nixl-ucx": {"UCX_TLS": None, "UCX_NET_DEVICES": None},
    "nixl-ucx-tcp": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"},
}
"""Environment of each variant's processes (``None``: unset, so an inherited value cannot relabel a run)."""

_PROMPT_PROGRESS_THREAD = {"nixl-ucx": False, "nixl-ucx-tcp": True}
"""Whether the prompt runs NIXL's progress thread (TCP: the owner answers the emulated READs) or polls slowly."""
_PROMPT_POLL_S = 1e-3  # prompt without progress thread: get_new_notifs this often, for UCX wire-up
_DECODER_UCX = {"num_threads": "2", "split_batch_size": "16"}  # UCX backend parameters of the decoder
_DECODER_POLL_S = 1e-4  # decoder: check_xfer_state this often while its UCX threads copy

_Report = Callable[[str], None]
U64_MAX = int(np.iinfo(np.uint64).max)


def load_nixl() -> Any:
    """NIXL's Python API; RuntimeError saying what to install without it."""
    try:
        return nixl.load_nixl()
    except LLMException as exc:
        raise RuntimeError(f"the NIXL harness needs NIXL: pip install 'aiodatadist-benchmarks[peers]' ({exc})") from None


def run_nixl(workloads: set[str], repeat: int, variant: str,
             progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run ``workloads`` (a subset of ``WORKLOADS``) on NIXL ``variant`` in a fresh prompt/decoder pair.

    Returns one dict per workload, in ``WORKLOADS`` order: ``{"library", "workload", "bytes", "gbps"}`` for
    ``paged``/``whole`` and ``{"library", "workload", "bytes", "p50_ms", "p99_ms", "runs"}`` for ``small``.
    ``progress``, if given, receives short lines such as ``"nixl-ucx: paged 3/7"``.  Raises
    ``RuntimeError`` when NIXL is missing, a process fails or times out, or the copied bytes are wrong;
    the child processes are always ended.
    """
    unknown = set(workloads) - set(WORKLOADS)
    if unknown or variant not in VARIANTS or repeat < 1:
        raise ValueError(f"bad arguments: workloads {sorted(unknown)} unknown, variant {variant!r}, "
                         f"repeat {repeat}; choose from {list(WORKLOADS)} and {list(VARIANTS)}, repeat >= 1")
    if not nixl_available():
        raise RuntimeError("NIXL is not installed: pip install nixl nixl-cu12")
    ctx = get_context("spawn")
    env = VARIANTS[variant]
    prompt_end, decoder_end = ctx.Pipe()
    reader, writer = ctx.Pipe(duplex=False)
    order = [w for w in WORKLOADS if w in workloads]
    procs = [ctx.Process(target=_prompt_main, args=(env, prompt_end, _PROMPT_PROGRESS_THREAD[variant]),
                         name=f"{variant} prompt", daemon=True),
             ctx.Process(target=_decoder_main, args=(env, decoder_end, writer, order, repeat),
                         name=f"{variant} decoder", daemon=True)]
    try:
        for proc in procs:
            proc.start()
        for end in (prompt_end, decoder_end, writer):  # keep only the children's copies: EOF when one dies
            end.close()
        return _collect(variant, reader, procs, progress)
    finally:
        reader.close()
        _end(procs)


# ---------------------------------------------------------------------------------------------- parent side


def _collect(variant: str, reader: Connection, procs: Sequence[BaseProcess],
             progress: _Report | None) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    while True:
        kind, payload = _next_message(variant, reader, procs)
        if kind == "progress":
            if progress is not None:
                progress(f"{variant}: {payload}")
        elif kind == "result":
            results.append({"library": variant, **payload})
        elif kind == "error":
            raise RuntimeError(f"{variant}: {payload}")
        else:
            return results


def _next_message(variant: str, reader: Connection, procs: Sequence[BaseProcess]) -> tuple[str, Any]:
    deadline = time.monotonic() + TIMEOUT_S
    while not reader.poll(0.5):
        for proc in procs:
            if proc.exitcode is not None:
                raise RuntimeError(f"{variant}: {proc.name} process exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{variant}: no word from the decoder process for {TIMEOUT_S:.0f} s")
    try:
        message: tuple[str, Any] = reader.recv()
    except EOFError:
        raise RuntimeError(f"{variant}: the decoder process died") from None
    return message


def _end(procs: Sequence[BaseProcess]) -> None:
    """Give started processes 10 s to exit on their own, then terminate, then kill."""
    started = [p for p in procs if p.pid is not None]
    for proc in started:
        proc.join(10)
    for proc in started:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


# ----------------------------------------------------------------------------------------- both children


def _apply_env(env: dict[str, str | None]) -> None:
    """Set the variant's UCX environment; must run before NIXL (and so UCX) is imported in this process."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout otherwise
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _agent(name: str, progress_thread: bool, ucx_params: dict[str, str]) -> Any:
    """A NIXL agent with one UCX backend made with ``ucx_params`` (``nixl_agent_config`` cannot pass all)."""
    api: Any = load_nixl()
    try:
        agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
        agent.create_backend("UCX", ucx_params)
        return agent
    except Exception as exc:
        ucx = ", ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("UCX_")) or "UCX defaults"
        raise RuntimeError(f"NIXL could not start its UCX backend with {ucx} ({type(exc).__name__}: {exc}); "
                           "UCX's own messages are on stderr") from exc


def _register(agent: Any, tensors: list[np.ndarray]) -> Any:
    regions = np.array([[t.ctypes.data, t.nbytes, 0] for t in tensors], dtype=np.uint64)
    return agent.register_memory(regions, "DRAM")


def _source_tensor(index: int) -> np.ndarray:
    """Tensor ``index`` of the prompt's cache: seeded random non-zero bytes, reproducible in any process."""
    rng = np.random.Generator(np.random.SFC64([SEED, index]))
    data = rng.integers(0, U64_MAX, TENSOR_BYTES // 8, dtype=np.uint64, endpoint=True).view(np.uint8)
    data[data == 0] = 1
    return data


# ------------------------------------------------------------------------------------------------- prompt


def _prompt_main(env: dict[str, str | None], peer: Connection, progress_thread: bool) -> None:
    """Prompt process: register a filled source cache, send its metadata, serve until told to stop."""
    _apply_env(env)
    try:
        agent = _agent("prompt", progress_thread, {})
        tensors = [_source_tensor(i) for i in range(TENSORS)]
        reg = _register(agent, tensors)
    except Exception as exc:
        with suppress(OSError):  # the decoder reports it (unless it is gone already): let it, then exit 1
            peer.send(("error", f"prompt: {type(exc).__name__}: {exc}"))
            peer.poll(TIMEOUT_S)
        raise SystemExit(1) from exc
    peer.send(("ready", agent.get_agent_metadata(), [t.ctypes.data for t in tensors]))
    _serve(agent, peer, progress_thread)
    agent.deregister_memory(reg)


def _serve(agent: Any, peer: Connection, progress_thread: bool) -> None:
    """Serve until the decoder says stop or goes away: wait on the pipe, giving UCX progress when no thread does."""
    if progress_thread:
        peer.poll(None)
    else:
        while not peer.poll(_PROMPT_POLL_S):
            agent.get_new_notifs()
    with suppress(EOFError):
        peer.recv()


# ------------------------------------------------------------------------------------------------ decoder


def _decoder_main(env: dict[str, str | None], peer: Connection, out: Connection, order: list[str],
                  repeat: int) -> None:
    """Decoder process: run ``order`` against the prompt, sending progress, results, then done or error."""
    _apply_env(env)
    try:
        _decode(peer, out, order, repeat)
        out.send(("done", None))
    except Exception as exc:  # noqa: BLE001 - any failure is reported to the parent, which raises it
        out.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        with suppress(OSError):
            peer.send("stop")


def _decode(peer: Connection, out: Connection, order: list[str], repeat: int) -> None:
    agent = _agent("decoder", False, _DECODER_UCX)
    tensors = [np.zeros(TENSOR_BYTES, dtype=np.uint8) for _ in range(TENSORS)]
    reg = _register(agent, tensors)
    if not peer.poll(TIMEOUT_S):
        raise TimeoutError(f"the prompt sent no metadata within {TIMEOUT_S:.0f} s")
    message = peer.recv()
    if message[0] == "error":
        raise RuntimeError(message[1])
    _, metadata, src_bases = message
    remote = agent.add_remote_agent(metadata)  # NIXL 1.5.1 returns the name as bytes; used as is
    for workload in order:
        bench = _Workload(agent, remote, workload, src_bases, tensors)
        out.send(("result", bench.run(repeat, lambda line: out.send(("progress", line)))))
    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)


def _layout(workload: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(source blocks, destination blocks, bytes per descriptor) of a workload, the same in every tensor."""
    if workload == "paged":
        perm = np.random.default_rng(1).permutation(BLOCKS)
        return perm[:MOVED_BLOCKS], perm[MOVED_BLOCKS:], BLOCK_BYTES
    if workload == "whole":
        return np.array([0]), np.array([0]), MOVED_BLOCKS * BLOCK_BYTES
    return np.array([7]), np.array([9]), BLOCK_BYTES


def _descs(bases: list[int], blocks: np.ndarray, nbytes: int) -> np.ndarray:
    """Nx3 (address, length, device 0) descriptors, tensor-major."""
    addrs = (np.array(bases, dtype=np.uint64)[:, None] + blocks.astype(np.uint64)[None, :] * BLOCK_BYTES)
    rows = addrs.reshape(-1)
    return np.stack([rows, np.full_like(rows, nbytes), np.zeros_like(rows)], axis=1)


class _Workload:
    """One workload's prepared descriptor lists and READ handle (made once, re-posted every run), measured."""

    def __init__(self, agent: Any, remote: Any, name: str, src_bases: list[int], dst: list[np.ndarray]):
        self.agent = agent
        self.name = name
        self.dst = dst
        self.src_blocks, self.dst_blocks, desc_bytes = _layout(name)
        remote_descs = _descs(src_bases, self.src_blocks, desc_bytes)
        local_descs = _descs([t.ctypes.data for t in dst], self.dst_blocks, desc_bytes)
        self.nbytes = len(local_descs) * desc_bytes
        self.local_dlist = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, "DRAM")
        self.remote_dlist = agent.prep_xfer_dlist(remote, remote_descs, "DRAM")
        indices = np.arange(len(local_descs), dtype=np.int32)
        self.handle = agent.make_prepped_xfer("READ", self.local_dlist, indices, self.remote_dlist, indices)

    def run(self, repeat: int, report: _Report) -> dict[str, Any]:
        """Measure, verify (``paged``), release the handles and return the result dict (without library)."""
        if self.name == "small":
            result = self._latency(max(200, 20 * repeat), report)
        else:
            result = self._throughput(repeat, report)
        if self.name == "paged":
            self._verify()
        self.agent.release_xfer_handle(self.handle)
        self.agent.release_dlist_handle(self.local_dlist)
        self.agent.release_dlist_handle(self.remote_dlist)
        return result

    def _read(self) -> float:
        """Post the READ and check it every ``_DECODER_POLL_S`` until done; seconds taken."""
        start = time.perf_counter()
        deadline = start + TIMEOUT_S
        state = self.agent.transfer(self.handle)
        while state == "PROC":
            time.sleep(_DECODER_POLL_S)
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{self.name} READ not done after {TIMEOUT_S:.0f} s")
            state = self.agent.check_xfer_state(self.handle)
        elapsed = time.perf_counter() - start
        if state != "DONE":
            raise RuntimeError(f"{self.name} READ failed (state {state})")
        return elapsed

    def _throughput(self, repeat: int, report: _Report) -> dict[str, Any]:
        times = []
        for run in range(repeat + 1):  # run 0 is the warm-up
            if self.name == "paged":
                for tensor in self.dst:
                    tensor.fill(0)
            elapsed = self._read()
            if run:
                times.append(elapsed)
                report(f"{self.name} {run}/{repeat}")
        gbps = self.nbytes / statistics.median(times) / 1e9
        return {"workload": self.name, "bytes": self.nbytes, "gbps": gbps}

    def _latency(self, runs: int, report: _Report) -> dict[str, Any]:
        self._read()
        lat_ms = []
        for run in range(1, runs + 1):
            lat_ms.append(self._read() * 1e3)
            if run % 50 == 0 or run == runs:
                report(f"{self.name} {run}/{runs}")
        lat_ms.sort()
        return {"workload": self.name, "bytes": self.nbytes, "p50_ms": statistics.median(lat_ms),
                "p99_ms": lat_ms[int(runs * 0.99) - 1], "runs": runs}

    def _verify(self) -> None:
        """The moved blocks equal the source, every other destination block is still zero."""
        for index, tensor in enumerate(self.dst):
            got = tensor.reshape(BLOCKS, BLOCK_BYTES)
            want = _source_tensor(index).reshape(BLOCKS, BLOCK_BYTES)
            # paged's source and destination block sets are complementary: the source set must stay zero
            if not np.array_equal(got[self.dst_blocks], want[self.src_blocks]) or got[self.src_blocks].any():
                raise RuntimeError(f"NIXL {self.name} READ is not byte-exact in tensor {index}")


def _print(results: list[dict[str, Any]]) -> None:
    for r in results:
        if "gbps" in r:
            sys.stdout.write(f"{r['library']:<13} {r['workload']:<6} {r['bytes'] >> 20:4d} MiB "
                             f"{r['gbps']:7.2f} GB/s\n")
        else:
            sys.stdout.write(f"{r['library']:<13} {r['workload']:<6} {r['bytes'] >> 20:4d} MiB "
                             f"p50 {r['p50_ms']:.3f} ms   p99 {r['p99_ms']:.3f} ms   ({r['runs']} runs)\n")


if __name__ == "__main__":
    for name in VARIANTS:
        start = time.monotonic()
        _print(run_nixl(set(WORKLOADS), 5, name))
        sys.stdout.write(f"{name}: {time.monotonic() - start:.1f} s\n")
