"""The SGLang modules the backend builds on, imported when SGLang first asks for the backend's classes.

Only :mod:`.manager` imports this module, and only SGLang's ``get_kv_class`` (as hooked by :mod:`.plugin`) imports
:mod:`.manager`: installing aiodatadist never imports SGLang, and the core never does.  The names are typed ``Any``
(SGLang ships no type information, and is not installed where the package is type-checked).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["base", "common", "utils"]

base: Any = importlib.import_module("sglang.srt.disaggregation.base.conn")
common: Any = importlib.import_module("sglang.srt.disaggregation.common.conn")
utils: Any = importlib.import_module("sglang.srt.disaggregation.utils")
