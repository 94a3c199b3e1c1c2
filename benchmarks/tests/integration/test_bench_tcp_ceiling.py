"""The TCP ceiling of the ``tcp`` rows (:mod:`aiodatadist_benchmarks.bench.tcp_ceiling`): the native program moves
the bytes over the connections asked for and times each round, read in turn with a workload or in a row; without
a C compiler the Python fallback does, named as such."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from aiodatadist_benchmarks.bench.tcp_ceiling import TcpCeiling, compiled_ceiling, tcp_ceiling_gbps

MIB = 1 << 20
needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


@needs_cc
@pytest.mark.parametrize("connections", [1, 3])
def test_the_native_ceiling_moves_the_bytes_over_the_connections_asked_for(connections: int) -> None:
    with TcpCeiling.start(16 * MIB + 5, connections, None) as ceiling:  # (not a multiple of the connections)
        assert ceiling.native and ceiling.nbytes == 16 * MIB + 5
        assert ceiling.name == f"native TCP 16 MiB, {connections} connection{'s' if connections > 1 else ''}"
        assert all(ceiling.seconds() > 0 for _ in range(3))  # a round per call, the bytes checked in each


@needs_cc
def test_the_native_program_prints_one_time_per_round_and_refuses_bad_arguments() -> None:
    binary = compiled_ceiling()
    assert binary is not None and compiled_ceiling() == binary  # built once per process
    done = subprocess.run([binary, str(4 * MIB), "2", "4", "-"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) == 4 and all(float(s) > 0 for s in done.stdout.split())
    interactive = subprocess.run([binary, str(4 * MIB), "2", "0", "-"], input="g\ng\n", capture_output=True,
                                 text=True, timeout=60, check=False)
    assert interactive.returncode == 0, interactive.stderr
    assert interactive.stdout.split()[0] == "ready" and len(interactive.stdout.split()) == 3
    for bad in (["1", "2", "1"], [str(MIB), "0", "1"], [str(MIB), "2", "-1"]):
        refused = subprocess.run([binary, *bad], capture_output=True, text=True, timeout=60, check=False)
        assert refused.returncode == 2 and "tcp_ceiling" in refused.stderr


@needs_cc
def test_the_native_ceiling_sets_the_congestion_control_asked_for() -> None:
    name, gbps = tcp_ceiling_gbps(4 * MIB, 2, 2, "reno")  # reno is open to every process
    assert name == "native TCP 4 MiB, 2 connections" and gbps > 0
    with pytest.raises(RuntimeError, match="TCP_CONGESTION"):
        TcpCeiling.start(4 * MIB, 2, "no-such-algorithm")


def test_without_a_compiler_the_fallback_measures_and_says_so() -> None:
    code = ("from aiodatadist_benchmarks.bench.tcp_ceiling import tcp_ceiling_gbps\n"
            "name, gbps = tcp_ceiling_gbps(8 << 20, 2, 2, None, print)\n"
            "print(gbps > 0, name)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "CC": "/nonexistent/cc"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("no C compiler (cc, or $CC) to build the native TCP ceiling")
    assert lines[-1] == "True Python TCP 8 MiB, 2 connections (fallback: no C compiler, not the ceiling)"
