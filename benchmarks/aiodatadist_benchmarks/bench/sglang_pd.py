"""``python -m aiodatadist bench sglang``: SGLang prefill/decode disaggregation on this machine, per transfer backend.

A random Llama (``vllm_model``, 32 layers, bf16 in SGLang: 32 KiB of KV a token) runs in SGLang servers on the CPU
(:mod:`.sglang_servers`).  In one run:

1. a single engine (no disaggregation) gives the reference: greedy tokens of ``--prompts`` random prompts
   (``--prompt-tokens`` each, 16 new tokens);
2. for each backend configuration, a prefill server (P) and a decode server (D) behind SGLang's PD router; D's
   tokens (through the router) must equal the reference's exactly;
3. timing, in ``--rounds`` rounds that alternate the single engine and the configurations (each round: two warm-up
   requests, then every prompt once, one at a time, ``max_new_tokens=1``): the request's time at the client
   (through the router: P's prefill, the transfer and D's first token), D's own time to first token
   (``meta_info.e2e_latency`` of D's answer), and SGLang's ``kv_transfer_latency`` of the request (P's
   ``sglang:kv_transfer_latency_ms`` histogram, ``--enable-metrics``: from P's first chunk handed to the backend
   until P's sender saw ``Success``).  Medians per round and over all rounds.  From SGLang's per-stage timers of
   P and D (``sglang:per_stage_req_latency_seconds``), each configuration's median per stage, and its **P/D
   overhead**: each request's time minus P's forward pass (``prefill_forward``), the part a transfer backend can
   change; on a shared machine the forward pass moves by tens of milliseconds between minutes and decides the
   request's time.  After the warm-up requests every server's garbage collector is frozen (SGLang's
   ``/freeze_gc``, as its own long-collection warning advises): a generation-2 collection in P's scheduler process
   took 0.5-0.6 s here (``gc_log`` tweak), and one that fell in a timed request added that much to it.

Only the setup at work runs: each round starts its servers and stops them after its requests (an idle NIXL decode
polls a core at 100 %, which slowed every other server here tenfold; and NIXL does not survive its processes being
paused).  The radix cache is off on P and on the single engine (a repeated prompt would be served from it).  P (and
the single engine) run on one half of the CPUs, D on the other (``taskset``; torch gets one thread per CPU;
``--no-pin``): SGLang's decode polls a core while it waits for a transfer, and NIXL's decode has a progress thread
that polls too; on two cores, unpinned, they slowed P's own prefill threefold (NIXL: twentyfold).
Configurations:

* ``nixl-best``: SGLang's NIXL backend at its best settings here: UCX over ``tcp,self,sm`` on loopback, the KV pool
  registered as host memory (``nixl_dram``: without it UCX refuses the pool), and P's agent without progress
  thread and without UCX thread pool (``nixl_quiet_prefill``; off on both sides, the first transfer hangs);
* ``nixl``: the same without ``nixl_quiet_prefill`` (as SGLang ships it, but for what a CPU needs);
* ``aiodatadist``: ``--disaggregation-transfer-backend aiodatadist``, no settings.

The servers need SGLang, ``sglang-router`` and, on a machine without CUDA, the ``sgl_kernel`` shim on
``PYTHONPATH``: ``bash scripts/sglang_tests.sh --bench`` provides all three.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .sglang_servers import Router, Server, ServerError, ServerSettings, generate, metric, stage_sums
from .sglang_tweaks import site_dir
from .timing import exit_on_sigterm, stderr_progress

__all__ = ["CONFIGS", "BackendConfig", "main", "run_sglang_bench"]

MAX_TOKENS = 16
WARMUP = 2
TRANSFER_METRIC = "sglang:kv_transfer_latency_ms"
PREFILL_FORWARD = "prefill_forward"  # P's forward pass: compute, whatever the transfer backend
_UCX_LOOPBACK = {"SGLANG_DISAGGREGATION_NIXL_BACKEND": "UCX", "UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BackendConfig:
    """One P/D configuration: the transfer backend, tweaks of P and of D (:mod:`.sglang_tweaks`), environment."""

    name: str
    backend: str
    description: str
    p_tweaks: str = ""
    d_tweaks: str = ""
    env: dict[str, str] = field(default_factory=dict)
    module: str = ""  # a module the configuration needs


CONFIGS: tuple[BackendConfig, ...] = (
    BackendConfig("nixl-best", "nixl", "SGLang's NIXL backend at its best settings here (UCX tcp/sm on loopback, "
                  "P without progress thread and UCX thread pool)", "nixl_dram,nixl_quiet_prefill", "nixl_dram",
                  dict(_UCX_LOOPBACK), "nixl._api"),
    BackendConfig("nixl", "nixl", "SGLang's NIXL backend as shipped (UCX tcp/sm on loopback, host-memory pool)",
                  "nixl_dram", "nixl_dram", dict(_UCX_LOOPBACK), "nixl._api"),
    BackendConfig("aiodatadist", "aiodatadist", "--disaggregation-transfer-backend aiodatadist, no settings"),
    BackendConfig("aiodatadist-private", "aiodatadist", "the same with D's KV buffers left private "
                  "(AIODATADIST_SGLANG_SHARE_KV=off: P pushes with process_vm_writev)",
                  env={"AIODATADIST_SGLANG_SHARE_KV": "off"}),
    BackendConfig("aiodatadist-nice10", "aiodatadist", "the same with the copy threads below the scheduler's "
                  "priority (AIODATADIST_COPY_NICE=10, the library's default outside SGLang)",
                  env={"AIODATADIST_COPY_NICE": "10"}),
)
DEFAULT_CONFIGS = ("nixl-best", "aiodatadist")


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


class _Setup:
    """One configuration (or the single engine, ``config`` None): its servers while it runs, and its figures."""

    def __init__(self, config: BackendConfig | None, settings: ServerSettings, single: ServerSettings,
                 cpus: tuple[set[int], set[int]] | None) -> None:
        self.config = config
        self.cpus = cpus  # (P's and the single engine's, D's)
        self.name = config.name if config else "single"
        self.settings = dataclasses.replace(settings, env=dict(config.env)) if config else single
        self.owned: list[Server | Router] = []
        self.prefill: Server | None = None
        self.decode: Server | None = None
        self.url = ""
        self.rounds: list[dict[str, Any]] = []
        self.result: dict[str, Any] = {"config": self.name,
                                       "description": config.description if config else "one engine, no P/D"}

    def start(self, probe: list[int], progress: Progress) -> None:
        """Start the servers (and the router of a P/D pair), and wait until they serve."""
        config = self.config
        if config is None:
            server = Server("bench-single", self.settings, "single", radix_cache=False,
                            cpus=self.cpus[0] if self.cpus else None)
            self.owned.append(server)
            self.url = server.wait_ready().url
            startup = f"{server.startup_s:.1f} s"
        else:
            self.prefill = Server(f"bench-{config.name}-P", self.settings, "prefill", config.backend,
                                  tweaks=config.p_tweaks, radix_cache=False, cpus=self.cpus[0] if self.cpus else None)
            self.owned.append(self.prefill)
            decode = Server(f"bench-{config.name}-D", self.settings, "decode", config.backend, tweaks=config.d_tweaks,
                            cpus=self.cpus[1] if self.cpus else None)
            self.owned.append(decode)
            self.decode = decode
            self.prefill.wait_ready()
            decode.wait_ready()
            router = Router(self.prefill, decode, self.settings.log_dir)
            self.owned.append(router)
            self.url = router.wait_ready(probe).url
            startup = f"P {self.prefill.startup_s:.1f} s, D {decode.startup_s:.1f} s"
        progress(f"{self.name}: up ({startup})")

    def stop(self) -> None:
        for process in reversed(self.owned):
            process.stop()
        self.owned.clear()
        self.prefill = self.decode = None

    def snapshot(self) -> tuple[float | None, dict[str, float]]:
        """P's ``kv_transfer_latency`` sum so far, and the seconds so far per request stage of P and of D
        (``P prefill_forward``, ``D decode_waiting``, ...)."""
        if self.prefill is None or self.decode is None:
            return None, {}
        text = self.prefill.metrics()
        stages = {f"P {k}": v for k, v in stage_sums(text).items()}
        stages.update({f"D {k}": v for k, v in stage_sums(self.decode.metrics()).items()})
        return metric(text, TRANSFER_METRIC + "_sum"), stages

    def tokens(self, prompts: list[list[int]]) -> list[list[int]]:
        return [generate(self.url, p, MAX_TOKENS)["output_ids"] for p in prompts]

    def measure(self, prompts: list[list[int]], warmup: list[list[int]]) -> dict[str, Any]:
        """One round: warm-up requests, then each prompt once with ``max_new_tokens=1``."""
        for prompt in warmup:
            generate(self.url, prompt, 1)
        for server in self.owned:  # as SGLang's own warning advises once it is warm (see the module's docstring)
            if isinstance(server, Server):
                server.freeze_gc()
        requests, ttft, transfers = [], [], []
        stages: dict[str, list[float]] = {}
        for prompt in prompts:
            before, stages_before = self.snapshot()
            out = generate(self.url, prompt, 1)
            requests.append(out["seconds"] * 1000)
            latency = out["meta_info"].get("e2e_latency")
            if isinstance(latency, (int, float)):
                ttft.append(latency * 1000)
            after, stages_after = self.snapshot()
            if before is not None and after is not None:
                transfers.append(after - before)
            for stage, seconds in stages_after.items():
                stages.setdefault(stage, []).append((seconds - stages_before.get(stage, 0.0)) * 1000)
        forward = stages.get(f"P {PREFILL_FORWARD}", [])
        overhead = [r - f for r, f in zip(requests, forward)] if len(forward) == len(requests) else []
        round_result: dict[str, Any] = {}
        for key, values in (("request", requests), ("ttft_d", ttft), ("transfer", transfers),
                            ("overhead", overhead)):
            round_result[f"{key}_ms"] = _median(values)
            round_result[f"{key}_all_ms"] = [round(v, 2) for v in values]
        round_result["stages_all_ms"] = {k: [round(v, 2) for v in values] for k, values in sorted(stages.items())}
        self.rounds.append(round_result)
        return round_result

    def summarize(self) -> None:
        """Medians over every request of every round."""
        self.result["rounds"] = self.rounds
        for key in ("request", "ttft_d", "transfer", "overhead"):
            self.result[f"{key}_ms"] = _median([v for r in self.rounds for v in r.get(f"{key}_all_ms", [])])
        names = sorted({stage for r in self.rounds for stage in r.get("stages_all_ms", {})})
        self.result["stages_ms"] = {name: _median([v for r in self.rounds for v in r["stages_all_ms"].get(name, [])])
                                    for name in names}


def split_cpus() -> tuple[set[int], set[int]] | None:
    """This process's CPUs in two halves (P and the single engine, D); None with fewer than two."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        return None
    half = len(mine) // 2
    return set(mine[:half]), set(mine[half:])


