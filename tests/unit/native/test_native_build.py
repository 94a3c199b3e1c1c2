"""The native helper is an optional extension (no compiler: the package falls back to Python), so a build that
fails where a compiler exists would go unnoticed but for this check: with a C compiler on the machine, the helper
must be built from the current source and load with every function the package binds."""

from __future__ import annotations

import re
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
        for name in ("_native.c", "_net.c"):
            assert built >= (here / name).stat().st_mtime, f"the built helper is older than {name}: rebuild it"


def test_every_exported_function_has_a_declared_signature() -> None:
    """A function called through ctypes without ``argtypes`` gets its pointers truncated to C ints: a crash
    (exit 139) rather than an error. Every non-static ``adt_*`` function of the sources must be declared."""
    lib = native.native_pool()
    if lib is None:
        pytest.skip("native helper not built")
    here = Path(native.__file__).parent
    source = "".join((here / name).read_text() for name in ("_native.c", "_net.c"))
    exported = set(re.findall(r"^(?!static)[A-Za-z_][\w \t]*?\**\s*\b(adt_\w+)\(", source, re.MULTILINE))
    assert len(exported) >= 20, "the export pattern no longer matches the sources"
    undeclared = sorted(name for name in exported if getattr(lib, name).argtypes is None)
    assert not undeclared, f"exported but not declared in native/bindings.py: {undeclared}"
