"""No function of the layers that move bytes between peers is hard to follow: ruff's McCabe check (C901) at the
project's ``max-complexity`` (12, pyproject.toml) over ``transfer/``, ``link/``, ``control/`` and ``transport/``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import aiodatadist

PACKAGE = Path(aiodatadist.__file__).parent
CHECKED = ("transfer", "link", "control", "transport")


def _ruff() -> list[str]:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (it is in the 'test' extra)")
    return [found]


def test_no_function_above_the_complexity_bound() -> None:
    if not (PACKAGE.parent / "pyproject.toml").exists():
        pytest.skip("the package is not imported from its source tree")
    result = subprocess.run([*_ruff(), "check", "--no-cache", "--select", "C901", *(str(PACKAGE / d) for d in CHECKED)],
                            cwd=PACKAGE.parent, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_finds_a_complex_function(tmp_path: Path) -> None:
    """The check itself: a function with 13 branches fails it."""
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(13))
    (tmp_path / "complex.py").write_text(f"def f(x):\n{branches}    return -1\n")
    (tmp_path / "pyproject.toml").write_text("[tool.ruff.lint.mccabe]\nmax-complexity = 12\n")
    result = subprocess.run([*_ruff(), "check", "--no-cache", "--select", "C901", "complex.py"], cwd=tmp_path,
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "C901" in result.stdout, result.stdout + result.stderr