def run_sglang_bench(configs: list[BackendConfig], prompt_count: int, prompt_tokens: int, layers: int, rounds: int,
                     page_size: int, log_dir: str, progress: Progress, pin: bool = True) -> dict[str, Any]:
    """The whole benchmark (see the module's documentation)."""
    from .vllm_model import ModelSpec, build_model, kv_bytes_per_token, random_prompts

    spec = ModelSpec(layers=layers, dtype="bfloat16", max_positions=max(1024, 2 * prompt_tokens))
    all_prompts = random_prompts(prompt_count + WARMUP, prompt_tokens, spec.vocab_size)
    prompts, warmup = all_prompts[:prompt_count], all_prompts[prompt_count:]
    report: dict[str, Any] = {"layers": layers, "prompt_tokens": prompt_tokens, "prompts": prompt_count,
                              "rounds": rounds, "page_size": page_size,
                              "kv_bytes_per_prompt": kv_bytes_per_token(spec) * prompt_tokens}
    with tempfile.TemporaryDirectory(prefix="aiodatadist-sglang-") as model_dir:
        build_model(model_dir, spec)
        logs = log_dir or str(Path(model_dir) / "logs")
        settings = ServerSettings(model_dir, page_size=page_size, max_total_tokens=8192, log_dir=logs,
                                  site_dir=site_dir(), enable_metrics=True)
        single = ServerSettings(model_dir, page_size=page_size, max_total_tokens=8192, log_dir=logs)
        cpus = split_cpus() if pin else None
        report["cpus"] = None if cpus is None else [sorted(cpus[0]), sorted(cpus[1])]
        setups = [_Setup(None, settings, single, cpus)] + [_Setup(c, settings, single, cpus) for c in configs]
        reference: list[list[int]] = []
        try:
            for round_index in range(rounds):
                order = setups if round_index % 2 == 0 else [setups[0]] + setups[:0:-1]
                for setup in order:  # one configuration runs at a time, alone on the machine
                    try:
                        setup.start(warmup[0][:16], progress)
                        if round_index == 0:
                            _check_tokens(setup, prompts, reference, progress)
                        result = setup.measure(prompts, warmup)
                    finally:
                        setup.stop()
                    progress(f"round {round_index + 1} {setup.name}: request {result['request_ms']} ms, D TTFT "
                             f"{result['ttft_d_ms']} ms, kv_transfer_latency {result['transfer_ms']} ms")
        except ServerError as exc:
            report["error"] = str(exc)
            progress(f"FAILED: {exc}")
        for setup in setups:
            setup.summarize()
        report["results"] = [setup.result for setup in setups]
        report["log_dir"] = logs if log_dir else ""
    return report


