"""examples/transformers_pd.py: a prompt and a decoder process move a random Llama's KV cache with aiodatadist,
and the decoder's 32 greedy tokens equal a single-process ``generate``, in float32 and bfloat16.

Skipped without torch or transformers (the README test command installs both)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformers_prefill_decode_matches_single_process(dtype: str) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "transformers_pd.py"), "--dtype", dtype],
                            capture_output=True, text=True, check=False, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{dtype}: identical" in result.stdout and "PASS" in result.stdout
