#!/usr/bin/env bash
# The tests that need torch and transformers (skipped elsewhere), in a venv of their own (.venv-engines):
# tests/unit/test_torch.py, tests/integration/test_host_memory.py and examples/transformers_pd.py (float32, bf16).
# Usage: bash tools/engine_tests.sh [pytest args]
# torch is pinned to 2.13.0 (a CPU build on this machine's disk, /opt/wheels): the constraint keeps pip from
# picking any other torch for transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-engines}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"
"$VENV/bin/pip" install -q -c "$CONSTRAINTS" -e '.[test]' 'torch==2.13.0' transformers
"$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/unit/test_torch.py tests/integration/test_host_memory.py \
  tests/smoke/test_transformers_example.py "$@"
