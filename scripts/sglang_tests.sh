#!/usr/bin/env bash
# SGLang checks on a CPU machine: the SGLang tests (pytest tests/sglang: P/D through SGLang's router with
# --disaggregation-transfer-backend aiodatadist against a single engine), then, with --bench, `bench sglang`.
# Usage: bash scripts/sglang_tests.sh [--bench [BENCH OPTIONS...]]   e.g.  bash scripts/sglang_tests.sh --bench --rounds 2
# Builds the venv $VENV (default: sglang-venv next to this repository, ~11 GB) step by step, each step only when
# it is missing: sglang==0.5.23 (CUDA builds of torch and sgl-kernel), NIXL 1.5.1 for the comparison, the PD
# router, this package and its benchmarks (editable, no dependencies: SGLang's torch stays), and the CPU shim of
# sgl_kernel.
# The shim: a copy of sgl_kernel's Python files without its compiled ops, whose loaders return an empty module and
# load no CUDA library (importing SGLang otherwise fails without libcuda.so.1; a Llama on CPU calls none of them).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${VENV:-$(dirname "$REPO")/sglang-venv}
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)
SHIM="$VENV/sgl_kernel_shim"

has() { "$PY" - "$@" <<'EOF' >/dev/null 2>&1
import importlib.util, sys
sys.exit(0 if all(importlib.util.find_spec(m) for m in sys.argv[1:]) else 1)
EOF
}

set -e
if [ ! -x "$PY" ]; then
  echo "creating $VENV" >&2
  python3 -m venv "$VENV"
fi
if ! "$PY" -m pip show -q sglang >/dev/null 2>&1; then
  echo "installing sglang==0.5.23 (a few minutes)" >&2
  "${PIP[@]}" sglang==0.5.23
fi
if ! has nixl._api; then
  "${PIP[@]}" nixl-cu13==1.5.1
  "${PIP[@]}" --no-deps nixl==1.5.1
fi
has sglang_router || "${PIP[@]}" sglang-router==0.3.2
has pytest pytest_asyncio hypothesis msgpack zmq || "${PIP[@]}" pytest pytest-asyncio hypothesis msgpack pyzmq numpy
# Always: refreshes the entry points (sglang.srt.plugins) from pyproject.toml.
"${PIP[@]}" --no-deps -e "$REPO" -e "$REPO/benchmarks"
if [ ! -f "$SHIM/sgl_kernel/load_utils.py" ]; then
  echo "building the sgl_kernel CPU shim in $SHIM" >&2
  "$PY" - "$SHIM" <<'EOF'
import pathlib, shutil, sys, importlib.util
source = pathlib.Path(importlib.util.find_spec("sgl_kernel").origin).parent
target = pathlib.Path(sys.argv[1]) / "sgl_kernel"
shutil.rmtree(target, ignore_errors=True)
for path in source.rglob("*.py"):
    destination = target / path.relative_to(source)
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, destination)
with open(target / "load_utils.py", "a") as out:
    out.write("\n\n# CPU shim (aiodatadist scripts/sglang_tests.sh): no compiled ops, no CUDA library\n"
              "def _load_architecture_specific_ops():  # noqa: F811\n"
              "    import types\n\n    return types.ModuleType('common_ops')\n\n\n"
              "def _preload_cuda_library():  # noqa: F811\n    return None\n")
EOF
fi
set +e

# Processes of this script (tests, servers) see the shim first; SGLang runs on the CPU engine, offline.
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}" SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PY" -m pytest -q -p no:cacheprovider tests/sglang  # the unit tests (no SGLang needed) and the sglang ones
tests_rc=$?
echo "pytest rc=$tests_rc"
if [ "${1:-}" = "--bench" ]; then
  shift
  "$PY" -m aiodatadist bench sglang "$@"
  bench_rc=$?
  echo "bench sglang rc=$bench_rc"
  [ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
else
  [ "$tests_rc" -eq 0 ]
fi
