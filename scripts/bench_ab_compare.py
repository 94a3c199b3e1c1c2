"""Medians of alternated bench runs (scripts/bench_ab.sh): each row's median per side and B/A.

Usage: python scripts/bench_ab_compare.py DIR   (DIR holds a-*.json and b-*.json from `bench --json`)
"""

from __future__ import annotations

import collections
import glob
import json
import statistics
import sys
from pathlib import Path


def main(folder: str) -> None:
    rows: dict[tuple[str, ...], dict[str, list[float]]] = collections.defaultdict(lambda: {"a": [], "b": []})
    for path in sorted(glob.glob(f"{folder}/*.json")):
        side = Path(path).name.split("-")[0]
        with open(path) as f:
            results = json.load(f)
        for r in results:
            tags = [t for t in ("new_blocks", "by_key", "registered") if r.get(t)]
            tags += ["spaced"] if r.get("spaced_ms") else []
            metric = next(m for m in ("gbps", "p50_us", "p50_ms") if m in r)
            key = (r["workload"], r["transport"], r["direction"], str(r.get("spans", "")), ",".join(tags), metric)
            rows[key][side].append(r[metric])
    print(f"{'workload':8} {'plane':5} {'dir':5} {'spans':>5} {'variant':22} {'metric':7} {'A':>9} {'B':>9} {'B/A':>6} runs")
    for key, v in sorted(rows.items()):
        if v["a"] and v["b"]:
            a, b = statistics.median(v["a"]), statistics.median(v["b"])
            print(f"{key[0]:8} {key[1]:5} {key[2]:5} {key[3]:>5} {key[4]:22} {key[5]:7} {a:9.3f} {b:9.3f} "
                  f"{b / a:6.3f} {len(v['a'])}/{len(v['b'])}")


if __name__ == "__main__":
    main(sys.argv[1])
