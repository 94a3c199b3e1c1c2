"""Ascend NPUs through ACL (``libascendcl.so``, through ctypes): the runtime behind ``Placement.DEVICE`` caches on
Ascend machines.  Nothing is loaded at import; :func:`acl_library` loads the runtime on first use and raises
``LLM_FEATURE_NOT_ENABLED`` saying why without one.

Verified on an emulated runtime only (``tests/helpers/fake_libascendcl.c``), never on an NPU: see
``docs/design.md``.  Submodules: :mod:`.library` (loading, errors), :mod:`.device` (threads, memory, IPC keys),
:mod:`.executor` (span copies and their completion), :mod:`.runtime` (the device-runtime interface).
"""

from __future__ import annotations

from .library import ENV_LIBASCENDCL, AclError, AclLibrary, AclUnavailable, acl_library, acl_status

__all__ = ["ENV_LIBASCENDCL", "AclError", "AclLibrary", "AclUnavailable", "acl_library", "acl_status"]
