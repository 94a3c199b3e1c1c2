"""The device-runtime interface: what the copy layer needs of a device runtime, and the one this process uses.

A runtime is one device of this process (an ordinal) and the executor that copies spans on it.  Everything above
the copy layer (the planes, the registry, the facade) reaches a device only through :class:`DeviceRuntime`:
CUDA implements it in :class:`aiodatadist.cuda.runtime.CudaRuntime`, Ascend's ACL in
:class:`aiodatadist.acl.runtime.AclRuntime`.  Which one a process uses is decided once
(:func:`chosen_runtime`, from ``AIODATADIST_DEVICE_RUNTIME``).  Addresses are plain ints in the process's unified address space:
device memory, a peer's memory opened through IPC and page-locked host memory are all valid span ends.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..errors import LLMException, LLMStatusCode
from ..jobs.base import ExecutorJob
from ..layout.plans import CopyPlan
from ..native import Lane
from ..settings.environment import ENV_DEVICE_RUNTIME, env_knobs

__all__ = ["RUNTIMES", "DeviceExecutor", "DeviceRuntime", "Lane", "chosen_runtime", "decided_runtime", "open_runtime",
           "runtime_status"]

log = logging.getLogger("aiodatadist.copy.device")

UInt64Array = npt.NDArray[np.uint64]


class DeviceExecutor(Protocol):
    """Copies a plan's spans on the device (within it, and over the bus to and from page-locked host memory),
    completing each job through an event the executor records after it and polls."""

    def start_plan(self, plan: CopyPlan, src_addrs: UInt64Array, dst_addrs: UInt64Array) -> ExecutorJob: ...

    async def wait(self, job: ExecutorJob) -> None:
        """Await a job; a cancelled caller returns only once the device no longer writes for it."""
        ...

    def cancel(self, job: ExecutorJob, error: BaseException | None = None) -> None: ...

    def close(self) -> None: ...


class DeviceRuntime(Protocol):
    """One device of this process, as the copy layer uses it.  Every method may be called from any thread: it
    binds the calling thread to the device first."""

    name: str
    """The runtime's name (``"cuda"``, ``"acl"``), as ``links()`` and ``aiodatadist info`` report it."""
    ordinal: int
    """The device's ordinal among the visible devices (``LLMConfig.device_id``)."""

    @property
    def ipc_pid(self) -> int:
        """The PID a same-host owner names when it lets this process import its memory (ACL's bare TGID: the
        host's PID, also inside a container; CUDA names no importer)."""
        ...

    @property
    def executor(self) -> DeviceExecutor:
        """The executor copying on this device (one per runtime)."""
        ...

    def bind_thread(self) -> None:
        """Make this device current on the calling thread."""
        ...

    def alloc(self, nbytes: int) -> int: ...

    def free(self, ptr: int) -> None: ...

    def alloc_pinned(self, nbytes: int) -> int:
        """Page-locked host memory the device reads and writes at bus speed."""
        ...

    def free_pinned(self, ptr: int) -> None: ...

    def register_host(self, addr: int, nbytes: int) -> int:
        """Page-lock existing host memory for device copies; returns its device address."""
        ...

    def unregister_host(self, addr: int) -> None: ...

    def is_device_pointer(self, ptr: int) -> bool:
        """Whether ``ptr`` is memory of this device."""
        ...

    def address_range(self, ptr: int, nbytes: int = 0) -> tuple[int, int]:
        """``(base, size)`` of the allocation holding device address ``ptr`` (``nbytes``: the tensor there, for a
        runtime that can only bound it by rounding)."""
        ...

    def ipc_handle(self, ptr: int, importer: int | None = None) -> bytes:
        """The handle a same-host process opens to reach the allocation at ``ptr`` (``importer``: that process's
        :attr:`ipc_pid`, where the runtime lets only named processes import)."""
        ...

    def ipc_open(self, handle: bytes) -> int:
        """Open a same-host peer's allocation; returns its address in this process."""
        ...

    def ipc_close(self, ptr: int) -> None: ...

    def ipc_withdraw(self, ptr: int) -> None:
        """Caller-owned memory at ``ptr`` that this process exported goes back to its owner: stop exporting it
        (once peers closed their imports), so that the owner can free it."""
        ...

    def device_table(self) -> tuple[object, int]:
        """The native device-runtime table (a capsule named ``aiodatadist.native.device_ops``: bind, gather,
        scatter, record, query) and the device handle its ``bind`` takes; raises ``LLM_FEATURE_NOT_ENABLED``
        without the native helper."""
        ...

    def open_lane(self, capacity: int, chunk_bytes: int) -> Lane:
        """A stream of its own, an event and descriptor memory for ``capacity`` descriptors, shaped for copies
        of about ``chunk_bytes``."""
        ...

    def close_lane(self, lane: Lane) -> None:
        """Free what :meth:`open_lane` made (its stream is waited for first)."""
        ...

    def copy_to_device(self, dst: int, src_host: int, nbytes: int) -> None:
        """A synchronous copy from host memory (for checks and tests; transfers go through the executor)."""
        ...

    def copy_to_host(self, dst_host: int, src: int, nbytes: int) -> None:
        """A synchronous copy to host memory (for checks and tests; transfers go through the executor)."""
        ...

    def close(self) -> None:
        """Stop the executor once its work is done."""
        ...


