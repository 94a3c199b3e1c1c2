#!/usr/bin/env bash
# The NPU checks in one run, on an Ascend machine (CANN 8.5 or 9.x installed, one NPU free; < 6 minutes): install
# the package and the benchmarks into the machine's Python from the checkout (wheels the core lacks there come
# from $WHEELS, as for scripts/gpu_checks.sh), then
#   1. `aiodatadist info` (the runtime must read "ACL", with the CANN version),
#   2. the DEVICE tests on the real ACL runtime (AIODATADIST_REAL_NPU=1: the device_runtime fixture then uses the
#      NPU, not the emulated runtime; the CUDA half runs on the emulated GPU), and the vllm-ascend flow test,
#   3. the NPU bench: aiodatadist's copy_blocks and swap_blocks against aclrtMemcpy of the same bytes, same run.
# What to look at first (docs/design.md, "Ascend NPUs through ACL"): failures in test_device_caches.py's IPC tests
# (the alignment and whitelist rules), in the fault tests (what aclrtStreamQuery returns after a failed copy), and
# the bench's "8192 x 32 KiB" rows (the cost of one aclrtMemcpyAsync per span).
# Usage: bash scripts/npu_checks.sh [OUTDIR]   (results: OUTDIR/env.txt, npu-tests.txt, npu-bench.txt)
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-/tmp/npu-checks}}
WHEELS=${WHEELS:-.gpuwheels}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
if [ -f "${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit/latest}/../set_env.sh" ] && [ -z "${ASCEND_HOME_PATH:-}" ]; then
  # shellcheck disable=SC1091
  source "${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit/latest}/../set_env.sh"
fi
{
  command -v npu-smi >/dev/null && npu-smi info | head -20
  $PY --version
  echo "ASCEND_HOME_PATH=${ASCEND_HOME_PATH:-}"
} > "$OUTDIR/env.txt" 2>&1
if [ -d "$WHEELS" ]; then
  $PY -m pip install -q --no-index --find-links "$WHEELS" pyzmq pytest-asyncio pytest-timeout >> "$OUTDIR/env.txt" 2>&1
fi
PER_TEST=()
if $PY -c "import pytest_timeout" 2>/dev/null; then PER_TEST=(--timeout 100); fi
$PY -m pip install -q --no-build-isolation --no-deps -e . -e ./benchmarks >> "$OUTDIR/env.txt" 2>&1
AIODATADIST_DEVICE_RUNTIME=acl $PY -m aiodatadist info >> "$OUTDIR/env.txt" 2>&1
AIODATADIST_REAL_NPU=1 timeout 240 $PY -m pytest -q -p no:cacheprovider -rs ${PER_TEST[@]+"${PER_TEST[@]}"} \
  tests/gpu/test_device_caches.py tests/gpu/test_device_over_tcp.py tests/gpu/test_npu_flow.py tests/unit/acl \
  > "$OUTDIR/npu-tests.txt" 2>&1
echo "pytest rc=$?" >> "$OUTDIR/npu-tests.txt"
AIODATADIST_DEVICE_RUNTIME=acl timeout 120 $PY -m aiodatadist_benchmarks.bench.npu --repeat 9 \
  > "$OUTDIR/npu-bench.txt" 2>&1
echo "bench rc=$?" >> "$OUTDIR/npu-bench.txt"
grep -i "ACL\|Device runtime" "$OUTDIR/env.txt"
tail -n 30 "$OUTDIR/npu-tests.txt"
cat "$OUTDIR/npu-bench.txt"
