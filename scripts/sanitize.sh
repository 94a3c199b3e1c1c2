#!/usr/bin/env bash
# The native helpers (aiodatadist/native/src/*.c, aiodatadist/layout/_blocks.c) under AddressSanitizer and
# UndefinedBehaviorSanitizer, against the tests that drive them: copies, frames, fences, TCP links, cancellation,
# the data-frame fuzzer and the hostile-peer tests.
#
# Nothing in the source tree is touched: the package and the tests are copied into a temporary folder, the
# sanitized extensions are built there, and pytest runs from there with that copy first on the path (PYTHONPATH
# too, so that peer processes the tests start load the sanitized build as well).  The run checks that the
# sanitized .so files are the ones loaded (a pytest plugin written below asserts it in the test process), and
# fails on any sanitizer report in the output, whatever pytest's exit status.
#
# Usage: bash scripts/sanitize.sh [pytest args...]   (default: the test files listed below)
# Environment: PYTHON (default .venv/bin/python), CC (default gcc), KEEP=1 keeps the temporary folder,
# SANITIZE_TIMEOUT (seconds, default 1500).  Python leaks by design: leak detection is off.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-$ROOT/.venv/bin/python}
CC=${CC:-gcc}
START=$(date +%s)

LIBASAN=$($CC -print-file-name=libasan.so)
if [ ! -e "$LIBASAN" ]; then
  echo "sanitize: $CC has no libasan.so ($LIBASAN)" >&2
  exit 2
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/aiodatadist-sanitize.XXXXXX")
cleanup() { if [ "${KEEP:-0}" = 1 ]; then echo "sanitize: kept $WORK"; else rm -rf "$WORK"; fi; }
trap cleanup EXIT

# The working tree as it is (untracked files too), without built extensions, caches or the venv.
mkdir -p "$WORK/src"
tar -C "$ROOT" --exclude='*.so' --exclude='__pycache__' --exclude='*.pyc' -cf - aiodatadist tests pyproject.toml \
  | tar -C "$WORK/src" -xf - || { echo "sanitize: copying the tree failed" >&2; exit 2; }

