"""The native helper's C files form a tree behind one header: every function one file uses from another is declared
in ``src/adt.h``, nothing else is exported, no file carries its own copy of another's prototype, and no two files
call each other (the files' graph has no cycle).  Read from the sources (``helpers/native_source.py`` says what the
scan does and does not see); no compiler needed."""

from __future__ import annotations

import re

from helpers.native_source import HEADER, c_files, declarations, header_prototypes, identifiers, marked

ENTRY_POINT = "PyInit__native"  # the module's init function: exported by PyMODINIT_FUNC, found by the importer


def _definitions() -> dict[str, str]:
    """Each function defined with external linkage, and the file that defines it."""
    owners: dict[str, str] = {}
    for name, text in c_files().items():
        for d in declarations(text):
            if d.body is not None and not d.static:
                assert d.name not in owners, f"{d.name} is defined in {owners[d.name]} and {name}"
                owners[d.name] = name
    return owners


def _uses() -> dict[str, set[str]]:
    """For each file, the files whose functions it uses (calls, or takes the address of)."""
    owners = _definitions()
    return {name: {owners[f] for f in identifiers(text) if f in owners and owners[f] != name}
            for name, text in c_files().items()}


def test_the_scan_sees_the_tree() -> None:
    files = set(c_files())
    assert {"spans.c", "pool.c", "grid.c", "frames.c", "net.c", "cuda.c", "module.c"} <= files
    assert len(_definitions()) >= 40, "the definition pattern no longer matches the sources"
    assert len(header_prototypes()) >= 40, "the prototype pattern no longer matches adt.h"
    assert _uses()["module.c"] >= {"pool.c", "grid.c", "net.c", "cuda.c"}, "the use scan no longer matches"


def test_every_c_file_includes_the_header() -> None:
    for name, text in c_files().items():
        assert re.search(r'^#include "adt\.h"$', text, re.MULTILINE), f"{name} does not include adt.h"


def test_every_function_used_across_files_is_declared_in_the_header() -> None:
    owners, declared = _definitions(), set(header_prototypes())
    for name, text in c_files().items():
        foreign = {f for f in identifiers(text) if f in owners and owners[f] != name}
        undeclared = sorted(foreign - declared)
        assert not undeclared, f"{name} uses functions of other files not in adt.h: {undeclared}"


def test_only_what_the_header_declares_is_exported() -> None:
    """Everything a file does not export to another is static."""
    exported = set(_definitions()) - {ENTRY_POINT}
    undeclared = sorted(exported - set(header_prototypes()))
    assert not undeclared, f"defined without static but not declared in adt.h: {undeclared}"


def test_every_header_prototype_is_marked_and_defined_once() -> None:
    owners = _definitions()
    api, internal = marked("ADT_API"), marked("ADT_INTERNAL")
    assert not api & internal
    unmarked = sorted(set(header_prototypes()) - api - internal)
    assert not unmarked, f"{HEADER.name} declares without ADT_API or ADT_INTERNAL: {unmarked}"
    stale = sorted(set(header_prototypes()) - set(owners))
    assert not stale, f"{HEADER.name} declares functions no C file defines: {stale}"


def test_no_file_declares_another_files_functions() -> None:
    """Prototypes live in adt.h only: a .c file may forward-declare its own static functions, nothing else."""
    for name, text in c_files().items():
        copied = sorted(d.name for d in declarations(text) if d.body is None and not d.static)
        assert not copied, f"{name} declares {copied} itself (adt.h declares what files share)"


def test_the_files_call_graph_has_no_cycle() -> None:
    uses = _uses()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name):] + [name]
            raise AssertionError(f"the C files call each other: {' -> '.join(cycle)}")
        if name in done:
            return
        for used in sorted(uses[name]):
            visit(used, [*path, name])
        done.add(name)

    for name in sorted(uses):
        visit(name, [])


def test_only_the_module_includes_python() -> None:
    """The C core knows nothing of Python: only module.c parses Python objects."""
    with_python = sorted(name for name, text in c_files().items() if "#include <Python.h>" in text)
    assert with_python == ["module.c"]
