"""The numpy array types the package annotates with (a leaf: it imports numpy only)."""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import numpy.typing as npt

__all__ = ["UInt64Array"]

UInt64Array: TypeAlias = npt.NDArray[np.uint64]
"""Addresses, lengths and offsets: one C ``uint64_t`` each."""
