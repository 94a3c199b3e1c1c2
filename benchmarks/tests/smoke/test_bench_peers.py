"""The NIXL peer benchmark runs end to end (real prompt and decoder processes) and reports sane figures.

Skipped when NIXL is not installed (``pip install 'aiodatadist[nixl]'``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from aiodatadist_benchmarks.bench.peers import VARIANTS, WORKLOADS, nixl_available, run_nixl

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install 'aiodatadist[nixl]')")

MIB = 1 << 20


def check_results(results: list[dict[str, Any]], variant: str) -> None:
    assert [r["workload"] for r in results] == list(WORKLOADS)
    assert all(r["library"] == variant for r in results)
    paged, whole, small = results
    for r in (paged, whole):
        assert r["bytes"] == 256 * MIB
        assert math.isfinite(r["gbps"]) and r["gbps"] > 0
    assert small["bytes"] == 2 * MIB
    assert small["runs"] == 200
    assert 0 < small["p50_ms"] <= small["p99_ms"] < 10_000


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_workload_runs_and_verifies(variant: str) -> None:
    lines: list[str] = []
    results = run_nixl(set(WORKLOADS), 1, variant, lines.append)  # raises if the paged bytes are wrong
    check_results(results, variant)
    assert f"{variant}: paged 1/1" in lines and f"{variant}: small 200/200" in lines


def test_available_and_bad_arguments_rejected() -> None:
    assert nixl_available()
    with pytest.raises(ValueError):
        run_nixl({"concurrent"}, 1, "nixl-ucx")
    with pytest.raises(ValueError):
        run_nixl({"small"}, 1, "nixl-rdma")