RUNTIMES: tuple[str, ...] = ("cuda", "acl")
_chosen: dict[tuple[str, tuple[str, ...], tuple[str, ...]], str] = {}
_chosen_lock = threading.Lock()


def _probe(name: str) -> str | None:
    """None when runtime ``name`` has a device here, else why not."""
    try:
        if name == "cuda":
            from ..cuda.driver import cuda_driver

            cuda_driver()
        else:
            from ..acl.library import acl_library

            acl_library()
    except (LLMException, OSError) as exc:
        return str(exc)
    return None


def _choice_key() -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    knobs = env_knobs()
    return knobs.device_runtime, knobs.libcuda, knobs.libascendcl


def decided_runtime() -> str | None:
    """The runtime :func:`chosen_runtime` decided for the current settings, or None if it was not asked yet
    (nothing is loaded)."""
    return _chosen.get(_choice_key())


def chosen_runtime() -> str:
    """The device runtime of this process: ``AIODATADIST_DEVICE_RUNTIME`` (``cuda`` or ``acl``), or with
    ``auto`` (the default) the one that has a device, CUDA where both do (logged).  Decided once per setting;
    raises ``LLM_FEATURE_NOT_ENABLED`` saying why when the runtime asked for (or either, for ``auto``) cannot be
    used."""
    knobs = env_knobs()
    key = _choice_key()
    found = _chosen.get(key)
    if found is not None:
        return found
    with _chosen_lock:
        if key in _chosen:
            return _chosen[key]
        wanted = knobs.device_runtime
        names = RUNTIMES if wanted == "auto" else (wanted,)
        reasons = {name: _probe(name) for name in names}
        usable = [name for name in names if reasons[name] is None]
        if not usable:
            why = "; ".join(f"{name.upper()}: {reason}" for name, reason in reasons.items())
            raise LLMException(f"no device runtime for Placement.DEVICE ({ENV_DEVICE_RUNTIME}={wanted}): {why}",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        if len(usable) > 1:
            log.info("both CUDA and ACL have a device: Placement.DEVICE uses CUDA (set %s=acl for the NPU)",
                     ENV_DEVICE_RUNTIME)
        _chosen[key] = usable[0]
        return usable[0]


def open_runtime(ordinal: int) -> DeviceRuntime:
    """The runtime of device ``ordinal`` (:func:`chosen_runtime`); raises ``LLM_FEATURE_NOT_ENABLED`` saying
    why when no device runtime can be used."""
    if chosen_runtime() == "acl":
        from ..acl.runtime import AclRuntime

        return AclRuntime(ordinal)
    from ..cuda.runtime import CudaRuntime

    return CudaRuntime(ordinal)


def runtime_status() -> str:
    """One line for ``aiodatadist info``: the device runtime in use, its version and devices, or why none can be
    used."""
    from ..acl.library import acl_status
    from ..cuda.driver import cuda_status

    wanted = env_knobs().device_runtime
    try:
        name = chosen_runtime()
    except LLMException as exc:
        return f"unavailable: {exc}"
    how = "chosen" if wanted == "auto" else f"{ENV_DEVICE_RUNTIME}={wanted}"
    if name == "acl":
        return f"ACL ({how}): {acl_status()}; verified on an emulated runtime only"
    return f"CUDA ({how}): {cuda_status()}"
