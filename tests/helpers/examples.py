"""How many examples a property test runs: all of them in a full run, a tenth in the quick loop.

The quick loop is ``pytest -m "not slow and not integration"`` (see ``tests/README.md``): ``tests/conftest.py``
switches it on before any test module is imported, so ``@settings(max_examples=examples(300))`` is evaluated
with the right scale.  CI runs the full suite, with every example.
"""

from __future__ import annotations

QUICK_SCALE = 10
_quick = False


def set_quick(quick: bool) -> None:
    global _quick
    _quick = quick


def quick() -> bool:
    return _quick


def examples(full: int) -> int:
    """``full`` examples in a full run; about a tenth (at least 5) in the quick loop."""
    return max(5, full // QUICK_SCALE) if _quick else full
