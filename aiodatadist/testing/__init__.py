"""Helpers for async test suites (ours and users'), and a pytest plugin (``docs/testing.md``).

* in this process: ``local_prompt()`` (a listening prompt alone), ``linked_pair()`` (a prompt and a decoder
  linked to it);
* in another process: ``PeerProcess`` (an ``LLMDataDist`` driven by commands) and ``PromptServer`` (a prompt
  with named caches, to fill, read, kill, stop and restart);
* faults: ``FaultInjector`` (process signals, a control-connection proxy that stalls or cuts, data-connection
  cuts), ``fault_proxy.FaultProxy``;
* leaks: ``LeakCheck`` (links, child processes, threads, descriptors, shared memory, tasks left by a test);
* bytes: ``pattern``, ``fill_pattern``, ``tensor_bytes``, ``write_tensor``, ``block_rows``;
* addresses: ``cluster_info_for`` (also ``aiodatadist.cluster_info_for``), ``cluster_info``, ``free_port``,
  ``new_cluster_id``.

The pytest plugin (:mod:`aiodatadist.testing.plugin`, registered as ``aiodatadist``) offers them as fixtures.
Names load on first use (PEP 562): importing this package (as pytest does for the plugin) loads neither numpy nor
ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:
    from .addresses import cluster_info, cluster_info_for, free_port, new_cluster_id
    from .data import block_rows, fill_pattern, pattern, tensor_bytes, write_tensor
    from .faults import FaultInjector
    from .leaks import LeakCheck
    from .local import linked_pair, local_prompt
    from .peer import PeerError, PeerProcess
    from .prompt_server import PromptAddress, PromptServer, RemoteCache

_WHERE = {
    "FaultInjector": "faults",
    "LeakCheck": "leaks",
    "PeerError": "peer",
    "PeerProcess": "peer",
    "PromptAddress": "prompt_server",
    "PromptServer": "prompt_server",
    "RemoteCache": "prompt_server",
    "block_rows": "data",
    "cluster_info": "addresses",
    "cluster_info_for": "addresses",
    "fill_pattern": "data",
    "free_port": "addresses",
    "linked_pair": "local",
    "local_prompt": "local",
    "new_cluster_id": "addresses",
    "pattern": "data",
    "tensor_bytes": "data",
    "write_tensor": "data",
}
"""Each public name -> the module (of this package) that defines it."""


__getattr__, __dir__ = lazy_names(__name__, globals(), _WHERE)

__all__ = [
    "FaultInjector",
    "LeakCheck",
    "PeerError",
    "PeerProcess",
    "PromptAddress",
    "PromptServer",
    "RemoteCache",
    "block_rows",
    "cluster_info",
    "cluster_info_for",
    "fill_pattern",
    "free_port",
    "linked_pair",
    "local_prompt",
    "new_cluster_id",
    "pattern",
    "tensor_bytes",
    "write_tensor",
]
