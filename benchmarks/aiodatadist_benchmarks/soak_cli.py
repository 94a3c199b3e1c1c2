"""``python -m aiodatadist soak``: the command line of the soak (:mod:`.soak`) and the chaos soak
(:mod:`.soak_chaos`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from .soak import __doc__ as SOAK_DOC
from .soak import _summary, run_soak
from .soak_chaos import EVENT_WEIGHTS, chaos_summary, run_chaos_soak

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiodatadist soak", description=SOAK_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the workers run (default 60)")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent workers (default 16)")
    parser.add_argument("--transport", choices=("auto", "shm", "tcp"), default="auto",
                        help="llm.Transport of both sides (default auto)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random transfers and patterns")
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    parser.add_argument("--chaos", action="store_true",
                        help="kill and restart, stop and cut off the prompt process at random moments "
                             "(see benchmarks/aiodatadist_benchmarks/soak_chaos.py)")
    parser.add_argument("--chaos-every", type=float, metavar="S",
                        help="with --chaos: an event every S seconds (default: every 5-20 s, seeded); the first is "
                             "always a kill")
    parser.add_argument("--chaos-events", metavar="K,K,...",
                        help="with --chaos: inject these kinds in this order, cyclically (kill, sigstop, proxy_stall, "
                             "proxy_cut, data_cut, port_churn; default: random kinds, the first a kill)")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.concurrency < 1 or args.seed < 0:
        parser.error("--seconds must be > 0, --concurrency >= 1 and --seed >= 0")
    if args.chaos_every is not None and (not args.chaos or args.chaos_every <= 0):
        parser.error("--chaos-every needs --chaos and must be > 0")
    kinds = None if args.chaos_events is None else args.chaos_events.split(",")
    if kinds is not None and (not args.chaos or not kinds or set(kinds) - set(EVENT_WEIGHTS)):
        parser.error(f"--chaos-events needs --chaos and takes kinds among {', '.join(EVENT_WEIGHTS)}")
    started = time.perf_counter()

    def progress(line: str) -> None:
        sys.stderr.write(f"[soak {time.perf_counter() - started:6.1f} s] {line}\n")
        sys.stderr.flush()

    if args.chaos:
        figures = asyncio.run(run_chaos_soak(args.seconds, concurrency=args.concurrency, transport=args.transport,
                                             seed=args.seed, every=args.chaos_every, kinds=kinds,
                                             progress=progress))
        lines = chaos_summary(figures)
    else:
        figures = asyncio.run(run_soak(args.seconds, concurrency=args.concurrency, transport=args.transport,
                                       seed=args.seed, progress=progress))
        lines = _summary(figures)
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0 if figures["ok"] else 1
