"""The connector's options: vLLM's ``kv_connector_extra_config`` (pure: no vLLM, no torch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._config import check_transport

__all__ = ["ConnectorOptions"]


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` keys (all optional).

    ``listen_host``: the address P's workers listen on and announce to D ("127.0.0.1"; set it to the host's
    address for D engines on other hosts).  ``port_base``: rank i listens on ``port_base + i`` (0: free ports,
    chosen for you).  ``auth_key``: a shared key every engine must present (``llm.AuthKey``).  ``transport``:
    ``auto`` (shared memory on one host, TCP across), ``shm``, ``tcp`` or ``nixl``.  ``lease_seconds``: how long P keeps
    a request's blocks for a D that never pulls them (480, as vLLM's NIXL abort timeout).  ``pull_timeout_ms``:
    the bound of one pull (``sync_kv_timeout``, 30000).  ``link_timeout_ms``: the bound of linking to a P
    worker (5000).  ``layerwise``: D loads each layer on its own, inside the forward that computes the request's
    last prompt token, and each attention layer waits only for its own layer (``wait_for_layer_load``), so the
    transfer of the later layers overlaps the computation of the earlier ones (False: the whole request is
    loaded between steps, as NixlConnector does).  ``share_kv``: a host KV cache is shared in place at start-up
    (``share_host_memory``), so that a same-host peer copies it with ``memcpy`` on its copy threads rather than
    reading it with ``process_vm_readv`` (True; where it cannot be shared, a warning, and transfers take the
    slower way)."""

    listen_host: str = "127.0.0.1"
    port_base: int = 0
    auth_key: str = ""
    transport: str = "auto"
    lease_seconds: float = 480.0
    pull_timeout_ms: int = 30000
    link_timeout_ms: int = 5000
    layerwise: bool = False
    share_kv: bool = True

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        """Parse ``kv_connector_extra_config``: unknown keys and wrong types raise ``ValueError``."""
        extra = dict(extra or {})
        fields = cls.__dataclass_fields__
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(f"AiodatadistConnector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(fields)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind = type(getattr(cls, name))
            try:
                if kind is bool:
                    if str(value).lower() not in ("true", "false", "1", "0"):
                        raise ValueError(value)
                    values[name] = str(value).lower() in ("true", "1")
                else:
                    values[name] = kind(value)
            except (TypeError, ValueError):
                raise ValueError(f"AiodatadistConnector: {name} must be {kind.__name__}, got {value!r}") from None
        options = cls(**values)
        if not 0 <= options.port_base <= 65535:
            raise ValueError(f"AiodatadistConnector: port_base {options.port_base} out of range")
        check_transport(options.transport, "AiodatadistConnector: transport")
        return options
