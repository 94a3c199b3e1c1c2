"""``python -m aiodatadist bench cluster``: N prompt and M decoder processes, a request stream, every byte checked.

Each instance is its own OS process (``python -m aiodatadist_benchmarks.bench.cluster_worker``, driven by JSON lines
over its stdin/stdout) with its own ``LLMDataDist``: prompts listen, and every decoder links to every prompt at
start, one ``link_clusters`` call per prompt (or one for all, ``--link-all``; M x N links, all up before the
timed phase; the calls' durations are reported).  The KV geometry comes from a model (``llama3-8b``: 32 layers x K/V = 64 tensors, 8 KV heads x
128 x bf16, so a 16-token block is 32 KiB per tensor; ``tiny``: 4 layers, 4 heads x 64).

Requests: a prompt length drawn from ``--prompt-len`` (seeded, clipped to [one block, what the pools allow]), a
prompt instance picked round robin (or at random), and ``pull_blocks`` of that many random blocks of the
prompt's pool into free blocks of the decoder's.  Each prompt fills its whole pool once, before linking, with
windows of a small random stream seeded by (seed, prompt) (:func:`pattern_stream`), so every decoder checks
every byte of every transfer (one ``memcmp`` per block, after the transfer's latency was taken, in a thread)
without another message; the ends of checked blocks are zeroed before reuse, so a transfer that writes nothing
cannot pass.

``--rate 0`` is a closed loop of ``--inflight`` requests per decoder; ``--rate R`` draws Poisson arrivals at R
requests/s per decoder, at most ``--inflight`` transferring at once (arrivals still waiting at the end are
reported as unserved).  Reported: aggregate GB/s (bytes pulled / wall, from the common start to the last
completion), requests/s, transfer latency p50/p99, links, control-plane messages per request (counted in every
process: ``stats()`` has no message counts), CPU time of every process, and byte-check failures (any: exit code
1).  ``--baseline`` also runs 1x1 with the same options and prints the ratio; the machine's memory bandwidth
(``np.copyto`` of 256 MiB, median of 5) is printed for context.

``--netns`` runs every process in its own network namespace, on a veth pair to one bridge, with its own
10.77.x.y address (root and ``ip`` needed; removed on exit).  Namespaces do not hide a peer from the same-host
probe (same boot id, ``/proc/<pid>/fd`` and ``process_vm_readv`` still work), so ``--netns`` turns ``auto`` and
``shm`` into ``--transport tcp``.  ``--netem "delay 1ms rate 10gbit"`` adds a ``tc netem`` qdisc on the bridge side of every
veth (each direction of every flow crosses one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from aiodatadist import Transport

from .baselines import copyto_gbps, gbps
from .cluster_net import Network, _network
from .cluster_worker import MODELS, Lengths
from .timing import stderr_progress

__all__ = ["ClusterOptions", "main", "passed", "run_cluster"]

MIB = 1 << 20
Progress = Callable[[str], None]


# -- the driver ----------------------------------------------------------------------------------------------
class _Process:
    """A worker process seen from the driver: one command at a time."""

    def __init__(self, proc: asyncio.subprocess.Process, role: str, cluster_id: int) -> None:
        self.proc, self.role, self.cluster_id = proc, role, cluster_id

    @classmethod
    async def start(cls, prefix: list[str], role: str, cluster_id: int) -> _Process:
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-m", "aiodatadist_benchmarks.bench.cluster_worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 26)
        return cls(proc, role, cluster_id)

    async def call(self, cmd: str, **args: Any) -> Any:
        """Run ``cmd`` in the worker and return its result (RuntimeError if it failed or the worker died)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, "args": args}) + "\n").encode())
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.role} {self.cluster_id} exited (code {await self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.role} {self.cluster_id}: {reply['error']}")
        return reply["result"]

    async def stop(self) -> dict[str, Any] | None:
        """Finalize and exit (killed after 20 s); returns the worker's last usage, if it answered."""
        last = None
        with contextlib.suppress(RuntimeError, OSError, ValueError, TimeoutError):
            last = await asyncio.wait_for(self.call("stop"), 20)
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        return last


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    """One benchmark configuration (see ``--help``)."""

    prompts: int = 1
    decoders: int = 1
    transport: str = "auto"
    model: str = "llama3-8b"
    rate: float = 0.0
    inflight: int = 2
    duration: float = 10.0
    prompt_len: str = "512,256"
    block_tokens: int = 16
    prompt_blocks: int = 256
    decoder_blocks: int = 128
    pick: str = "rr"
    link_all: bool = False
    seed: int = 0
    netns: bool = False
    netem: str | None = None


async def run_cluster(opts: ClusterOptions, net: Network, progress: Progress) -> dict[str, Any]:
    """Run one configuration end to end (workers started and stopped here); returns its figures."""
    procs: list[_Process] = []
    try:
        return await _run(opts, net, procs, progress)
    finally:
        await asyncio.gather(*(p.stop() for p in procs))


async def _run(opts: ClusterOptions, net: Network, procs: list[_Process],
               progress: Progress) -> dict[str, Any]:
    n, m = opts.prompts, opts.decoders
    common = {"transport": opts.transport, "model": opts.model, "block_tokens": opts.block_tokens,
              "seed": opts.seed}
    for i in range(n + m):
        procs.append(await _Process.start(net.prefix(i), "prompt" if i < n else "decoder", i + 1))
    prompts, decoders = procs[:n], procs[n:]
    progress(f"{n}x{m}: starting {n} prompts (filling {opts.prompt_blocks}-block pools)")
    started = await asyncio.gather(*(p.call("start", role="prompt", cluster_id=p.cluster_id,
                                            ip=net.address(i), pool_blocks=opts.prompt_blocks, **common)
                                     for i, p in enumerate(prompts)))
    peers = [[p.cluster_id, net.address(i), s["port"]] for i, (p, s) in enumerate(zip(prompts, started))]
    progress(f"{n}x{m}: starting {m} decoders, each linking to {n} prompts")
    linked = await asyncio.gather(*(d.call("start", role="decoder", cluster_id=d.cluster_id,
                                           ip=net.address(n + j), pool_blocks=opts.decoder_blocks, peers=peers,
                                           link_all=opts.link_all, **common)
                                    for j, d in enumerate(decoders)))
    stream = {"seed": opts.seed, "prompts": [p[0] for p in peers], "prompt_blocks": opts.prompt_blocks,
              "block_tokens": opts.block_tokens, "prompt_len": opts.prompt_len, "inflight": opts.inflight,
              "pick": opts.pick}
    warm = await asyncio.gather(*(d.call("warmup", index=j, **stream) for j, d in enumerate(decoders)))
    start_at = time.monotonic() + 0.5
    progress(f"{n}x{m}: {opts.duration:g} s of requests")
    runs = asyncio.gather(*(d.call("run", index=j, start_at=start_at, duration=opts.duration, rate=opts.rate,
                                   **stream) for j, d in enumerate(decoders)))
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    busy = _machine_busy_s()
    prompt_before = await asyncio.gather(*(p.call("usage") for p in prompts))
    results = await runs
    prompt_after = await asyncio.gather(*(p.call("usage") for p in prompts))
    summary = _summarise(opts, started, linked, warm, results, list(zip(prompt_before, prompt_after)))
    summary["machine_busy_cpu_s"] = _machine_busy_s() - busy
    return summary


def _machine_busy_s() -> float:
    """CPU seconds this machine has been busy (all CPUs, any process: ``/proc/stat``), to tell how much of it
    went to processes other than the benchmark's during a run."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def _summarise(opts: ClusterOptions, started: list[dict[str, Any]], linked: list[dict[str, Any]],
               warm: list[dict[str, Any]], results: list[dict[str, Any]],
               prompt_usage: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    begin = min(r["usage"][0]["t"] for r in results)
    wall = max(r["usage"][1]["t"] for r in results) - begin
    nbytes = sum(r["bytes"] for r in results)
    requests = sum(r["requests"] for r in results)
    latencies = [t for r in results for t in r["latency_s"]]
    queued = [t for r in results for t in r["queued_s"]]
    link_s = [t for d in linked for t in d["link_s"]]
    errors: dict[str, int] = {}
    for r in results + warm:
        for name, count in r["errors"].items():
            errors[name] = errors.get(name, 0) + count
    usages = [(f"prompt {i + 1}", s["pid"], u) for i, (s, u) in enumerate(zip(started, prompt_usage))]
    usages += [(f"decoder {opts.prompts + j + 1}", d["pid"], tuple(r["usage"]))
               for j, (d, r) in enumerate(zip(linked, results))]
    messages = sum(after["messages"] - before["messages"] for _, _, (before, after) in usages)
    return {
        "shape": f"{opts.prompts}x{opts.decoders}", "options": asdict(opts),
        "links": sum(r["links"] for r in results), "planes": sorted({p for r in results for p in r["planes"]}),
        "requests": requests, "bytes": nbytes, "wall_s": wall, "gbps": gbps(nbytes, wall) if wall > 0 else 0.0,
        "requests_per_s": requests / wall if wall > 0 else 0.0,
        "latency_p50_ms": _percentile(latencies, 50), "latency_p99_ms": _percentile(latencies, 99),
        "queued_p99_ms": _percentile(queued, 99) if queued else None,
        "mean_request_mib": nbytes / requests / MIB if requests else 0.0,
        "link_ms_median": statistics.median(link_s) * 1e3, "link_ms_max": max(link_s) * 1e3,
        "link_total_ms_max": max(sum(d["link_s"]) for d in linked) * 1e3,
        "messages_per_request": messages / requests if requests else None,
        "checked": requests + sum(w["requests"] for w in warm),
        "byte_failures": sum(r["bad_requests"] + w["bad_requests"] for r, w in zip(results, warm)),
        "bad_blocks": sum(r["bad_blocks"] + w["bad_blocks"] for r, w in zip(results, warm)),
        "transfer_errors": errors, "unserved": sum(r["unserved"] for r in results),
        "stats_bytes": sum(r["stats_bytes"] for r in results),
        "check_cpu_s": sum(r["check_cpu_s"] for r in results),
        "prompt_fill_s": max(s["fill_s"] for s in started),
        "processes": [_process_row(name, pid, before, after, wall) for name, pid, (before, after) in usages],
    }


def _process_row(name: str, pid: int, before: dict[str, Any], after: dict[str, Any],
                 wall: float) -> dict[str, Any]:
    user, system = after["user_s"] - before["user_s"], after["sys_s"] - before["sys_s"]
    return {"process": name, "pid": pid, "user_s": user, "sys_s": system,
            "cpu_pct": 100 * (user + system) / wall if wall > 0 else 0.0, "threads": after["threads"],
            "fds": after["fds"], "rss_mib": after["rss_mib"],
            "page_tables_kib": after["page_tables_kib"], "messages": after["messages"] - before["messages"]}


def passed(result: dict[str, Any]) -> bool:
    """Every transfer succeeded, was checked and was byte-exact."""
    return (result["byte_failures"] == 0 and result["bad_blocks"] == 0 and not result["transfer_errors"]
            and result["requests"] > 0)


# -- report --------------------------------------------------------------------------------------------------
def _table(results: list[dict[str, Any]]) -> str:
    head = (f"{'shape':<6} {'links':>5} {'plane':<5} {'requests':>8} {'GB/s':>7} {'req/s':>7} {'MiB/req':>7} "
            f"{'p50 ms':>8} {'p99 ms':>8} {'link ms':>7} {'msgs/req':>8} {'checked':>7} {'bad':>4}")
    lines = [head]
    for r in results:
        msgs = r["messages_per_request"]
        lines.append(
            f"{r['shape']:<6} {r['links']:>5} {','.join(r['planes']):<5} {r['requests']:>8} {r['gbps']:>7.2f} "
            f"{r['requests_per_s']:>7.1f} {r['mean_request_mib']:>7.1f} {r['latency_p50_ms']:>8.1f} "
            f"{r['latency_p99_ms']:>8.1f} {r['link_ms_median']:>7.1f} "
            f"{'-' if msgs is None else format(msgs, '.2f'):>8} {r['checked']:>7} {r['byte_failures']:>4}")
    return "\n".join(lines)


def _cpu_table(r: dict[str, Any]) -> str:
    title = (f"CPU per process, {r['shape']} ({r['wall_s']:.2f} s wall; decoders spent {r['check_cpu_s']:.2f} s "
             "of theirs checking bytes):")
    head = (f"  {'process':<12} {'pid':>7} {'user s':>7} {'sys s':>7} {'% wall':>7} {'threads':>7} {'fds':>5} "
            f"{'RSS MiB':>8} {'PTE KiB':>8} {'msgs':>6}")
    lines = [title, head]
    for p in r["processes"]:
        lines.append(f"  {p['process']:<12} {p['pid']:>7} {p['user_s']:>7.2f} {p['sys_s']:>7.2f} "
                     f"{p['cpu_pct']:>6.0f}% {p['threads']:>7} {p['fds']:>5} {p['rss_mib']:>8.0f} "
                     f"{p['page_tables_kib']:>8} "
                     f"{p['messages']:>6}")
    total = sum(p["user_s"] + p["sys_s"] for p in r["processes"])
    busy = r["machine_busy_cpu_s"]
    lines.append(f"  all processes: {total:.2f} CPU s = {total / r['wall_s']:.2f} CPUs of {os.cpu_count()}; the "
                 f"machine was busy {busy:.2f} CPU s ({busy / r['wall_s']:.2f} CPUs), other processes included")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m aiodatadist bench cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--prompts", type=int, default=2, help="prompt processes (N)")
    add("--decoders", type=int, default=2, help="decoder processes (M); each links to every prompt")
    add("--transport", choices=[t.value for t in Transport], default="auto",
        help="llm.Transport of every instance")
    add("--model", choices=sorted(MODELS), default="llama3-8b", help="KV geometry")
    add("--rate", type=float, default=0.0, help="Poisson requests/s per decoder; 0: closed loop (default)")
    add("--inflight", type=int, default=2, help="requests transferring at once per decoder")
    add("--duration", type=float, default=10.0, help="seconds of requests per run")
    add("--prompt-len", default="512,256", help="tokens: MEAN,STDDEV (lognormal), normal:MEAN,STDDEV, "
        "uniform:LO,HI or fixed:N; clipped to [one block, what the pools allow]")
    add("--block-tokens", type=int, default=16, help="tokens per block")
    add("--pool-blocks", type=int, default=256, help="blocks of each prompt's pool")
    add("--decoder-blocks", type=int, default=128, help="blocks of each decoder's pool")
    add("--pick", choices=("rr", "random"), default="rr", help="how a decoder picks the prompt of a request")
    add("--link-all", action="store_true", help="each decoder links to every prompt in one link_clusters call "
        "(default: one call per prompt, one after another, each timed)")
    add("--seed", type=int, default=0, help="seeds request sizes, block ids and the byte pattern")
    add("--netns", action="store_true",
        help="one network namespace per process (root; auto/shm become --transport tcp)")
    add("--netem", help='tc netem arguments for every veth, e.g. "delay 1ms rate 10gbit" (needs --netns)')
    add("--baseline", action="store_true", help="also run 1x1 with the same options and print the ratio")
    add("--json", metavar="FILE", help="also write the results as JSON")
    add("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def _options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ClusterOptions:
    try:
        Lengths.parse(args.prompt_len)
    except ValueError as exc:
        parser.error(str(exc))
    if min(args.prompts, args.decoders, args.inflight, args.block_tokens) < 1 or args.duration <= 0:
        parser.error("--prompts, --decoders, --inflight and --block-tokens must be >= 1, --duration > 0")
    if args.decoder_blocks < args.inflight or args.pool_blocks < 1 or args.rate < 0:
        parser.error("--decoder-blocks must be >= --inflight, --pool-blocks >= 1, --rate >= 0")
    if MODELS[args.model].block_bytes(args.block_tokens) % 8:
        parser.error("a block must be a multiple of 8 bytes")
    if args.netem and not args.netns:
        parser.error("--netem needs --netns")
    transport = args.transport
    if args.netns and transport in ("auto", "shm"):
        sys.stderr.write(f"--netns: using --transport tcp instead of {transport} (namespaces do not hide a peer "
                         "from the same-host probe: it would still pick shared memory)\n")
        transport = "tcp"
    return ClusterOptions(args.prompts, args.decoders, transport, args.model, args.rate, args.inflight,
                          args.duration, args.prompt_len, args.block_tokens, args.pool_blocks, args.decoder_blocks,
                          args.pick, args.link_all, args.seed, args.netns, args.netem)


def _run_one(opts: ClusterOptions, progress: Progress) -> dict[str, Any]:
    with _network(opts.netns, opts.prompts + opts.decoders, opts.netem) as net:
        return asyncio.run(run_cluster(opts, net, progress))


def main(argv: list[str]) -> int:
    """``bench cluster``: 0 when every transfer succeeded and was byte-exact, 1 otherwise, 2 when a worker or the
    namespaces failed (cleaned up first)."""
    parser = _parser()
    args = parser.parse_args(argv)
    opts = _options(parser, args)
    progress = stderr_progress(args.quiet)

    model = MODELS[opts.model]
    loop = f"Poisson {opts.rate:g} req/s per decoder" if opts.rate else "closed loop"
    sys.stdout.write(
        f"aiodatadist bench cluster: {opts.model} ({model.tensors} tensors x "
        f"{model.block_bytes(opts.block_tokens) >> 10} KiB blocks of {opts.block_tokens} tokens), transport "
        f"{opts.transport}{' in network namespaces' if opts.netns else ''}, {loop}, {opts.inflight} in flight per "
        f"decoder, {opts.duration:g} s, prompt length {opts.prompt_len}\n")
    progress("memory bandwidth: np.copyto 256 MiB, median of 5")
    bandwidth = copyto_gbps(256 * MIB, 5)
    sys.stdout.write(f"memory bandwidth (np.copyto 256 MiB, median of 5): {bandwidth:.2f} GB/s\n")
    shapes = [replace(opts, prompts=1, decoders=1)] if args.baseline else []
    try:
        results = [_run_one(shape, progress) for shape in [*shapes, opts]]
    except RuntimeError as exc:  # a worker failed or the namespaces could not be made: both already cleaned up
        sys.stderr.write(f"bench cluster: {exc}\n")
        return 2
    sys.stdout.write(_table(results) + "\n")
    report: dict[str, Any] = {"memory_bandwidth_gbps": bandwidth, "cpus": os.cpu_count(), "runs": results}
    if args.baseline:
        ratio = results[-1]["gbps"] / results[0]["gbps"] if results[0]["gbps"] else float("nan")
        report["ratio_vs_single_pair"] = ratio
        sys.stdout.write(f"aggregate {results[-1]['shape']} / single pair 1x1: {ratio:.2f}\n")
    for r in results:
        sys.stdout.write(_cpu_table(r) + "\n")
    ok = all(passed(r) for r in results)
    for r in results:
        if not passed(r):
            sys.stdout.write(f"FAIL {r['shape']}: {r['byte_failures']} requests with wrong bytes "
                             f"({r['bad_blocks']} blocks), transfer errors {r['transfer_errors']}\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))