"""``python -m aiodatadist bench`` end to end (real processes, through the library's forwarder): the rows, their
baselines measured in the same run, and the command line's checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]  # the repository


def run(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False, timeout=timeout,
                          cwd=ROOT, env=None if env is None else {**os.environ, **env})



def test_bench_local_reports_a_ratio(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = run("-m", "aiodatadist", "bench", "local", "small", "--repeat", "1", "--transport", "shm",
                 "--direction", "pull", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads(out.read_text())
    local = next(r for r in results if r["workload"] == "local")
    assert local["ratio"] > 0 and local["baseline_gbps"] > 0
    # the copy limit, measured in turn with the workload (the native helper is built in this suite)
    assert local["limit"].startswith("streaming copy 256 MiB, ")
    assert local["limit_gbps"] > 0 and local["limit_ratio"] == pytest.approx(local["gbps"] / local["limit_gbps"])
    assert local["same_memory"] == "streaming copy 256 MiB within the local cache"  # its own pages, contiguous
    assert local["same_memory_ratio"] == pytest.approx(local["gbps"] / local["same_memory_gbps"])
    small = next(r for r in results if r["workload"] == "small")
    assert 0 < small["p50_ms"] <= small["p99_ms"] and small["transport"] == "shm" and "spaced_ms" not in small
    spaced = [r for r in results if r["workload"] == "small" and "spaced_ms" in r]  # the same call, the loop idle
    assert len(spaced) == 1 and spaced[0]["spaced_ms"] == 1 and 0 < spaced[0]["p50_ms"] <= spaced[0]["p99_ms"]
    assert "baseline: np.copyto" in result.stderr  # progress lines


def test_bench_tcp_measures_against_the_native_ceiling_over_the_links_connections(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = run("-m", "aiodatadist", "bench", "paged", "small", "--repeat", "1", "--transport", "tcp",
                 "--json", str(out), env={"AIODATADIST_TCP_CONNECTIONS": "3"})
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads(out.read_text())
    paged = [r for r in results if r["workload"] == "paged"]
    assert {r["direction"] for r in paged} == {"pull", "push"}
    ceiling = "native TCP 256 MiB, 3 connections" if shutil.which("cc") else "Python TCP 256 MiB, 3 connections"
    assert all(r["transport"] == "tcp" and r["baseline"].startswith(ceiling) and r["ratio"] > 0 for r in paged)
    assert "over 3 connections (the link's data connections" in result.stderr
    assert {r["direction"] for r in results if r["workload"] == "small"} == {"pull", "push"}


def test_bench_calls_times_both_sizes_in_turn(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = run("-m", "aiodatadist", "bench", "calls", "--repeat", "1", "--transport", "shm", "--direction",
                 "pull,push", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [r for r in json.loads(out.read_text()) if r["workload"] == "calls"]
    each_way = [(64, False, False, False), (8192, False, False, False), (64, True, False, False),
                (8192, True, False, False)]
    assert [(r["direction"], r["spans"], r.get("new_blocks", False), r.get("by_key", False),
             r.get("registered", False)) for r in rows] == [
        *(("pull", *r) for r in each_way), ("pull", 64, False, True, False), ("pull", 8192, True, False, True),
        *(("push", *r) for r in each_way), ("push", 8192, True, False, True)]
    assert all(r["runs"] == 500 and 0 < r["p50_us"] <= r["p99_us"] for r in rows)
    assert ["ns_per_extra_span" in r for r in rows] == [False, True, False, False, False, False,
                                                         False, True, False, False, False]
    assert ("calls of 64 and 8192 spans, and of 64 and 8192 spans of other blocks each call, in turn x 500, then by "
            "request key") in result.stderr
    assert result.stderr.count("then of registered memory") == 2
    assert "other blocks each call" in result.stdout and "pull_cache by CacheKey (through the owner)" in result.stdout
    assert result.stdout.count("other blocks each call, memory the peer registered") == 2


def test_bench_rejects_unknown_workloads_and_transports() -> None:
    result = run("-m", "aiodatadist", "bench", "nonsense")
    assert result.returncode == 2 and "unknown workloads" in result.stderr
    result = run("-m", "aiodatadist", "bench", "small", "--transport", "rdma")
    assert result.returncode == 2 and "--transport" in result.stderr
