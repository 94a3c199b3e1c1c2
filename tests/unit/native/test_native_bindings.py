"""Python binds each C function of the native helper one way, with the signature ``src/adt.h`` gives it: the
``ADT_API`` prototypes through ctypes (``native/bindings.py``: a mismatch there passes wrong values, or truncates
pointers, instead of failing), the ``ADT_INTERNAL`` ones only from other C files, the module's methods among
them.  The header is read as text (``helpers/native_source.py``), so these checks need no compiler; those that look
at the built library skip without one."""

from __future__ import annotations

import ctypes
import re
from collections import defaultdict
from typing import Any

import pytest
from helpers import device_ops
from helpers.native_source import c_files, header_prototypes, identifiers, marked, struct_fields

from aiodatadist import native
from aiodatadist.native import bindings

# C types as ctypes spells them.  ctypes makes some of them one type (size_t, uint64_t and unsigned long are all
# c_ulong on LP64 Linux): such pairs cannot be told apart here, and need not be, as they pass the same way.
_SCALARS: dict[str, Any] = {
    "int": ctypes.c_int, "unsigned": ctypes.c_uint, "long": ctypes.c_long, "size_t": ctypes.c_size_t,
    "int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64,
    "uint8_t": ctypes.c_uint8,
}


class _Recorder:
    """Stands in for the loaded library: records what :func:`bindings.bind` declares, built or not."""

    def __init__(self) -> None:
        foreign = type("Foreign", (), {"argtypes": None, "restype": None})
        self.functions: dict[str, Any] = defaultdict(foreign)

    def __getattr__(self, name: str) -> Any:
        return self.functions[name]


def _bound() -> dict[str, Any]:
    recorder = _Recorder()
    bindings.bind(recorder)  # type: ignore[arg-type]
    return dict(recorder.functions)


def _c_type(text: str, *, parameter: bool) -> tuple[str, int]:
    """(base type, pointer depth) of a parameter (its name dropped) or a return type."""
    text = re.sub(r"\b(const|volatile)\b", " ", text)
    depth = text.count("*")
    words = text.replace("*", " ").split()
    if parameter and len(words) > 1:
        words = words[:-1]  # the parameter's name
    return " ".join(words), depth


def _accepts(c_text: str, ctype: Any, *, parameter: bool) -> bool:
    base, depth = _c_type(c_text, parameter=parameter)
    if depth == 0:
        return ctype is None if base == "void" else _SCALARS.get(base) is ctype
    if ctype is ctypes.c_void_p:
        return True
    # a typed pointer: POINTER(T) for T *
    return depth == 1 and getattr(ctype, "_type_", None) is _SCALARS.get(base)


def _parameters(params: str) -> list[str]:
    params = params.strip()
    return [] if params in ("", "void") else [p.strip() for p in params.split(",")]


def test_bind_declares_exactly_the_header_api() -> None:
    bound, api = set(_bound()), marked("ADT_API")
    assert len(api) >= 20, "the prototype pattern no longer matches adt.h"
    assert sorted(api - bound) == [], "ADT_API in adt.h but not declared in bindings.bind"
    assert sorted(bound - api) == [], "declared in bindings.bind but not ADT_API in adt.h"


@pytest.mark.parametrize("name", sorted(marked("ADT_API")))
def test_ctypes_signature_matches_the_prototype(name: str) -> None:
    prototype, foreign = header_prototypes()[name], _bound()[name]
    params = _parameters(prototype.params)
    assert foreign.argtypes is not None and len(foreign.argtypes) == len(params), \
        f"{name}: {len(params)} parameters in adt.h, argtypes {foreign.argtypes}"
    for i, (c_text, ctype) in enumerate(zip(params, foreign.argtypes, strict=True)):
        assert _accepts(c_text, ctype, parameter=True), \
            f"{name} parameter {i} is {c_text!r} in adt.h, {ctype} in ctypes"
    head = re.sub(r"\bADT_API\b", " ", prototype.head)
    assert _accepts(head, foreign.restype, parameter=False), \
        f"{name} returns {head.strip()!r} in adt.h, restype {foreign.restype}"


def test_the_module_calls_no_ctypes_function() -> None:
    """No function is reachable both as a module method and through ctypes."""
    both = sorted(identifiers(c_files()["module.c"]) & marked("ADT_API"))
    assert not both, f"module.c calls ADT_API functions, which ctypes binds too: {both}"


def test_the_built_library_exports_the_api_and_hides_the_rest() -> None:
    lib = native.native_pool()
    if lib is None:
        pytest.skip("native helper not built")
    missing = sorted(name for name in marked("ADT_API") if not hasattr(lib, name))
    assert not missing, f"ADT_API functions missing from the build (stale?): {missing}"
    reachable = sorted(name for name in marked("ADT_INTERNAL") if hasattr(lib, name))
    assert not reachable, f"ADT_INTERNAL functions ctypes can find: {reachable}"


@pytest.mark.parametrize(("struct", "mirror"), [("adt_device_ops", device_ops.DeviceOps),
                                               ("adt_device_launch", device_ops.DeviceLaunch),
                                               ("adt_device_lane", device_ops.DeviceLane),
                                               ("adt_stage_slot", bindings.StageSlot)])
def test_the_device_table_mirror_matches_the_header(struct: str, mirror: type[ctypes.Structure]) -> None:
    """The tests' ctypes view of the device-runtime table names the header's members in its order."""
    assert [field[0] for field in mirror._fields_] == struct_fields(struct)
