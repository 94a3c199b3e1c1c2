"""Long fuzzing runs: the data-frame fuzzer (tests/integration/test_data_frames_fuzz.py) and the control-plane
fuzzer of tests/integration/test_hostile.py, round after round with a fresh random seed, for N minutes.

    .venv/bin/python scripts/fuzz_long.py --minutes 30                 # both fuzzers, random seeds
    .venv/bin/python scripts/fuzz_long.py --minutes 5 --scale 5        # 5x the seeded mutations per round
    .venv/bin/python scripts/fuzz_long.py --seed 1234 --rounds 1       # one round, a given seed (to reproduce)
    .venv/bin/python scripts/fuzz_long.py --minutes 10 --no-control    # the data-frame fuzzer only

Each round runs the data-frame fuzzer with ``AIODATADIST_FUZZ_SEED`` (its cases) and ``AIODATADIST_FUZZ_SCALE``
(how many seeded mutations), then the control-plane fuzzer with ``AIODATADIST_FUZZ_EXAMPLES`` (hypothesis'
``max_examples``) and ``--hypothesis-seed``.  The first failing round stops the run: its seed and the command that
reproduces it are printed, and the exit status is 1.  Under the sanitizers: ``AIODATADIST_FUZZ_SCALE=10 bash
scripts/sanitize.sh tests/integration/test_data_frames_fuzz.py`` (the environment goes through).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = "tests/integration/test_data_frames_fuzz.py"
CONTROL = "tests/integration/test_hostile.py::test_the_control_plane_survives_anything"
SUMMARY = re.compile(r"data-frame fuzz \[(\w+), (\w+)\] seed=\d+: (.*), total=(\d+)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="stop starting rounds after this long")
    parser.add_argument("--rounds", type=int, default=0, help="at most this many rounds (0: as many as fit)")
    parser.add_argument("--seed", type=int, default=0, help="the first round's seed (default: random)")
    parser.add_argument("--scale", type=float, default=4.0, help="seeded mutations per round, x the test's 200")
    parser.add_argument("--examples", type=int, default=600, help="hypothesis examples of the control-plane fuzzer")
    parser.add_argument("--no-control", action="store_true", help="skip the control-plane fuzzer")
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"), help="the interpreter")
    parser.add_argument("--round-timeout", type=float, default=1800.0, help="seconds one pytest run may take")
    args = parser.parse_args()

    deadline = time.monotonic() + 60 * args.minutes
    frames: Counter[str] = Counter()
    rounds = 0
    seed = args.seed or secrets.randbits(31) + 1
    while (not args.rounds or rounds < args.rounds) and (rounds == 0 or time.monotonic() < deadline):
        rounds += 1
        env = {**os.environ, "AIODATADIST_FUZZ_SEED": str(seed), "AIODATADIST_FUZZ_SCALE": str(args.scale),
               "AIODATADIST_FUZZ_EXAMPLES": str(args.examples)}
        runs = [[DATA]]
        if not args.no_control:
            runs.append([CONTROL, f"--hypothesis-seed={seed}"])
        for target in runs:
            command = [args.python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-s", *target]
            started = time.monotonic()
            try:
                done = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                                      timeout=args.round_timeout)
                output, code = done.stdout + done.stderr, done.returncode
            except subprocess.TimeoutExpired as exc:
                output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
                code = -1
            for match in SUMMARY.finditer(output):
                frames[f"{match[1]}/{match[2]}"] += int(match[4])
            took = time.monotonic() - started
            print(f"round {rounds} seed={seed} {target[0].split('/')[-1]}: "
                  f"{'ok' if code == 0 else 'FAILED'} in {took:.0f} s", flush=True)
            if code != 0:
                print(output[-6000:])
                variables = " ".join(f"{k}={shlex.quote(env[k])}" for k in
                                     ("AIODATADIST_FUZZ_SEED", "AIODATADIST_FUZZ_SCALE", "AIODATADIST_FUZZ_EXAMPLES"))
                print(f"\nreproduce: cd {ROOT} && {variables} {shlex.join(command)}")
                return 1
        seed = secrets.randbits(31) + 1
    print(f"{rounds} round(s), no failure; data frames tried: "
          + (", ".join(f"{k}={n}" for k, n in sorted(frames.items())) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
