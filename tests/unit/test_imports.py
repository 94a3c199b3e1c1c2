"""The package's shape: no import cycle, every layer imports only the layers below it.

Every import counts, including those inside functions and under ``TYPE_CHECKING``: a lazy import hides a cycle,
it does not remove it.  The layers are listed bottom-up in ``LAYERS`` and drawn in docs/design.md.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

import aiodatadist

PACKAGE = Path(aiodatadist.__file__).parent

# Bottom-up: a module may import its own layer (without cycles) and the layers before it, never a later one.
LAYERS: list[set[str]] = [
    {"errors", "_checks", "types", "transfer_configs", "rank_table", "config", "layout", "stats"},  # pure values
    {"native"},  # the compiled helper and its ctypes bindings
    {"memory", "_settings"},  # shared memory segments; parsed options and environment knobs
    {"copy"},  # copy executors (native and Python pools)
    {"cuda"},  # CUDA driver, kernels and the GPU executor
    {"protocol", "notifications"},  # sans-IO wire protocol: codec, messages, handshake rules, auth; the notification inbox
    {"transport"},  # data planes: same host, directory, device, TCP
    {"registry", "cache"},  # caches of an instance; the user's handle
    {"control"},  # ZeroMQ channels, sockets and links
    {"transfer"},  # the transfer conversation: requester, owner, copy engine
    {"cache_manager", "layer_transfer"},  # public facade: caches, local copies, pull/push, layer-wise push
    {"datadist", "comm_domains"},  # public facade and composition root; two-sided links
    {"metrics", "testing", "sync", "torch"},  # public helpers built on the facade; the blocking API; torch interop
    {"integrations", "compat"},  # engine adapters (the vLLM connector); drop-in modules (llm_datadist)
    {"tools", "__main__", "__init__"},  # CLI and the package's public namespace
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that ``name`` imports anywhere in its source (targets and their packages)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        for target in targets:
            if target in known:
                found.add(target)
            # importing a.b.c runs the __init__ of a.b too (unless the importer lives inside it)
            parts = target.split(".")
            for k in range(2, len(parts)):
                parent = ".".join(parts[:k])
                if parent in known and not name.startswith(parent + ".") and parent != name:
                    found.add(parent)
    found.discard(name)
    return found


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_belongs_to_a_layer() -> None:
    unknown = sorted({_layer(m) for m in _modules()} - set(RANK))
    assert not unknown, f"add these to LAYERS (and to the diagram in docs/design.md): {unknown}"


def test_no_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_layers_import_only_layers_below() -> None:
    upward = [
        f"{module} ({_layer(module)}) imports {target} ({_layer(target)})"
        for module, targets in sorted(_graph().items())
        for target in sorted(targets)
        if RANK[_layer(target)] > RANK[_layer(module)]
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


@pytest.mark.parametrize("protected", ["aiodatadist.tools", "aiodatadist.datadist", "aiodatadist.cache_manager"])
def test_only_the_top_reaches_the_facade_and_the_tools(protected: str) -> None:
    allowed = {"aiodatadist", "aiodatadist.__main__", "aiodatadist.testing", "aiodatadist.metrics",
               "aiodatadist.sync",
               "aiodatadist.tools", "aiodatadist.datadist"}
    offenders = sorted(
        module for module, targets in _graph().items()
        if any(t == protected or t.startswith(protected + ".") for t in targets)
        and not (module in allowed
                 or module.startswith(("aiodatadist.tools.", protected, "aiodatadist.testing.")))
    )
    assert not offenders, f"{protected} is imported from below: {offenders}"


def test_the_checker_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    """The scanner itself: imports inside functions and under TYPE_CHECKING are found."""
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
                      "def f():\n    from ..b import y\n")
    found = _imports("aiodatadist.pkg.mod", source, {"aiodatadist.pkg.a", "aiodatadist.b"})
    assert found == {"aiodatadist.pkg.a", "aiodatadist.b"}
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_the_design_diagram_names_every_layer() -> None:
    """docs/design.md opens with the layer diagram: every package and top-level module of the library is in it,
    and every module of a layer package is named beside its package."""
    path = PACKAGE.parent / "docs" / "design.md"
    if not path.exists():
        pytest.skip("the package is not imported from its source tree")
    design = path.read_text()
    diagram = design.split("```", 2)[1]
    missing = [name for name in RANK if name not in ("__init__", "__main__") and name not in diagram]
    assert not missing, f"docs/design.md's diagram does not show: {missing}"
    for package in ("transfer", "control", "protocol", "transport", "copy", "native", "cuda"):
        modules = {p.stem for p in (PACKAGE / package).glob("*.py")} - {"__init__"}
        unnamed = sorted(m for m in modules if m not in diagram)
        assert not unnamed, f"docs/design.md's diagram does not name {package}/ modules {unnamed}"


def test_nothing_imports_the_torch_module() -> None:
    """``aiodatadist.torch`` is imported only by its users: no module of the library names it, but the engine
    adapters (``integrations``, which import their engine and torch anyway)."""
    importers = sorted(module for module, targets in _graph().items()
                       if "aiodatadist.torch" in targets and not module.startswith("aiodatadist.integrations."))
    assert not importers, f"aiodatadist.torch is imported by {importers}"


def test_import_does_not_import_torch() -> None:
    """In a fresh interpreter, the package and its public modules load without importing torch."""
    code = ("import sys, aiodatadist, aiodatadist.sync, aiodatadist.testing, aiodatadist.metrics\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
