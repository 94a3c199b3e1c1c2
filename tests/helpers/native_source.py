"""The native helper's C sources read as text (``aiodatadist/native/src/``): its files, the functions each defines,
the names each uses, and the prototypes and structs of ``adt.h``.  For tests of the C tree and its bindings; no
compiler needed.

A scan, not a C parser.  It drops comments, string and character literals and preprocessor lines (so macro bodies
and ``#if`` conditions are not read; both branches of an ``#if`` are), then reads the top level by brace depth: a
function is a top-level ``... name(...) {``, a prototype a top-level ``... name(...);`` that is not a
``typedef``.  It sees a function used wherever its name appears (a call, or its address taken), but not calls
through a macro defined in another file or through function pointers (the device-runtime table, ``lanes_step``):
those are not calls between files by name, which is what the header must declare.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import aiodatadist.native

SRC = Path(aiodatadist.native.__file__).parent / "src"
HEADER = SRC / "adt.h"

_TOKENS = re.compile(r"""/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'""", re.DOTALL)
_PREPROCESSOR = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.MULTILINE)
_IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")


def code_of(text: str) -> str:
    """``text`` without comments, literals and preprocessor lines (each replaced by a space or an empty literal, so
    that what is left keeps its tokens apart)."""
    def blank(match: re.Match[str]) -> str:
        token = match.group(0)
        return '""' if token.startswith('"') else "' '" if token.startswith("'") else " "

    return _PREPROCESSOR.sub(" ", _TOKENS.sub(blank, text))


@dataclass(frozen=True)
class Declaration:
    """A top-level function: its name, what precedes the name (return type, storage class, attributes), its
    parameter list as written, and its body (None for a prototype)."""

    name: str
    head: str
    params: str
    body: str | None

    @property
    def static(self) -> bool:
        return re.search(r"\bstatic\b", self.head) is not None


def _split_call(chunk: str) -> tuple[str, str, str] | None:
    """(head, name, params) of a chunk that ends with ``name(params)``, else None."""
    chunk = chunk.rstrip()
    if not chunk.endswith(")"):
        return None
    depth = 0
    for i in range(len(chunk) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(chunk[i], 0)
        if depth == 0:
            match = re.search(r"([A-Za-z_]\w*)\s*$", chunk[:i])
            if match is None:
                return None
            return chunk[:match.start()], match.group(1), chunk[i + 1:-1]
    return None


def declarations(text: str) -> list[Declaration]:
    """The top-level functions (definitions and prototypes) of C source ``text``."""
    code = code_of(text)
    found: list[Declaration] = []
    depth, start, i = 0, 0, 0
    while i < len(code):
        c = code[i]
        if c == "{" and depth == 0:
            chunk = code[start:i]
            call = _split_call(chunk) if "=" not in chunk else None
            end = _matching_brace(code, i)
            if call is not None and not re.match(r"\s*typedef\b", chunk):
                found.append(Declaration(call[1], call[0], call[2], code[i + 1:end]))
            i = start = end + 1
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                start = i + 1
        elif c == ";" and depth == 0:
            chunk = code[start:i]
            call = _split_call(chunk)
            if call is not None and "=" not in chunk and not re.match(r"\s*typedef\b", chunk):
                found.append(Declaration(call[1], call[0], call[2], None))
            start = i + 1
        i += 1
    return found


def _matching_brace(code: str, at: int) -> int:
    depth = 0
    for i in range(at, len(code)):
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        if depth == 0:
            return i
    raise ValueError("unbalanced braces")


def identifiers(text: str) -> set[str]:
    """Every identifier in the code of ``text`` (comments, literals and preprocessor lines left out)."""
    return set(_IDENTIFIER.findall(code_of(text)))


@cache
def c_files() -> dict[str, str]:
    """Each C file's name and text."""
    return {path.name: path.read_text() for path in sorted(SRC.glob("*.c"))}


@cache
def header_prototypes() -> dict[str, Declaration]:
    """The prototypes of ``adt.h`` by name (its static inline helpers are definitions, not listed)."""
    return {d.name: d for d in declarations(HEADER.read_text()) if d.body is None}


def marked(visibility: str) -> set[str]:
    """The names ``adt.h`` declares with ``visibility`` (``ADT_API`` or ``ADT_INTERNAL``)."""
    return {name for name, d in header_prototypes().items() if re.search(rf"\b{visibility}\b", d.head)}


def struct_fields(name: str) -> list[str]:
    """The member names, in order, of ``typedef struct name {...} name;`` in ``adt.h`` (a function pointer member
    ``int (*bind)(...)`` is named ``bind``)."""
    code = code_of(HEADER.read_text())
    match = re.search(rf"typedef\s+struct\s+{name}\s*\{{", code)
    if match is None:
        raise LookupError(f"no struct {name} in adt.h")
    body = code[match.end():_matching_brace(code, match.end() - 1)]
    fields: list[str] = []
    for member in body.split(";"):
        member = member.strip()
        if not member:
            continue
        pointer = re.search(r"\(\s*\*\s*(\w+)\s*\)", member)
        if pointer is not None:
            fields.append(pointer.group(1))
            continue
        # "unsigned grid, block" declares two; "char *d[MAX_LANES]" one named d
        declarators = member.split(",")
        first = re.sub(r"\[[^\]]*\]", "", declarators[0]).split()[-1]
        fields.append(first.lstrip("*"))
        fields.extend(re.sub(r"\[[^\]]*\]", "", d).strip().lstrip("*").strip() for d in declarators[1:])
    return fields
