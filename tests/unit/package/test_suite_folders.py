"""The suite's folders say what they hold: every folder of ``tests/`` has its markers (``FOLDER_MARKERS`` in
``tests/conftest.py``), and ``tests/unit/`` mirrors the package, one folder per layer."""

from __future__ import annotations

from pathlib import Path

import conftest

import aiodatadist

TESTS = Path(conftest.__file__).resolve().parent
PACKAGE = Path(aiodatadist.__file__).parent
NOT_LAYERS = {"api", "package"}  # the public modules at the package's root; the package's shape


def _folders(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}


def test_every_folder_of_the_suite_has_its_markers() -> None:
    assert _folders(TESTS) - {"helpers"} == set(conftest.FOLDER_MARKERS)


def test_each_unit_folder_is_a_layer_of_the_package() -> None:
    layers = _folders(PACKAGE)
    unit = _folders(TESTS / "unit")
    assert unit - NOT_LAYERS <= layers, sorted(unit - NOT_LAYERS - layers)
    assert not list((TESTS / "unit").glob("test_*.py")), "unit tests live in the folder of their layer"
