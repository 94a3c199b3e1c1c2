"""Argument checks with the reference's exception classes and messages.

Type errors raise ``TypeError``, integers out of their C range raise ``ValueError``, semantic violations raise
``LLMException(LLM_PARAM_INVALID)``.  ``bool`` counts as ``int`` exactly as in the reference.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, NoReturn, Protocol, TypeAlias

import numpy as np

from .errors import LLMException, LLMStatusCode

U64_LIMIT = 2**64
"""Values of a C ``uint64_t`` are ``0 <= v < U64_LIMIT``; addresses wrap modulo it."""
U64_MAX = U64_LIMIT - 1
I64_MAX = 2**63 - 1
I64_MIN = -(2**63)

_RANGES = {
    "uint64": (0, U64_MAX),
    "int64": (I64_MIN, I64_MAX),
    "uint32": (0, 2**32 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "uint16": (0, 2**16 - 1),
    "uint8": (0, 2**8 - 1),
}


def _type_names(types: Sequence[type]) -> list[str]:
    return [t.__name__ for t in types]


def check_isinstance(name: str, value: Any, types: type | tuple[type, ...], *, allow_none: bool = False) -> None:
    """``TypeError`` unless ``value`` is one of ``types`` (or ``None`` when allowed)."""
    if value is None and allow_none:
        return
    tup = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, tup):
        raise TypeError(f"{name} only support {_type_names(tup)}, but got {type(value)}.")


def check_int(name: str, value: Any, kind: str) -> int:
    """Type-check an integer and check it fits the C type ``kind`` (``uint64``, ``int32``...)."""
    if isinstance(value, np.integer):
        value = int(value)
    check_isinstance(name, value, int)
    low, high = _RANGES[kind]
    if not low <= value <= high:
        raise ValueError(f"{name}'s value is out of range,{value} is not a {kind} value.")
    return int(value)


INT_ONLY = {int}  # the set of element types of a list of plain ints


def check_int_list(name: str, values: Any, kind: str, *, container: tuple[type, ...] = (list, tuple)) -> list[int]:
    """Check a list/tuple of integers of C type ``kind``; returns a plain list."""
    if type(values) in container and (not values or set(map(type, values)) == INT_ONLY):  # the common case
        low, high = _RANGES[kind]
        if not values or (low <= min(values) and max(values) <= high):
            return list(values)
    check_isinstance(name, values, container)
    out = []
    for v in values:
        if isinstance(v, np.integer):
            v = int(v)
        if not isinstance(v, int):
            raise TypeError(f"{name} inner type only support ['int'], but got {type(v)}.")
        out.append(check_int(name, v, kind))
    return out


class SupportsToList(Protocol):
    """A 1-D integer array-like: a numpy array, a torch tensor (anything with ``tolist``)."""

    def tolist(self) -> Any: ...


IndexSequence: TypeAlias = "Sequence[int] | range | SupportsToList"
"""The static type of a block list (see :func:`check_index_list`)."""

INDEX_SEQUENCE_TYPES = ["list", "tuple", "range", "ndarray", "Tensor"]
"""What :func:`check_index_list` accepts (``ndarray``/``Tensor``: any 1-D integer array, duck-typed)."""


def _as_array(values: Any) -> np.ndarray[Any, Any] | None:
    """``values`` as a numpy array when it is array-like (numpy, or duck-typed through ``__array__`` or
    ``tolist`` such as a torch tensor, on any device), else ``None``.  Never imports torch."""
    if isinstance(values, np.ndarray):
        return values
    if isinstance(values, (str, bytes, bytearray)):
        return None
    if hasattr(values, "__array__"):
        try:
            return np.asarray(values)  # zero-copy for CPU tensors
        except (TypeError, ValueError, RuntimeError):  # a CUDA tensor, or a dtype numpy lacks (bf16)
            pass
    tolist = getattr(values, "tolist", None)
    if callable(tolist):
        items = tolist()
        if isinstance(items, list) and not items:
            return np.empty(0, dtype=np.int64)
        try:
            return np.asarray(items)
        except ValueError:  # ragged nesting: not one-dimensional
            return np.empty((0, 0), dtype=np.int64)
    return None


def check_index_list(name: str, values: Any, kind: str) -> list[int]:
    """Check a one-dimensional integer sequence of C type ``kind`` (block lists); returns a plain list.

    Accepted: a list or tuple (checked as :func:`check_int_list`), a ``range``, and a 1-D integer array: numpy,
    or anything with ``__array__`` or ``tolist`` (a torch tensor, on any device), checked vectorised.  Other
    containers, strings, arrays of another rank and bool or float arrays raise ``TypeError``; values outside
    ``kind`` raise ``ValueError``.
    """
    if isinstance(values, (list, tuple)):
        return check_int_list(name, values, kind)
    if isinstance(values, range):
        if len(values):  # the extremes of a range are its ends
            check_int(name, values[0], kind)
            check_int(name, values[-1], kind)
        return list(values)
    arr = _as_array(values)
    if arr is None:
        raise TypeError(f"{name} only support {INDEX_SEQUENCE_TYPES}, but got {type(values)}.")
    if arr.ndim != 1:
        raise TypeError(f"{name} must be one-dimensional, but got an array of shape {tuple(arr.shape)}.")
    if arr.dtype.kind == "O":  # Python ints beyond 64 bits, or mixed objects: checked one by one
        return check_int_list(name, arr.tolist(), kind, container=(list,))
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} inner type only support ['int'], but got an array of {arr.dtype}.")
    if arr.size:
        low, high = _RANGES[kind]
        smallest, largest = int(arr.min()), int(arr.max())
        for value in (smallest, largest):
            if not low <= value <= high:
                raise ValueError(f"{name}'s value is out of range,{value} is not a {kind} value.")
    out: list[int] = arr.tolist()
    return out


def check_bool(name: str, value: Any) -> bool:
    check_isinstance(name, value, bool)
    return bool(value)


def param_invalid(message: str) -> NoReturn:
    raise LLMException(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def require(condition: bool, message: str) -> None:
    """``LLMException(LLM_PARAM_INVALID)`` unless ``condition``."""
    if not condition:
        param_invalid(message)


def check_layer_range(name: str, value: Any, *, allow_empty: bool) -> range | None:
    """A layer range is ``None`` or a ``range`` with step 1 and ``start >= 0``."""
    if value is None:
        return None
    check_isinstance(name, value, range)
    require(value.step == 1, f"{name} step only support 1, but got {value.step}.")
    require(value.start >= 0, f"{name} start must be >= 0, but got {value.start}.")
    if not allow_empty:
        require(value.start < value.stop, f"{name} must satisfy 0 <= start < stop, but got {value}.")
    result: range = value
    return result


WRONG_LOOP = ("this LLMDataDist was initialized on another event loop; use one loop per instance, "
              "or aiodatadist.sync from threads.  With pytest-asyncio, a fixture and the tests that use it "
              "must share a loop: give both the same loop_scope (e.g. @pytest_asyncio.fixture(loop_scope="
              "\"module\") and pytestmark = pytest.mark.asyncio(loop_scope=\"module\"))")


def check_event_loop(loop: asyncio.AbstractEventLoop | None) -> None:
    """``LLMException(LLM_FAILED)`` unless the running event loop is ``loop`` (the one an instance was
    initialized on; ``None``: not bound to a loop yet).  An identity check: cheap enough for every call."""
    if loop is not None and asyncio.get_running_loop() is not loop:
        raise LLMException(WRONG_LOOP, status_code=LLMStatusCode.LLM_FAILED)
