"""The benchmarks of aiodatadist: ``bench`` (throughput and latency against the machine's own limits, measured in
the same run; :mod:`.bench`) and ``soak`` (random concurrent transfers with cancellations and, with ``--chaos``,
faults, every byte verified; :mod:`.soak_cli`), with the peer harnesses (raw NIXL, vLLM, SGLang) they compare
with, and the hostile-client generator of the chaos soak (:mod:`.port_churn`).

Run as ``python -m aiodatadist bench|soak ...`` (the library forwards both commands here) or
``python -m aiodatadist_benchmarks bench|soak ...``.  They use aiodatadist's public API, ``aiodatadist.testing``
and its benchmark hooks (``aiodatadist.testing.probes``) only.
"""

from __future__ import annotations

import sys

__all__ = ["COMMANDS", "main"]

COMMANDS = ("bench", "soak")


def main(command: str, argv: list[str]) -> int:
    """Run ``command`` (one of :data:`COMMANDS`) with its arguments; 2 for an unknown command."""
    if command == "bench":
        from .bench import main as bench_main

        return bench_main(argv)
    if command == "soak":
        from .soak_cli import main as soak_main

        return soak_main(argv)
    sys.stderr.write(f"usage: python -m aiodatadist_benchmarks {{{','.join(COMMANDS)}}} [options]\n")
    return 2
