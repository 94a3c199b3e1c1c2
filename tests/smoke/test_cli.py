"""The command line and the examples run end to end (real processes) and report success; ``bench`` and ``soak``
forward to the benchmarks distribution, whose own tests run them (``benchmarks/tests/``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False, timeout=timeout,
                          cwd=ROOT)


def test_demo_moves_and_verifies_every_byte() -> None:
    result = run("-m", "aiodatadist", "demo", "--requests", "8", "--blocks-per-request", "4", "--num-blocks", "64")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verified every byte: OK" in result.stdout
    assert "GB/s" in result.stdout and "p99" in result.stdout


def test_info() -> None:
    result = run("-m", "aiodatadist", "info")
    assert result.returncode == 0 and "aiodatadist" in result.stdout


def test_the_console_script_is_the_command_line() -> None:
    script = Path(sys.executable).parent / "aiodatadist"
    if not script.exists():
        pytest.skip("the package's console script is not installed beside this interpreter")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: python -m aiodatadist {demo,bench,soak,info}")


# -- bench and soak: forwarded to the benchmarks distribution ------------------------------------------------
# Runs ``python -m aiodatadist ARGS`` in an interpreter where the benchmarks cannot be imported: a finder first
# on sys.meta_path refuses them, as an interpreter without them installed would.
WITHOUT_BENCHMARKS = """
import runpy, sys

class NoBenchmarks:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "aiodatadist_benchmarks":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoBenchmarks())
sys.argv = ["aiodatadist", *sys.argv[1:]]
runpy.run_module("aiodatadist", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("command", ["bench", "soak"])
def test_bench_and_soak_forward_to_the_benchmarks(command: str) -> None:
    pytest.importorskip("aiodatadist_benchmarks",
                    reason="the benchmarks are not installed (pip install -e ./benchmarks)")
    result = run("-m", "aiodatadist", command, "--help")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"usage: python -m aiodatadist {command}")


@pytest.mark.parametrize("command", ["bench", "soak"])
def test_bench_and_soak_say_how_to_install_the_benchmarks_without_them(command: str) -> None:
    result = run("-c", WITHOUT_BENCHMARKS, command, "--help")
    assert result.returncode == 2, result.stdout + result.stderr
    assert not result.stdout
    assert result.stderr.startswith(f"python -m aiodatadist {command}: not installed here: ")
    assert "pip install -e ./benchmarks" in result.stderr and "Traceback" not in result.stderr
    result = run("-c", WITHOUT_BENCHMARKS, "info")  # the library's own commands do not need them
    assert result.returncode == 0 and "aiodatadist" in result.stdout
    result = run("-c", WITHOUT_BENCHMARKS, "--help")
    assert result.returncode == 0 and "pip install -e ./benchmarks" in result.stdout


@pytest.mark.parametrize("example", ["serving_pair.py", "push_blocks.py", "switch_role.py"])
def test_example_runs(example: str) -> None:
    result = run(str(ROOT / "examples" / example), timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout


def test_native_helper_is_built_where_a_compiler_exists() -> None:
    """The C helper (native pool, span copier) must be in use wherever it can be built: a silent fallback to the
    Python executor would leave it untested (install with ``pip install -e .`` to build it in place)."""
    import shutil

    from aiodatadist.native import native_available

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the Python fallback is expected")
    assert native_available()
