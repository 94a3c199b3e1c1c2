"""The package's shape: no import cycle, each part imports only what the architecture allows it to.

Every import counts, including those inside functions and under ``TYPE_CHECKING``: a lazy import hides a cycle,
it does not remove it.  The parts are grouped in ``GROUPS``, their allowed imports listed in ``ALLOWED`` and the
pairs that must never import each other named in ``FORBIDDEN``; docs/design.md draws the same picture.
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

# Each part of the library (a top-level module or package) and the parts it may import.  Parts in one group
# may import each other (without cycles).  Siblings are parts that never import each other: control and
# transport, composed only by the link layer; the registry and the links, composed by the transfer layer.
GROUPS: dict[str, set[str]] = {
    "values": {"errors", "_checks", "types", "transfer_configs", "config", "stats",
               "_aio", "_lazy", "_deadlines",  # values and generic helpers: import nothing else
               "_log_limits",  # warnings a flood cannot multiply
               "_listen",  # the listening sockets' queue length
               "_arrays",  # the numpy array types annotations share
               "settings",  # option keys, parsed options, environment knobs, CURVE keys
               "layout"},  # cache geometry and copy plans (with _blocks, its compiled block lists -> runs)
    "native": {"native"},  # the compiled helper and its ctypes bindings
    "memory": {"memory"},  # shared memory segments
    "jobs": {"jobs"},  # the job contract every executor follows, span chunking, completion pipes
    "copy": {"copy"},  # the copy engine, host pools, device caches and the device-runtime interface
    "runtimes": {"cuda", "acl"},  # the device runtimes: CUDA (driver, kernels, the GPU executor), Ascend's ACL
    "protocol": {"protocol", "notifications"},  # sans-IO wire protocol, segment identities; the notification inbox
    "control": {"control"},  # ZeroMQ channels and sockets
    "transport": {"transport"},  # data planes: same host, TCP, NIXL, GPU; TCP connection setup, fd passing
    "registry": {"registry", "cache"},  # caches of an instance and their directory; the user's handle
    "link": {"link"},  # a link = a control channel + a data plane; the link table and the handshake's I/O
    "transfer": {"transfer"},  # the transfer conversation: requester, owner, copy engine
    "facade": {"cache_manager", "layer_transfer", "datadist"},  # public facade, composition root
    "helpers": {"metrics", "testing", "sync", "torch"},  # built on the facade
    "adapters": {"integrations", "compat"},  # engine adapters; drop-in modules
    "namespace": {"__init__"},  # the package's public names, loaded on first use
    "cli": {"cli", "__main__"},  # the command line: demo, info; bench and soak forwarded to the benchmarks
}
_BASE = {"values"}
_SYSTEM = _BASE | {"native", "memory"}
ALLOWED: dict[str, set[str]] = {
    "values": _BASE,
    "native": _BASE,
    "memory": _BASE | {"native", "protocol"},  # (segment identities)
    "jobs": _BASE | {"native"},
    "runtimes": _SYSTEM | {"jobs"},
    "copy": _SYSTEM | {"jobs", "runtimes"},  # (the device-runtime interface opens the runtime it chose)
    "protocol": _BASE,
    "control": _BASE | {"memory", "protocol"},
    "transport": _SYSTEM | {"jobs", "copy", "protocol"},
    "registry": _SYSTEM | {"copy", "protocol"},  # (segment identities)
    "link": _SYSTEM | {"protocol", "control", "transport"},
    "transfer": _SYSTEM | {"jobs", "copy", "protocol", "transport", "registry", "link"},
}
ALLOWED["facade"] = set(ALLOWED) - {"runtimes"} | {"facade"}
ALLOWED["helpers"] = ALLOWED["facade"] | {"helpers"}
ALLOWED["adapters"] = ALLOWED["helpers"] | {"adapters"}
ALLOWED["cli"] = set(GROUPS) - {"runtimes"}
ALLOWED["namespace"] = set(GROUPS) - {"cli", "runtimes"}
GROUP = {part: group for group, parts in GROUPS.items() for part in parts}
BELOW_THE_FACADE = {"values", "native", "memory", "jobs", "copy", "runtimes", "protocol", "control", "transport", "registry",
                    "link", "transfer"}
FORBIDDEN: list[tuple[str, str, str]] = [
    ("control", "transport", "control and transport are siblings: only the link layer knows both"),
    ("transport", "control", "control and transport are siblings: only the link layer knows both"),
    ("control", "registry", "the control channel knows no caches"),
    ("registry", "transport", "the registry publishes caches; the planes read what it publishes"),
    ("registry", "link", "the registry and the links are siblings: the transfer layer composes them"),
    ("link", "registry", "the registry and the links are siblings: the transfer layer composes them"),
    ("protocol", "native", "the sans-IO protocol loads no native code"),
    ("protocol", "memory", "the sans-IO protocol loads no native code"),
    ("protocol", "copy", "the sans-IO protocol loads no native code"),
    ("transport", "transfer", "a plane is driven by the transfer layer, never the other way"),
    ("runtimes", "copy", "a device runtime sits below the copy layer that uses it"),
    *[(group, "runtimes", "only the copy layer reaches a device runtime (through its interface)")
      for group in set(GROUPS) - {"runtimes", "copy"}],
    ("transport", "link", "a plane knows nothing of the link that holds it"),
    *[(group, "facade", "nothing below the facade reaches datadist/cache_manager") for group in BELOW_THE_FACADE],
    *[(group, "cli", "the library never imports the command line") for group in set(GROUPS) - {"cli"}],
]
DEVICE_PROBES = {"aiodatadist.testing.probes"}
"""The benchmarks' documented window into the CUDA runtime (docs/testing.md, "Benchmark hooks": the phases of a
GPU copy, the copy kernel alone): the one module outside ``copy`` and ``cuda`` that imports CUDA names.  The
library itself never imports it."""
BENCHMARKS = "aiodatadist_benchmarks"  # the benchmarks distribution (benchmarks/ in the repository)
BENCHMARKS_LOADER = "aiodatadist.cli.lab"  # forwards bench and soak to it, importing it by name


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


def _group(module: str) -> str:
    return GROUP[_layer(module)]


def _edges() -> list[tuple[str, str]]:
    return [(module, target) for module, targets in sorted(_graph().items()) for target in sorted(targets)
            if not (module in DEVICE_PROBES and _group(target) == "runtimes")]


def test_nothing_imports_the_device_probes() -> None:
    importers = [module for module, target in _edges() if target in DEVICE_PROBES]
    assert not importers, importers


def test_every_module_belongs_to_a_layer() -> None:
    unknown = sorted({_layer(m) for m in _modules()} - set(GROUP))
    assert not unknown, f"add these to GROUPS (and to the diagram in docs/design.md): {unknown}"


def test_no_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_layers_import_only_what_they_are_allowed_to() -> None:
    wrong = [f"{module} ({_group(module)}) imports {target} ({_group(target)})" for module, target in _edges()
             if _group(target) not in ALLOWED[_group(module)] | {_group(module)}]
    assert not wrong, "imports against the architecture:\n" + "\n".join(wrong)


@pytest.mark.parametrize(("importer", "imported", "why"), FORBIDDEN, ids=[f"{a}-/->{b}" for a, b, _ in FORBIDDEN])
def test_forbidden_pairs(importer: str, imported: str, why: str) -> None:
    assert imported not in ALLOWED[importer], f"ALLOWED contradicts the architecture: {why}"
    found = [f"{module} imports {target}" for module, target in _edges()
             if _group(module) == importer and _group(target) == imported]
    assert not found, f"{why}:\n" + "\n".join(found)


def test_the_protocol_loads_no_native_code() -> None:
    """In a fresh interpreter, the sans-IO protocol imports without the native helper (the package's public
    names load lazily)."""
    code = ("import sys, aiodatadist.protocol.messages, aiodatadist.protocol.handshake\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(('aiodatadist.native', 'aiodatadist.memory',"
            " 'aiodatadist.copy')))\n"
            "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("protected", ["aiodatadist.cli", "aiodatadist.datadist", "aiodatadist.cache_manager"])
def test_only_the_top_reaches_the_facade_and_the_command_line(protected: str) -> None:
    allowed = {"aiodatadist", "aiodatadist.__main__", "aiodatadist.testing", "aiodatadist.metrics",
               "aiodatadist.sync",
               "aiodatadist.cli", "aiodatadist.datadist"}
    offenders = sorted(
        module for module, targets in _graph().items()
        if any(t == protected or t.startswith(protected + ".") for t in targets)
        and not (module in allowed
                 or module.startswith(("aiodatadist.cli.", protected, "aiodatadist.testing.")))
    )
    assert not offenders, f"{protected} is imported from below: {offenders}"


def test_the_library_never_imports_the_benchmarks() -> None:
    """The benchmarks depend on the library, never the reverse: no module imports ``aiodatadist_benchmarks``,
    and only the CLI's forwarder holds its name as a value, to load it by name when ``bench`` or ``soak`` runs."""
    def ours(target: object) -> bool:
        return isinstance(target, str) and (target == BENCHMARKS or target.startswith(BENCHMARKS + "."))

    importers, naming = set(), set()
    for name, path in sorted(_modules().items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(ours(t) for t in targets):
                importers.add(name)
            if isinstance(node, ast.Constant) and ours(node.value) and name != BENCHMARKS_LOADER:
                naming.add(name)
    assert not importers, f"the library imports the benchmarks: {sorted(importers)}"
    assert not naming, f"only {BENCHMARKS_LOADER} may load the benchmarks by name: {sorted(naming)}"


def test_the_public_modules_load_without_the_benchmarks() -> None:
    """In a fresh interpreter, the package, its public modules and the command line load without the benchmarks
    (they are imported only when ``bench`` or ``soak`` runs)."""
    code = ("import sys, aiodatadist, aiodatadist.sync, aiodatadist.testing, aiodatadist.metrics, aiodatadist.cli\n"
            "import aiodatadist.testing.probes\n"
            f"loaded = sorted(m for m in sys.modules if m.split('.')[0] == {BENCHMARKS!r})\n"
            "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


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
    missing = [name for name in GROUP if name not in ("__init__", "__main__") and name not in diagram
               and ((PACKAGE / name).exists() or (PACKAGE / f"{name}.py").exists())]
    assert not missing, f"docs/design.md's diagram does not show: {missing}"
    for package in ("transfer", "link", "control", "protocol", "transport", "copy", "native", "cuda", "acl"):
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
