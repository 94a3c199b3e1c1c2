#!/usr/bin/env bash
# Regenerate aiodatadist/cuda/copy_kernel.ptx from copy_kernel.cu (needs nvcc and ptxas; the package itself
# needs neither: the driver JIT-compiles the shipped PTX for whatever GPU it runs on).
#
#   scripts/gen_ptx.sh            # NVCC=/path/to/nvcc PTXAS=/path/to/ptxas to choose the tools
#
# Target: compute_75 (Turing), the oldest architecture current toolkits (CUDA 13) still compile for; the JIT
# turns it into code for sm_75 and every later GPU (A100 sm_80, H100 sm_90, ...).
#
# PTX ISA version: nvcc writes the newest ISA it knows (".version 9.0" for CUDA 13.0), and a driver refuses
# to load PTX whose ISA is newer than its own JIT compiler ("CUDA_ERROR_UNSUPPORTED_PTX_VERSION").  The kernel
# uses nothing newer than plain loads/stores with cache hints, so the directive is lowered to PTX_VERSION:
# 6.3, the lowest that accepts ".target sm_75" (ptxas: "PTX .version 6.2 does not support .target sm_75";
# 6.3 is CUDA 10.0), so any driver recent enough to know a Turing or later GPU can JIT it.  The script
# checks that ptxas assembles the lowered file for sm_75, sm_80 and sm_90 and fails otherwise (raise
# PTX_VERSION if a change of the kernel needs newer instructions).
set -euo pipefail

PTX_VERSION=6.3
ARCH=compute_75
here="$(cd "$(dirname "$0")/.." && pwd)"
src="$here/aiodatadist/cuda/copy_kernel.cu"
out="$here/aiodatadist/cuda/copy_kernel.ptx"
NVCC="${NVCC:-nvcc}"
PTXAS="${PTXAS:-ptxas}"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

"$NVCC" -ptx -arch="$ARCH" -O3 "$src" -o "$tmp/copy_kernel.ptx"
sed -i -E "s/^\.version [0-9]+\.[0-9]+$/.version $PTX_VERSION/" "$tmp/copy_kernel.ptx"
grep -qx ".version $PTX_VERSION" "$tmp/copy_kernel.ptx" || { echo "no .version directive in nvcc's output" >&2; exit 1; }
grep -q "^\.visible \.entry adt_copy_spans(" "$tmp/copy_kernel.ptx" || { echo "entry adt_copy_spans missing" >&2; exit 1; }
for sm in 75 80 90; do
    "$PTXAS" -arch="sm_$sm" "$tmp/copy_kernel.ptx" -o /dev/null
done
mv "$tmp/copy_kernel.ptx" "$out"
echo "wrote $out (PTX ISA $PTX_VERSION, $ARCH; ptxas ok for sm_75 sm_80 sm_90)"