def _check_tokens(setup: _Setup, prompts: list[list[int]], reference: list[list[int]], progress: Progress) -> None:
    """The single engine's tokens become the reference; a P/D pair's must equal them."""
    got = setup.tokens(prompts)
    if setup.config is None:
        reference[:] = got
        return
    mismatches = [i for i, (a, b) in enumerate(zip(reference, got, strict=True)) if a != b]
    setup.result.update(identical=not mismatches, mismatches=mismatches)
    progress(f"{setup.name}: tokens {'identical' if not mismatches else f'DIFFERENT for {mismatches}'}")


def format_table(report: dict[str, Any]) -> str:
    """The medians over all rounds, one line per configuration, then each round's."""
    def fmt(value: Any) -> str:
        return "-" if value is None else f"{value:.1f}"

    header = (f"{'config':<12} {'tokens':>9} {'request ms':>11} {'TTFT on D ms':>13} {'kv_transfer ms':>15} "
              f"{'P/D overhead ms':>16} {'per round (request / transfer ms)':>36}")
    lines = [header, "-" * len(header)]
    for res in report.get("results", []):
        checked = res.get("identical")
        identical = "(ref)" if res["config"] == "single" else (
            "-" if checked is None else "identical" if checked else "DIFFERENT")
        rounds = "  ".join(f"{fmt(r['request_ms'])}/{fmt(r['transfer_ms'])}" for r in res.get("rounds", []))
        lines.append(f"{res['config']:<12} {identical:>9} {fmt(res.get('request_ms')):>11} "
                     f"{fmt(res.get('ttft_d_ms')):>13} {fmt(res.get('transfer_ms')):>15} "
                     f"{fmt(res.get('overhead_ms')):>16} {rounds:>36}")
    for res in report.get("results", []):  # where a P/D request's time goes, by SGLang's own stage timers
        stages = [f"{name} {fmt(ms)}" for name, ms in res.get("stages_ms", {}).items() if ms]
        if stages:
            lines.append(f"{res['config']} stages, ms (medians): " + ", ".join(stages))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``bench sglang`` command line: 0 when every configuration gave identical tokens, 1 otherwise, 2 without
    SGLang or on bad options."""
    parser = argparse.ArgumentParser(prog="python -m aiodatadist bench sglang", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [c.name for c in CONFIGS]
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, among {', '.join(names)} (default: {','.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per round (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=400, help="tokens of each prompt (default 400)")
    parser.add_argument("--layers", type=int, default=32, help="layers of the random Llama (default 32)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds alternating the configurations (default 2)")
    parser.add_argument("--page-size", type=int, default=16, help="SGLang's --page-size (default 16)")
    parser.add_argument("--no-pin", action="store_true",
                        help="do not pin P (and the single engine) and D to separate halves of the CPUs")
    parser.add_argument("--log-dir", default="", help="keep the servers' logs there (default: dropped)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    wanted = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown or min(args.prompts, args.prompt_tokens, args.layers, args.rounds, args.page_size) < 1:
        parser.error(f"unknown configs {unknown}" if unknown else "numbers must be >= 1")
    for module in ("sglang", "sglang_router"):
        if importlib.util.find_spec(module) is None:
            sys.stderr.write(f"bench sglang needs {module} (see scripts/sglang_tests.sh)\n")
            return 2
    configs = [c for c in CONFIGS if c.name in wanted]
    missing = [c.name for c in configs if c.module and importlib.util.find_spec(c.module.split(".")[0]) is None]
    if missing:
        sys.stderr.write(f"bench sglang: {missing} need NIXL (pip install nixl-cu13==1.5.1; nixl==1.5.1 --no-deps)\n")
        return 2
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # runs the finally clauses that stop the servers
    started = time.perf_counter()
    progress = stderr_progress(args.quiet, started)

    report = run_sglang_bench(configs, args.prompts, args.prompt_tokens, args.layers, args.rounds, args.page_size,
                              args.log_dir, progress, pin=not args.no_pin)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    sys.stdout.write(f"aiodatadist bench sglang: {args.prompts} prompts x {args.prompt_tokens} tokens, {args.layers} "
                     f"layers (bf16), KV {report['kv_bytes_per_prompt'] / (1 << 20):.1f} MiB a prompt, page size "
                     f"{args.page_size}, {args.rounds} rounds, medians; {report['elapsed_s']} s\n")
    sys.stdout.write(format_table(report) + "\n")
    if report.get("error"):
        sys.stdout.write(f"error: {report['error'].splitlines()[0]}\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
    pd = [r for r in report.get("results", []) if r["config"] != "single"]
    return 0 if pd and all(r.get("identical") for r in pd) and not report.get("error") else 1


if __name__ == "__main__":
    sys.exit(main())
