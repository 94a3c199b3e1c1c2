"""``bench cluster`` (:mod:`aiodatadist_benchmarks.bench.cluster`, workers in :mod:`.cluster_worker`): N prompt and
M decoder processes, every transfer byte-checked; its checker flags corruption; ``--netns`` runs over TCP
between namespaces and leaves none behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodatadist_benchmarks.bench.cluster_worker import bad_blocks, fill_blocks, pattern_stream

ROOT = Path(__file__).resolve().parents[3]  # the repository
SMALL = ["--model", "tiny", "--duration", "1.5", "--pool-blocks", "64", "--decoder-blocks", "32",
         "--prompt-len", "128,64", "--quiet"]
FIELDS = {"shape", "links", "planes", "requests", "bytes", "wall_s", "gbps", "requests_per_s", "latency_p50_ms",
          "latency_p99_ms", "link_ms_median", "messages_per_request", "checked", "byte_failures", "bad_blocks",
          "transfer_errors", "processes"}


def _bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "cluster.json"
    result = subprocess.run([sys.executable, "-m", "aiodatadist_benchmarks.bench.cluster", *SMALL, *args, "--json",
                             str(out)], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, json.loads(out.read_text())


def _check_run(run: dict[str, Any], prompts: int, decoders: int) -> None:
    assert FIELDS <= set(run)
    assert run["shape"] == f"{prompts}x{decoders}"
    assert run["links"] == prompts * decoders
    assert run["requests"] > 0 and run["bytes"] > 0 and run["gbps"] > 0
    assert run["checked"] == run["requests"] + prompts * decoders  # the timed requests and one warm-up per link
    assert run["byte_failures"] == run["bad_blocks"] == 0 and run["transfer_errors"] == {}
    assert len(run["processes"]) == prompts + decoders


def test_checker_flags_a_flipped_byte() -> None:
    blocks, words = 8, 64
    stream = pattern_stream(7, 1, 2, blocks, words)
    assert np.all(stream.view(np.uint8) != 0)
    view = np.zeros((blocks, words), dtype=np.uint64)
    fill_blocks(view, stream, blocks)  # tensor 1 of the prompt
    windows = [blocks + b for b in range(blocks)]
    assert bad_blocks(view, list(range(blocks)), stream, windows) == 0
    view.view(np.uint8).reshape(blocks, -1)[5, 77] ^= 0x10
    assert bad_blocks(view, list(range(blocks)), stream, windows) == 1
    assert bad_blocks(view, [0, 1], stream, [blocks + 1, blocks]) == 2  # blocks landed swapped
    assert bad_blocks(view, [0], stream, [0]) == 1  # tensor 0's block, not tensor 1's


def test_cluster_1x1_and_2x2_check_every_transfer(tmp_path: Path) -> None:
    result, report = _bench(tmp_path, "--prompts", "2", "--decoders", "2", "--baseline")
    single, cluster = report["runs"]
    _check_run(single, 1, 1)
    _check_run(cluster, 2, 2)
    assert report["ratio_vs_single_pair"] == pytest.approx(cluster["gbps"] / single["gbps"])
    assert report["memory_bandwidth_gbps"] > 0
    assert "aggregate 2x2 / single pair 1x1" in result.stdout


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True, check=False).returncode != 0:
        return "ip netns is not available here"
    return None


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@pytest.mark.skipif(_netns_usable() is not None, reason=_netns_usable() or "")
def test_cluster_in_network_namespaces_uses_tcp_and_cleans_up(tmp_path: Path) -> None:
    before = _namespaces()
    _, report = _bench(tmp_path, "--prompts", "1", "--decoders", "2", "--netns")
    (run,) = report["runs"]
    _check_run(run, 1, 2)
    assert run["planes"] == ["tcp"] and run["options"]["transport"] == "tcp"
    assert _namespaces() == before