read -r INCLUDE SUFFIX < <("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"], sysconfig.get_config_var("EXT_SUFFIX"))')
# -O1 -g: readable reports; no -fwrapv (Python's own flags have it): signed overflow is reported too.
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
FLAGS="-O1 -g -fPIC -shared -pthread -Wall $SAN -I$INCLUDE"
NATIVE_SO="$WORK/src/aiodatadist/native/_native$SUFFIX"
BLOCKS_SO="$WORK/src/aiodatadist/layout/_blocks$SUFFIX"
set -e
$CC $FLAGS -o "$NATIVE_SO" "$WORK"/src/aiodatadist/native/src/*.c
$CC $FLAGS -o "$BLOCKS_SO" "$WORK/src/aiodatadist/layout/_blocks.c"
set +e
for so in "$NATIVE_SO" "$BLOCKS_SO"; do
  SYMBOLS=$(nm -D "$so")
  if ! grep -q '__asan_init' <<< "$SYMBOLS" || ! grep -q '__ubsan_handle' <<< "$SYMBOLS"; then
    echo "sanitize: $so is not instrumented" >&2
    exit 2
  fi
done

# Asserted in the test process itself, before any test: the copy's package, both sanitized extensions loaded
# (mapped from the temporary folder, with the ASan runtime in the process), the native helper in use.
cat > "$WORK/_sanitized_build.py" <<EOF
import os

import pytest


def pytest_configure(config):
    import aiodatadist
    import aiodatadist.layout._blocks as blocks
    from aiodatadist import native
    from aiodatadist.native import _native

    want = {"$NATIVE_SO", "$BLOCKS_SO"}
    got = {os.path.realpath(_native.__file__), os.path.realpath(blocks.__file__)}
    maps = open("/proc/self/maps").read()
    problems = []
    if not os.path.realpath(aiodatadist.__file__).startswith("$WORK/src/"):
        problems.append(f"aiodatadist imported from {aiodatadist.__file__}")
    if got != want:
        problems.append(f"extensions loaded from {sorted(got)}")
    if native.native_pool() is None or os.path.realpath(native.native_pool()._name) != "$NATIVE_SO":
        problems.append("the native helper (ctypes) is not the sanitized build")
    if "libasan" not in maps or any(path not in maps for path in want):
        problems.append("the sanitized libraries are not mapped")
    if problems:
        raise pytest.UsageError("sanitize: " + "; ".join(problems))
    print(f"\nsanitize: running against {sorted(want)}")
EOF

if [ $# -gt 0 ]; then
  TESTS=("$@")
else
  TESTS=(tests/unit/native/test_native_build.py tests/unit/native/test_native_bindings.py tests/unit/native/test_net_frames.py
         tests/unit/native/test_net_fence.py tests/unit/cuda/test_cuda_cpu.py tests/gpu/test_device_ops.py
         tests/unit/native/test_frames_spans.py tests/unit/copy/test_executors.py tests/unit/copy/test_inline_copy.py
         tests/unit/native/test_stream_copy_limit.py tests/unit/native/test_stream_lanes.py tests/unit/native/test_stream_stores.py
         tests/unit/copy/test_covering_reads.py tests/unit/layout/test_layout.py tests/unit/transfer/test_index_lists.py
         tests/integration/test_tcp_congestion_links.py tests/integration/test_tcp_fence.py
         tests/integration/test_tcp_mixed_concurrency.py tests/integration/test_tcp_one_sided_push.py
         tests/integration/test_tcp_polled_waits.py tests/integration/test_cancellation.py
         tests/integration/test_data_frames_fuzz.py tests/integration/test_hostile.py
         tests/gpu/test_device_over_tcp.py tests/gpu/test_npu_flow.py)
fi

# (a child under glibc's malloc checks preloads that library instead: ASan, which checks more, cannot run there;
# nvcc, which one test runs where it is installed, crashes with the ASan runtime preloaded)
DESELECT=(--deselect tests/unit/copy/test_executors.py::test_tcp_frame_planning_stays_inside_its_buffers
          --deselect tests/unit/cuda/test_cuda_cpu.py::test_shipped_ptx_matches_the_source)

LOG="$WORK/sanitize.log"
# Reports go to files (one per process: peer processes the tests start report there too, whatever the test does
# with their output), and are read back below.
mkdir -p "$WORK/reports"
cd "$WORK/src"
env LD_PRELOAD="$LIBASAN" \
  ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:print_summary=1:log_path=$WORK/reports/asan" \
  UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:print_summary=1:log_path=$WORK/reports/ubsan" \
  PYTHONPATH="$WORK/src:$WORK${PYTHONPATH:+:$PYTHONPATH}" PYTHONFAULTHANDLER=1 \
  timeout "${SANITIZE_TIMEOUT:-1500}" "$PY" -m pytest -x -q -p no:cacheprovider -p _sanitized_build -s "${DESELECT[@]}" "${TESTS[@]}" \
  > "$LOG" 2>&1
RC=$?
cd "$ROOT"
for report in "$WORK"/reports/*; do
  [ -e "$report" ] && { echo "==> $(basename "$report")"; cat "$report"; } >> "$LOG"
done
grep -E 'data-frame fuzz' "$LOG"
tail -n 25 "$LOG" | grep -v '^sanitize: running against'
REPORTS=$(grep -cE 'ERROR: AddressSanitizer|runtime error:|SUMMARY: (AddressSanitizer|UndefinedBehaviorSanitizer)' "$LOG")
LOADED=$(grep -c '^sanitize: running against' "$LOG")
echo "sanitize: pytest exit $RC, $REPORTS sanitizer report line(s), sanitized build confirmed loaded: $LOADED," \
  "$(( $(date +%s) - START )) s"
FAIL=0
if [ "$REPORTS" -gt 0 ]; then
  grep -nE -A40 'ERROR: AddressSanitizer|runtime error:' "$LOG" | head -n 200
  FAIL=1
fi
if [ "$LOADED" -eq 0 ]; then
  echo "sanitize: the test process did not confirm that it loaded the sanitized build" >&2
  FAIL=1
fi
if [ "$RC" -ne 0 ] || [ "$FAIL" -ne 0 ]; then
  cp "$LOG" "${TMPDIR:-/tmp}/aiodatadist-sanitize-last.log" && echo "sanitize: log kept in ${TMPDIR:-/tmp}/aiodatadist-sanitize-last.log"
  exit 1
fi
echo "sanitize: clean"
