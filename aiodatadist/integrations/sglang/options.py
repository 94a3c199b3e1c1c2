"""The SGLang backend's options, from ``AIODATADIST_SGLANG_*`` environment variables (all optional).

SGLang rewrites every ``SGL_*`` variable to ``SGLANG_*`` in its processes, so the backend's own variables are
named ``AIODATADIST_SGLANG_*``.  They are read by the backend only (the core reads its ``AIODATADIST_*`` knobs
in :mod:`aiodatadist.settings.environment`, and knows nothing of these).

====================================  ============  ==========================================================
variable                              default       meaning
====================================  ============  ==========================================================
``AIODATADIST_SGLANG_TRANSPORT``      ``auto``      ``auto`` (shared memory on one host, TCP across), ``shm``,
                                                    ``tcp`` or ``nixl`` (``llm.Transport``)
``AIODATADIST_SGLANG_AUTH_KEY``       (none)        shared key every engine must present (``llm.AuthKey``)
``AIODATADIST_SGLANG_LISTEN_HOST``    SGLang's IP   address the decode engine's instance listens on and announces
``AIODATADIST_SGLANG_PUSH_TIMEOUT_MS``  30000       bound of one push (``sync_kv_timeout``)
``AIODATADIST_SGLANG_LINK_TIMEOUT_MS``  5000        bound of linking a prefill rank to a decode rank
``AIODATADIST_SGLANG_SHARE_KV``       ``on``        ``on``: a decode rank shares its host KV buffers in place
                                                    (``share_host_memory``: same-host prefill ranks push with
                                                    ``memcpy``); ``off``: left private (``process_vm_writev``)
====================================  ============  ==========================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .._config import TRANSPORTS, check_transport

__all__ = ["ENV_PREFIX", "TRANSPORTS", "BackendOptions"]

ENV_PREFIX = "AIODATADIST_SGLANG_"


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """What the environment says (see the module's documentation); ``listen_host`` empty: SGLang's local IP."""

    transport: str = "auto"
    auth_key: str = ""
    listen_host: str = ""
    push_timeout_ms: int = 30000
    link_timeout_ms: int = 5000
    share_kv: str = "on"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> BackendOptions:
        """Parse the ``AIODATADIST_SGLANG_*`` variables of ``environ`` (default ``os.environ``).

        An unknown ``AIODATADIST_SGLANG_*`` name or a bad value raises ``ValueError`` naming the variable (a typo
        is never silently ignored); an empty value counts as unset."""
        env = os.environ if environ is None else environ
        known = {ENV_PREFIX + name.upper(): name for name in cls.__dataclass_fields__}
        unknown = sorted(key for key in env if key.startswith(ENV_PREFIX) and key not in known)
        if unknown:
            raise ValueError(f"unknown variables {unknown}; the aiodatadist SGLang backend reads {sorted(known)}")
        values: dict[str, str | int] = {}
        for variable, name in known.items():
            raw = env.get(variable, "").strip()
            if not raw:
                continue
            if name.endswith("_ms"):
                if not raw.isdigit() or int(raw) <= 0:
                    raise ValueError(f"{variable} must be a number of milliseconds > 0, got {raw!r}")
                values[name] = int(raw)
            else:
                values[name] = raw
        options = cls(**values)  # type: ignore[arg-type]
        if options.share_kv not in ("on", "off"):
            raise ValueError(f"{ENV_PREFIX}SHARE_KV must be on or off, got {options.share_kv!r}")
        check_transport(options.transport, f"{ENV_PREFIX}TRANSPORT")
        return options
