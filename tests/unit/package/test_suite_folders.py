"""The suite's folders say what they hold: every folder of ``tests/`` has its markers (``FOLDER_MARKERS`` in
``tests/conftest.py``), and ``tests/unit/`` mirrors the package, one folder per layer."""

from __future__ import annotations

import ast
from pathlib import Path

import aiodatadist

TESTS = Path(__file__).resolve().parents[2]
PACKAGE = Path(aiodatadist.__file__).parent
NOT_LAYERS = {"api", "package"}  # the public modules at the package's root; the package's shape


def _folders(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}


def _folder_markers() -> dict[str, tuple[str, ...]]:
    """``FOLDER_MARKERS`` as tests/conftest.py writes it (read, not imported: the benchmarks' suite has a
    conftest of its own)."""
    for node in ast.walk(ast.parse((TESTS / "conftest.py").read_text())):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "FOLDER_MARKERS":
            assert node.value is not None
            markers: dict[str, tuple[str, ...]] = ast.literal_eval(node.value)
            return markers
    raise AssertionError("tests/conftest.py defines no FOLDER_MARKERS")


def test_every_folder_of_the_suite_has_its_markers() -> None:
    assert _folders(TESTS) - {"helpers"} == set(_folder_markers())


def test_each_unit_folder_is_a_layer_of_the_package() -> None:
    layers = _folders(PACKAGE)
    unit = _folders(TESTS / "unit")
    assert unit - NOT_LAYERS <= layers, sorted(unit - NOT_LAYERS - layers)
    assert not list((TESTS / "unit").glob("test_*.py")), "unit tests live in the folder of their layer"
