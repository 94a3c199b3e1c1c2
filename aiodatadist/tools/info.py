"""``python -m aiodatadist info``: version, data planes and what this machine allows."""

from __future__ import annotations

import os
import platform
import sys

import numpy as np
import zmq

from .. import __version__
from ..control.links import native_data_plane
from ..copy.python_pool import default_workers
from ..cuda import cuda_status
from ..native import native_available
from ..transport.same_host import allowed_mechanisms
from ..transport.tcp.python_plane import data_connections

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    lines = [
        f"aiodatadist {__version__} (Python {platform.python_version()}, numpy {np.__version__}, "
        f"pyzmq {zmq.pyzmq_version()}, libzmq {zmq.zmq_version()})",
        f"native span copier: {'built' if native_available() else 'not built (ctypes fallback)'}",
        f"copy executor: {_executor()} with {default_workers()} threads (AIODATADIST_EXECUTOR, "
        "AIODATADIST_COPY_THREADS)",
        f"same-host mechanisms allowed: {', '.join(sorted(allowed_mechanisms())) or 'none'}",
        f"ptrace scope: {_read('/proc/sys/kernel/yama/ptrace_scope') or 'n/a'}",
        "data planes: shm (same host: mapped shared memory or process_vm_readv/writev), tcp (other hosts, or "
        "forced with llm.Transport=tcp); chosen per link at the handshake, shown by LLMDataDist.links()",
        f"tcp data plane: {'native I/O threads, one-sided reads' if native_data_plane() else 'Python I/O threads'}"
        f", {data_connections()} connections per link (AIODATADIST_NET, AIODATADIST_TCP_CONNECTIONS)",
        f"GPU (Placement.DEVICE, CUDA driver API through ctypes): {cuda_status()}",
        f"cpus: {os.cpu_count()}",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _executor() -> str:
    if native_available() and os.environ.get("AIODATADIST_EXECUTOR", "native") != "python":
        return "native pool"
    return "Python threads"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
