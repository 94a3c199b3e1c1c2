"""The package's root is its public face: every module there that is not underscored defines a public name
(``aiodatadist.__all__``) or is a module users import by its path; everything else lives in a package."""

from __future__ import annotations

import ast
from pathlib import Path

import aiodatadist
from aiodatadist import _WHERE

PACKAGE = Path(aiodatadist.__file__).parent
IMPORTED_BY_PATH = {"sync", "torch", "metrics", "testing", "compat", "integrations"}  # docs/api.md
INTERNAL_PACKAGES = {"settings", "layout", "registry", "protocol", "control", "transport", "link", "transfer", "memory",
                     "jobs", "copy", "cuda", "acl", "native", "cli"}


def test_every_public_root_module_defines_a_public_name_or_is_imported_by_path() -> None:
    public = {path.stem for path in PACKAGE.glob("*.py") if not path.stem.startswith("_")}
    defining = set(_WHERE.values())
    assert public - defining - IMPORTED_BY_PATH == set()


def test_the_root_has_no_other_packages() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages - INTERNAL_PACKAGES - IMPORTED_BY_PATH == set()


def test_the_public_names_are_where_the_lazy_table_says() -> None:
    for name, module in _WHERE.items():
        source = (PACKAGE / f"{module}.py") if (PACKAGE / f"{module}.py").exists() else PACKAGE / module / "__init__.py"
        tree = ast.parse(source.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))} | {
            t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)} | {
            a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert name in defined, (name, module)
