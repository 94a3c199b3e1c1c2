"""``bench`` and ``soak`` forwarded to the benchmarks distribution (import package ``aiodatadist_benchmarks``).

The benchmarks live outside the library (``benchmarks/`` in the repository, with a ``pyproject.toml`` of their
own, depending on aiodatadist), so the library loads them by name, only when one of their commands runs, and
says how to install them when they are missing.
"""

from __future__ import annotations

import importlib
import sys
from typing import Final, Protocol, cast

__all__ = ["BENCHMARKS", "INSTALL_HINT", "LAB_COMMANDS", "forward"]

BENCHMARKS: Final = "aiodatadist_benchmarks"
LAB_COMMANDS: Final = ("bench", "soak")
INSTALL_HINT: Final = ("the benchmarks are a distribution of their own (benchmarks/ in the aiodatadist "
                       "repository); install it from a checkout with: pip install -e ./benchmarks")
MISSING_STATUS: Final = 2  # as for a command line error: nothing ran


class _Commands(Protocol):
    def main(self, command: str, argv: list[str]) -> int: ...


def forward(command: str, argv: list[str]) -> int:
    """Run ``command`` (``bench`` or ``soak``) of the benchmarks with ``argv``; without them installed, print
    how to install them and return 2."""
    try:
        module = importlib.import_module(BENCHMARKS)
    except ModuleNotFoundError as exc:
        if exc.name != BENCHMARKS:  # the benchmarks are there, something they import is not: say what
            raise
        sys.stderr.write(f"python -m aiodatadist {command}: not installed here: {INSTALL_HINT}\n")
        return MISSING_STATUS
    return cast(_Commands, module).main(command, argv)
