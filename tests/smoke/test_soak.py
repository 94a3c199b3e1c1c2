"""``python -m aiodatadist soak`` runs briefly over each transport (real processes): every completed transfer is
byte-exact, no call outlives its deadline by more than 100 ms, memory stays flat, and the cancellation paths
(own ``asyncio.timeout`` and task cancellation) were exercised."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_soak_verifies_every_transfer(tmp_path: Path, transport: str) -> None:
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, "-m", "aiodatadist", "soak", "--seconds", "8", "--concurrency", "8", "--transport",
         transport, "--json", str(out)],
        check=False, capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())
    assert figures["plane"] == transport
    assert figures["corrupted"] == 0
    assert figures["done_total"] > 50
    assert set(figures["done"]) == {"pull_blocks", "pull_cache", "push_blocks", "push_cache"}
    assert figures["modes"]["timeout"] > 0 and figures["modes"]["cancel"] > 0
    assert figures["failures"].get("CANCELLED", 0) + figures["failures"].get("LLM_TIMEOUT", 0) > 0
    assert figures["late_over_100ms"] == 0
    assert "result             PASS" in result.stdout
