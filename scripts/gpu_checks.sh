#!/usr/bin/env bash
# The GPU checks in one run (< 8 minutes on an H100, start-up included; each section has its own time limit):
# install the package and the benchmarks (benchmarks/) into the machine's Python, both from the checkout and
# offline (wheels the core lacks there come from $WHEELS, NIXL's too), run tests/gpu, then `bench --device`
# (device caches through CUDA IPC), `bench --device --transport tcp` (staged through page-locked memory over a TCP
# link, against the host-memory TCP plane), and raw NIXL on VRAM at its fair settings (READ and WRITE, scattered
# 32 KiB blocks and contiguous 64 MiB ones; skipped with the reason if NIXL will not load).
# Usage: bash scripts/gpu_checks.sh [OUTDIR]   (results: OUTDIR/gpu-tests.txt, bench-device*.txt, nixl-vram.txt)
# The lent machines have no network and no pyzmq; fetch the wheels first, on a machine with one, into the
# (git-ignored) folder the device tool carries:
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --no-deps \
#       -d .gpuwheels pyzmq==27.3.0 pytest-asyncio==1.5.0 pytest-timeout nixl-cu13
# then, with the device tool: run(command="bash scripts/gpu_checks.sh $OUT", carry=[".gpuwheels"], timeout_s=420)
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-/tmp/gpu-checks}}
WHEELS=${WHEELS:-.gpuwheels}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY --version
} > "$OUTDIR/env.txt" 2>&1
if [ -d "$WHEELS" ]; then
  $PY -m pip install -q --no-index --find-links "$WHEELS" pyzmq pytest-asyncio >> "$OUTDIR/env.txt" 2>&1
  $PY -m pip install -q --no-index --find-links "$WHEELS" pytest-timeout >> "$OUTDIR/env.txt" 2>&1
  $PY -m pip install -q --no-index --no-deps --find-links "$WHEELS" nixl-cu13 >> "$OUTDIR/env.txt" 2>&1
fi
# A hung test must not eat the machine's time; pytest-timeout is optional there.
PER_TEST=()
if $PY -c "import pytest_timeout" 2>/dev/null; then PER_TEST=(--timeout 100); fi
$PY -m pip install -q --no-build-isolation --no-deps -e . -e ./benchmarks >> "$OUTDIR/env.txt" 2>&1
$PY -m aiodatadist info >> "$OUTDIR/env.txt" 2>&1
timeout 180 $PY -m pytest -q -p no:cacheprovider -rs ${PER_TEST[@]+"${PER_TEST[@]}"} --ignore=tests/gpu/test_torch_over_tcp.py tests/gpu tests/unit/copy/test_device_cpu.py \
  tests/unit/cuda/test_cuda_cpu.py tests/integration/test_device_refused.py tests/unit/api/test_torch.py \
  > "$OUTDIR/gpu-tests.txt" 2>&1
echo "pytest rc=$?" >> "$OUTDIR/gpu-tests.txt"
timeout 100 $PY -m aiodatadist bench --device --repeat 9 --json "$OUTDIR/bench-device.json" \
  > "$OUTDIR/bench-device.txt" 2>&1
echo "bench rc=$?" >> "$OUTDIR/bench-device.txt"
timeout 60 $PY -m aiodatadist bench --device --transport tcp --repeat 5 --json "$OUTDIR/bench-device-tcp.json" \
  > "$OUTDIR/bench-device-tcp.txt" 2>&1
echo "bench tcp rc=$?" >> "$OUTDIR/bench-device-tcp.txt"
# An engine's CUDA KV (torch tensors, aiodatadist.torch) between two processes over TCP, blocking API: its figure.
timeout 40 $PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_torch_over_tcp.py > "$OUTDIR/torch-over-tcp.txt" 2>&1
echo "torch over tcp rc=$?" >> "$OUTDIR/torch-over-tcp.txt"
NIXL_LOADS='from aiodatadist.transport.nixl import load_nixl; load_nixl()'  # nixl, nixl-cu12 or nixl-cu13
if $PY -c "$NIXL_LOADS" 2>/dev/null; then
  timeout 60 $PY -m aiodatadist_benchmarks.bench.nixl_vram --repeat 5 > "$OUTDIR/nixl-vram.txt" 2> "$OUTDIR/nixl-vram-ucx.txt"
  echo "nixl rc=$?" >> "$OUTDIR/nixl-vram.txt"
  grep -i "proto\|rndv\|zcopy" "$OUTDIR/nixl-vram-ucx.txt" | sort | uniq -c | head -20 >> "$OUTDIR/nixl-vram.txt"
else
  echo "raw NIXL skipped: $($PY -c "$NIXL_LOADS" 2>&1 | tail -1)" > "$OUTDIR/nixl-vram.txt"
fi
tail -n 30 "$OUTDIR/gpu-tests.txt"
cat "$OUTDIR/bench-device.txt" "$OUTDIR/bench-device-tcp.txt" "$OUTDIR/nixl-vram.txt"
grep -h "GB/s\|passed\|failed\|rc=" "$OUTDIR/torch-over-tcp.txt"
