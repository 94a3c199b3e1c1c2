"""An SGLang prefill/decode transfer backend on aiodatadist: ``--disaggregation-transfer-backend aiodatadist``.

Installing aiodatadist is enough: its ``sglang.srt.plugins`` entry point (:func:`.plugin.register`) adds the backend
to SGLang in every SGLang process, and no other configuration is needed between engines on one host::

    python -m sglang.launch_server ... --disaggregation-mode prefill --disaggregation-transfer-backend aiodatadist
    python -m sglang.launch_server ... --disaggregation-mode decode --disaggregation-transfer-backend aiodatadist

Further options come from ``AIODATADIST_SGLANG_*`` environment variables (:mod:`.options`: transport, auth key,
listen address, timeouts).  How it works: :mod:`.manager`.

Importing this package never imports SGLang (the core of aiodatadist never does either): SGLang is imported when
SGLang itself asks for the backend's classes.
"""

from __future__ import annotations

from .options import BackendOptions
from .plugin import BACKEND, register

__all__ = ["BACKEND", "BackendOptions", "register"]
