"""Command line: ``python -m aiodatadist {demo,bench,soak,info}``."""

from __future__ import annotations

import sys

__all__ = ["main"]

USAGE = """usage: python -m aiodatadist {demo,bench,soak,info} [options]

  demo   a prompt and a decoder process move a paged KV cache; prints what happened
  bench  throughput and latency against the machine's own limits (see: bench --help; bench vllm --help)
  soak   random concurrent transfers with cancellations for N seconds, every byte verified (see: soak --help)
  info   version, data planes, copy executor and threads, GPU
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "demo":
        from .tools.demo import main as demo_main

        return demo_main(rest)
    if command == "bench":
        from .tools.bench import main as bench_main

        return bench_main(rest)
    if command == "soak":
        from .tools.soak_cli import main as soak_main

        return soak_main(rest)
    if command == "info":
        from .tools.info import main as info_main

        return info_main(rest)
    sys.stderr.write(USAGE)
    return 2


if __name__ == "__main__":
    sys.exit(main())
