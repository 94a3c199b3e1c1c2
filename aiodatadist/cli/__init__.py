"""The command line, ``python -m aiodatadist {demo,bench,soak,info}`` (and the ``aiodatadist`` console script).

``demo`` (:mod:`.demo`) and ``info`` (:mod:`.info`) are the library's own; ``bench`` and ``soak`` belong to the
benchmarks distribution (``benchmarks/`` in the repository, import package ``aiodatadist_benchmarks``), to
which :mod:`.lab` forwards them.  Built on the public API; nothing in the library imports it.
"""

from __future__ import annotations

import sys

from .lab import LAB_COMMANDS, forward

__all__ = ["USAGE", "main"]

USAGE = """usage: python -m aiodatadist {demo,bench,soak,info} [options]

  demo   a prompt and a decoder process move a paged KV cache; prints what happened
  bench  throughput and latency against the machine's own limits (see: bench --help; bench vllm --help)
  soak   random concurrent transfers with cancellations for N seconds, every byte verified (see: soak --help)
  info   version, data planes, copy executor and threads, GPU

bench and soak come with the benchmarks distribution: pip install -e ./benchmarks (in a checkout)
"""


def main(argv: list[str] | None = None) -> int:
    """Run one command with its arguments (``argv``: the command line after the program's name)."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if command == "info":
        from .info import main as info_main

        return info_main(rest)
    if command in LAB_COMMANDS:
        return forward(command, rest)
    sys.stderr.write(USAGE)
    return 2
