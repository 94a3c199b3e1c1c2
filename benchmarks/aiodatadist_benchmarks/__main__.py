"""``python -m aiodatadist_benchmarks {bench,soak} [options]`` (the same as ``python -m aiodatadist bench|soak``)."""

from __future__ import annotations

import sys

from . import main

if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[0] if args else "", args[1:]))
