"""``python -m aiodatadist info``: version, data planes, what this machine allows, and every setting."""

from __future__ import annotations

import os
import platform
import sys

import numpy as np
import zmq

from .. import __version__
from ..copy.device_runtime import runtime_status
from ..native import native_available, native_pool
from ..settings.environment import EnvKnobs, env_knobs, usable_cpus

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    knobs = env_knobs()
    native_net = knobs.native_net and native_pool() is not None
    lines = [
        (f"aiodatadist {__version__} (Python {platform.python_version()}, numpy {np.__version__}, "
         f"pyzmq {zmq.pyzmq_version()}, libzmq {zmq.zmq_version()})"),
        f"native span copier: {'built' if native_available() else 'not built (ctypes fallback)'}",
        (f"copy executor: {_executor(knobs)} with {knobs.copy_threads} threads (AIODATADIST_EXECUTOR, "
         "AIODATADIST_COPY_THREADS)"),
        f"same-host mechanisms allowed: {', '.join(sorted(knobs.same_host)) or 'none'}",
        f"ptrace scope: {_read('/proc/sys/kernel/yama/ptrace_scope') or 'n/a'}",
        ("data planes: shm (same host: mapped shared memory or process_vm_readv/writev), tcp (other hosts, "
         "or forced with llm.Transport=tcp); chosen per link at the handshake, shown by LLMDataDist.links()"),
        (f"tcp data plane: {'native I/O threads, one-sided reads' if native_net else 'Python I/O threads'}"
         f", {knobs.tcp_connections} connections per link (defaults of llm.Net and llm.TcpConnections: "
         "AIODATADIST_NET, AIODATADIST_TCP_CONNECTIONS)"),
        f"Device runtime (Placement.DEVICE: CUDA driver API or Ascend ACL, through ctypes): {runtime_status()}",
        f"cpus: {usable_cpus()} usable (affinity) of {os.cpu_count()}",
        "settings (AIODATADIST_* environment variables; an option named here overrides it per instance):",
        *_settings_lines(knobs),
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _settings_lines(knobs: EnvKnobs) -> list[str]:
    rows = [(f"{knob.env}={value}", source, f"[{knob.option}] " if knob.option else "", knob.help)
            for knob, value, source in knobs.report()]
    width = max(len(r[0]) for r in rows)
    return [f"  {setting:<{width}}  ({source}) {option}{what}" for setting, source, option, what in rows]


def _executor(knobs: EnvKnobs) -> str:
    if native_available() and knobs.executor != "python":
        return "native pool"
    return "Python threads"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
