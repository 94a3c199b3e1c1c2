"""Helpers for async test suites (ours and users'), and a pytest plugin (``docs/testing.md``).

* in this process: ``local_prompt()`` (a listening prompt alone), ``linked_pair()`` (a prompt and a decoder
  linked to it);
* in another process: ``PeerProcess`` (an ``LLMDataDist`` driven by commands) and ``PromptServer`` (a prompt
  with named caches, to fill, read, kill, stop and restart);
* faults: ``FaultInjector`` (process signals, a control-connection proxy that stalls or cuts, data-connection
  cuts), ``fault_proxy.FaultProxy``; waiting for their effect: ``wait_until``, ``wait_unlinked``,
  ``wait_linked`` (and ``FaultInjector.taken_effect``);
* leaks: ``LeakCheck`` (links, child processes, threads, descriptors, shared memory, tasks left by a test), each
  a ``Leak``;
* bytes: ``pattern``, ``fill_pattern``, ``tensor_bytes``, ``write_tensor``, ``block_rows``,
  ``assert_blocks_landed``;
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
    from .data import assert_blocks_landed, block_rows, fill_pattern, pattern, tensor_bytes, write_tensor
    from .faults import FaultInjector
    from .leaks import Leak, LeakCheck
    from .local import linked_pair, local_prompt
    from .peer import PeerError, PeerProcess
    from .prompt_server import PromptAddress, PromptServer, RemoteCache
    from .waiting import wait_linked, wait_unlinked, wait_until

_WHERE = {
    "FaultInjector": "faults",
    "Leak": "leaks",
    "LeakCheck": "leaks",
    "PeerError": "peer",
    "PeerProcess": "peer",
    "PromptAddress": "prompt_server",
    "PromptServer": "prompt_server",
    "RemoteCache": "prompt_server",
    "assert_blocks_landed": "data",
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
    "wait_linked": "waiting",
    "wait_unlinked": "waiting",
    "wait_until": "waiting",
    "write_tensor": "data",
}
"""Each public name -> the module (of this package) that defines it."""


__getattr__, __dir__ = lazy_names(__name__, globals(), _WHERE)

__all__ = [
    "FaultInjector",
    "Leak",
    "LeakCheck",
    "PeerError",
    "PeerProcess",
    "PromptAddress",
    "PromptServer",
    "RemoteCache",
    "assert_blocks_landed",
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
    "wait_linked",
    "wait_unlinked",
    "wait_until",
    "write_tensor",
]
