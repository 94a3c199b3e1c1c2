"""The native helper is an optional extension (no compiler: the package falls back to Python), so a build that
fails where a compiler exists would go unnoticed but for this check: with a C compiler on the machine, the helper
must be built from the current source and load with every function the package binds (``test_native_bindings.py``
checks those functions' signatures)."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from aiodatadist import native


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) or shutil.which("cc") or shutil.which("gcc")


def test_the_helper_is_built_from_the_current_source_where_a_compiler_exists() -> None:
    if _compiler() is None:
        pytest.skip("no C compiler: the Python fallback is the expected build")
    assert native.native_available(), "a C compiler exists but the native helper did not build (see pip's output)"
    from aiodatadist.native import _native  # type: ignore[attr-defined]

    for name in ("copy_grid", "submit_grid", "reap"):
        assert hasattr(_native, name), f"the built helper predates its source (no {name}): rebuild it"
    lib = native.native_pool()
    assert lib is not None and hasattr(lib, "adt_job_submit") and hasattr(lib, "adt_pool_new")
    here = Path(native.__file__).parent
    if (here.parent.parent / "pyproject.toml").exists():  # a source tree (editable install): compare the files
        built = Path(_native.__file__).stat().st_mtime
        for source in sorted((here / "src").glob("*.[ch]")):
            assert built >= source.stat().st_mtime, f"the built helper is older than src/{source.name}: rebuild it"
