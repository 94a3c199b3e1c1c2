"""One NPU of this process through ACL: binding threads to it, its memory, host memory it copies at bus speed, and
its allocations shared with same-host processes (IPC export keys).

Threads share the device's *default context*, the one ``aclrtSetDevice`` creates and torch_npu uses: every thread
that calls ACL for a device calls ``aclrtSetDevice`` once (:meth:`AclDevice.bind_thread`; the reference it takes
is never given back, as torch_npu's worker threads never give theirs back either) and switches back to the
device's context when it used another device since.

Memory this process allocated (``aclrtMalloc``), imported (``aclrtIpcMemImportByKey``) or page-locked is known by
its range; memory from elsewhere (torch_npu's caching allocator) is found through ``aclrtPointerGetAttributes``
and, on CANN 9.0 and later, ``aclrtMemGetAddressRange``.  Before 9.0 there is no public way to find an
allocation's base: the tensor's range rounded out to 2 MiB stands for it, and it is exported at once, so that what
cannot be shared is refused when it is registered (``LLM_PARAM_INVALID``), not when a peer first reads it.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Final

from ..errors import LLMException, LLMStatusCode
from .library import (
    ACL_ERROR_API_NOT_SUPPORT,
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
    AclError,
    AclLibrary,
    AclUnavailable,
    acl_library,
)

__all__ = ["ACL_IPC_KEY_BYTES", "AclDevice", "MemLocation", "PtrAttributes", "acl_device"]

log = logging.getLogger("aiodatadist.acl")

ACL_IPC_KEY_BYTES: Final = 65  # aclrtIpcMemGetExportKey's key: a NUL-terminated 65-byte string
ACL_MEM_MALLOC_HUGE_FIRST: Final = 0
ACL_HOST_REG_PINNED: Final = 0x10000000
ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT: Final = 0x0  # importers must be whitelisted (aclrtIpcMemSetImportPid)
ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION: Final = 0x1
ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS: Final = 0x1
ACL_MEMCPY_HOST_TO_DEVICE: Final = 1
ACL_MEMCPY_DEVICE_TO_HOST: Final = 2
ACL_MEM_LOCATION_TYPE_HOST: Final = 0
ACL_MEM_LOCATION_TYPE_DEVICE: Final = 1
HUGE_PAGE: Final = 2 << 20  # what torch_npu's caching allocator and the IPC alignment rules work in


class MemLocation(ctypes.Structure):
    """``aclrtMemLocation``."""

    _fields_ = [("id", ctypes.c_uint32), ("type", ctypes.c_int)]


class PtrAttributes(ctypes.Structure):
    """``aclrtPtrAttributes``."""

    _fields_ = [("location", MemLocation), ("pageSize", ctypes.c_uint32), ("rsv", ctypes.c_uint32 * 4)]


@dataclass(slots=True)
class _Export:
    """An allocation (or, before CANN 9.0, a 2 MiB-rounded range) exported to same-host processes."""

    key: bytes
    size: int
    whitelist: bool  # importers must be named (aclrtIpcMemSetImportPid), else validation is off
    importers: set[int] = field(default_factory=set)


class _Ranges:
    """Address ranges ``[base, base + size)`` with a value each, found by any address inside."""

    def __init__(self) -> None:
        self._bases: list[int] = []
        self._items: dict[int, tuple[int, object]] = {}

    def add(self, base: int, size: int, value: object = None) -> None:
        if base not in self._items:
            bisect.insort(self._bases, base)
        self._items[base] = (size, value)

    def pop(self, base: int) -> tuple[int, object] | None:
        found = self._items.pop(base, None)
        if found is not None:
            self._bases.remove(base)
        return found

    def find(self, addr: int) -> tuple[int, int, object] | None:
        """``(base, size, value)`` of the range holding ``addr``."""
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        base = self._bases[i]
        size, value = self._items[base]
        return (base, size, value) if addr < base + size else None


class AclDevice:
    """NPU ``ordinal`` of this process (shared: get it from :meth:`AclLibrary.device`)."""

    def __init__(self, library: AclLibrary, ordinal: int) -> None:
        self.library = library
        self.ordinal = ordinal
        self._thread = threading.local()
        self._lock = threading.Lock()
        self._own = _Ranges()  # aclrtMalloc'ed here
        self._imported = _Ranges()  # peers' allocations opened here (value: their key)
        self._host = _Ranges()  # host memory page-locked for this device (value: "malloc", "registered", "pageable")
        self._exports: dict[int, _Export] = {}  # base -> its key
        self._exports_by_range = _Ranges()  # the same, by range (value: the base)
        self._closing: dict[int, bytes] = {}  # freed while importers still had it open: freed once they closed
        self._borrowed: set[int] = set()  # of those, caller-owned memory: its key closed, the memory not freed
        self.context = 0
        self.bind_thread()
        current = ctypes.c_void_p()
        library.call("aclrtGetCurrentContext", ctypes.byref(current))
        self.context = current.value or 0
        self._ipc_pid: int | None = None

    def __repr__(self) -> str:
        return f"<AclDevice {self.ordinal}>"

    # -- threads -----------------------------------------------------------------------------------------------
    def bind_thread(self) -> None:
        """Make this device's default context current on the calling thread (``aclrtSetDevice`` the first time
        a thread uses it, ``aclrtSetCurrentContext`` when the thread used another device since)."""
        lib = self.library
        if getattr(self._thread, "set", False):
            current = ctypes.c_void_p()
            if not lib.fn("aclrtGetCurrentContext")(ctypes.byref(current)) and current.value == self.context:
                return
            lib.call("aclrtSetCurrentContext", ctypes.c_void_p(self.context))
            return
        lib.call("aclrtSetDevice", self.ordinal)
        self._thread.set = True

    @property
    def ipc_pid(self) -> int:
        """The PID peers whitelist for this process's imports: ``aclrtDeviceGetBareTgid`` (the host's PID of this
        process, also inside a container), else ``os.getpid()``."""
        if self._ipc_pid is None:
            pid = os.getpid()
            if self.library.has("aclrtDeviceGetBareTgid"):
                self.bind_thread()
                tgid = ctypes.c_int32()
                if not self.library.fn("aclrtDeviceGetBareTgid")(ctypes.byref(tgid)):
                    pid = tgid.value
            self._ipc_pid = pid
        return self._ipc_pid

    # -- device memory -----------------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        self.bind_thread()
        self._free_closed()
        ptr = ctypes.c_void_p()
        self.library.call("aclrtMalloc", ctypes.byref(ptr), max(1, nbytes), ACL_MEM_MALLOC_HUGE_FIRST)
        address = ptr.value or 0
        size = self._allocated_size(address, max(1, nbytes))
        with self._lock:
            self._own.add(address, size)
        return address

    def _allocated_size(self, address: int, nbytes: int) -> int:
        """The size ACL gave an allocation of ``nbytes`` (what an export of it must cover): the runtime's own
        answer where it has ``aclrtMemGetAddressRange``, else its documented rounding (to 32 bytes, plus 32)."""
        if self.library.has("aclrtMemGetAddressRange"):
            base, size = ctypes.c_void_p(), ctypes.c_size_t()
            if not self.library.fn("aclrtMemGetAddressRange")(ctypes.c_void_p(address), ctypes.byref(base),
                                                              ctypes.byref(size)) and base.value == address:
                return size.value
        return -(-nbytes // 32) * 32 + 32

    def free(self, ptr: int) -> None:
        """Free an allocation of :meth:`alloc`; one still open in a peer (its key not closable yet) is freed
        once the peer closed it (at a later allocation, free or :meth:`close`)."""
        self.bind_thread()
        with self._lock:
            self._own.pop(ptr)
            export = self._exports.pop(ptr, None)
            if export is not None:
                self._exports_by_range.pop(ptr)
        if export is not None and self.library.fn("aclrtIpcMemClose")(export.key):
            with self._lock:
                self._closing[ptr] = export.key
            log.debug("NPU memory at %#x is still open in a peer: freed once it closed it", ptr)
        else:
            self.library.call("aclrtFree", ctypes.c_void_p(ptr))
        self._free_closed()

    def withdraw(self, ptr: int) -> None:
        """Caller-owned memory at ``ptr`` goes back to its owner (its cache was unregistered): its export key is
        closed, once peers closed their imports (at a later allocation, free or withdrawal until then), so that
        the owner (torch_npu) can free it."""
        with self._lock:
            found = self._exports_by_range.find(ptr)
            if found is None:
                return
            base = found[0]
            export = self._exports.pop(base)
            self._exports_by_range.pop(base)
            self._closing[base] = export.key
            self._borrowed.add(base)
        self._free_closed()

    def _free_closed(self) -> None:
        """Close the keys whose importers let go meanwhile, freeing the memory that is this process's."""
        with self._lock:
            if not self._closing:
                return
            closing = list(self._closing.items())
        self.bind_thread()
        for ptr, key in closing:
            if self.library.fn("aclrtIpcMemClose")(key):
                continue
            with self._lock:
                self._closing.pop(ptr, None)
                borrowed = ptr in self._borrowed
                self._borrowed.discard(ptr)
            if borrowed:
                continue
            result = self.library.fn("aclrtFree")(ctypes.c_void_p(ptr))
            if result:
                log.warning("%s", self.library.error("aclrtFree", result))

    def copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        """A synchronous ``aclrtMemcpy`` (for checks and tests)."""
        self.bind_thread()
        self.library.call("aclrtMemcpy", ctypes.c_void_p(dst), nbytes, ctypes.c_void_p(src), nbytes, kind)

    def attributes(self, ptr: int) -> PtrAttributes | None:
        """``aclrtPointerGetAttributes`` of ``ptr``; None where the runtime lacks it."""
        if not self.library.has("aclrtPointerGetAttributes"):
            return None
        self.bind_thread()
        attributes = PtrAttributes()
        result = self.library.fn("aclrtPointerGetAttributes")(ctypes.c_void_p(ptr), ctypes.byref(attributes))
        return attributes if result == 0 else None

    def is_device_pointer(self, ptr: int) -> bool:
        with self._lock:
            if self._own.find(ptr) is not None or self._imported.find(ptr) is not None:
                return True
        attributes = self.attributes(ptr)
        return (attributes is not None and attributes.location.type == ACL_MEM_LOCATION_TYPE_DEVICE
                and attributes.location.id == self.ordinal)

    def address_range(self, ptr: int, nbytes: int = 0) -> tuple[int, int]:
        """``(base, size)`` of the allocation holding ``ptr``.  Memory from elsewhere: ``aclrtMemGetAddressRange``
        (CANN >= 9.0); before that, ``[ptr, ptr + nbytes)`` rounded out to 2 MiB, exported at once to prove it
        can be shared (``LLM_PARAM_INVALID`` saying why when it cannot)."""
        with self._lock:
            found = self._own.find(ptr) or self._imported.find(ptr) or self._host.find(ptr)
            exported = self._exports_by_range.find(ptr)
        if found is not None:
            return found[0], found[1]
        if self.library.has("aclrtMemGetAddressRange"):
            self.bind_thread()
            base, size = ctypes.c_void_p(), ctypes.c_size_t()
            result = self.library.fn("aclrtMemGetAddressRange")(ctypes.c_void_p(ptr), ctypes.byref(base),
                                                                ctypes.byref(size))
            if result == 0:
                return base.value or 0, size.value
            if result != ACL_ERROR_API_NOT_SUPPORT:
                raise self._param_invalid(ptr, self.library.error("aclrtMemGetAddressRange", result))
        start = ptr // HUGE_PAGE * HUGE_PAGE
        end = -(-(ptr + max(nbytes, 1)) // HUGE_PAGE) * HUGE_PAGE
        if exported is not None and ptr + nbytes <= exported[0] + exported[1]:
            return exported[0], exported[1]
        try:
            self._export(start, end - start, None)
        except LLMException as exc:
            raise self._param_invalid(ptr, exc) from exc
        return start, end - start

    def _param_invalid(self, ptr: int, why: Exception) -> LLMException:
        return LLMException(f"NPU memory at {ptr:#x} cannot be shared with peers: {why} (this CANN has no "
                            "aclrtMemGetAddressRange to find its allocation, so the range rounded out to 2 MiB "
                            "was exported, as llm_datadist requires 2 MiB-aligned caches)",
                            status_code=LLMStatusCode.LLM_PARAM_INVALID)

    # -- host memory ---------------------------------------------------------------------------------------------
    def alloc_pinned(self, nbytes: int) -> int:
        self.bind_thread()
        ptr = ctypes.c_void_p()
        self.library.call("aclrtMallocHost", ctypes.byref(ptr), max(1, nbytes))
        address = ptr.value or 0
        with self._lock:
            self._host.add(address, nbytes, "malloc")
        return address

    def free_pinned(self, ptr: int) -> None:
        self.bind_thread()
        with self._lock:
            self._host.pop(ptr)
        self.library.call("aclrtFreeHost", ctypes.c_void_p(ptr))

    def register_host(self, addr: int, nbytes: int) -> int:
        """Page-lock host memory for copies (``aclrtHostRegisterV2`` with ``ACL_HOST_REG_PINNED``).  Where the
        runtime cannot, the memory stays pageable: ACL then copies it synchronously, so the executor issues those
        copies from a worker thread.  Returns ``addr`` (ACL copies take host addresses)."""
        self.bind_thread()
        how = "pageable"
        if self.library.has("aclrtHostRegisterV2"):
            result = self.library.fn("aclrtHostRegisterV2")(ctypes.c_void_p(addr), nbytes, ACL_HOST_REG_PINNED)
            if result == 0:
                how = "registered"
            elif result not in (ACL_ERROR_RT_FEATURE_NOT_SUPPORT, ACL_ERROR_API_NOT_SUPPORT):
                raise self.library.error("aclrtHostRegisterV2", result)
        if how == "pageable":
            log.info("host memory at %#x (%d bytes) cannot be page-locked by this ACL runtime: its NPU copies "
                     "run synchronously, from a worker thread", addr, nbytes)
        with self._lock:
            self._host.add(addr, nbytes, how)
        return addr

    def unregister_host(self, addr: int) -> None:
        with self._lock:
            found = self._host.pop(addr)
        if found is not None and found[1] == "registered":
            self.bind_thread()
            self.library.call("aclrtHostUnregister", ctypes.c_void_p(addr))

    def host_kind(self, addr: int) -> str:
        """``"malloc"``/``"registered"`` (page-locked), ``"pageable"`` (registered with this device but not
        page-locked) or ``"unknown"``."""
        with self._lock:
            found = self._host.find(addr)
        return str(found[2]) if found is not None else "unknown"

    # -- IPC ------------------------------------------------------------------------------------------------------
    def ipc_handle(self, ptr: int, importer: int | None = None) -> bytes:
        """The export key of the allocation at ``ptr`` (exported once).  ``importer``: the importing process's
        bare TGID, whitelisted on the key; a key first exported without one has PID validation off."""
        base, size = self.address_range(ptr)
        return self._export(base, size, importer)

    def _export(self, base: int, size: int, importer: int | None) -> bytes:
        lib = self.library
        self.bind_thread()
        with self._lock:
            export = self._exports.get(base)
        if export is None:
            whitelist = importer is not None and lib.has("aclrtIpcMemSetImportPid")
            flags = (ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT if whitelist
                     else ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
            key = ctypes.create_string_buffer(ACL_IPC_KEY_BYTES)
            result = lib.fn("aclrtIpcMemGetExportKey")(ctypes.c_void_p(base), size, key, ACL_IPC_KEY_BYTES, flags)
            if result:
                error = lib.error("aclrtIpcMemGetExportKey", result)
                raise AclError(f"{error} (NPU memory at {base:#x}, {size} bytes, cannot be shared by an IPC key: "
                               "it must be one aclrtMalloc allocation, page-aligned; torch_npu's expandable segments "
                               "(VMM memory) cannot, so run the engine with PYTORCH_NPU_ALLOC_CONF="
                               "expandable_segments:False)", status_code=error.status_code, result=result,
                               function="aclrtIpcMemGetExportKey")
            export = _Export(key.raw, size, whitelist)
            with self._lock:
                self._exports[base] = export
                self._exports_by_range.add(base, size, base)
        if export.whitelist and importer is not None and importer not in export.importers:
            pid = ctypes.c_int32(importer)
            lib.call("aclrtIpcMemSetImportPid", export.key, ctypes.byref(pid), 1)
            export.importers.add(importer)
        return export.key

    def ipc_open(self, key: bytes) -> int:
        if len(key) != ACL_IPC_KEY_BYTES:
            raise LLMException(f"an ACL IPC key is {ACL_IPC_KEY_BYTES} bytes, not {len(key)}: the peer's device "
                               "memory is another runtime's", status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        self.bind_thread()
        ptr = ctypes.c_void_p()
        self.library.call("aclrtIpcMemImportByKey", ctypes.byref(ptr), key, ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS)
        address = ptr.value or 0
        size = self._imported_size(address)
        with self._lock:
            self._imported.add(address, size, key)
        return address

    def _imported_size(self, address: int) -> int:
        if self.library.has("aclrtMemGetAddressRange"):
            base, size = ctypes.c_void_p(), ctypes.c_size_t()
            if not self.library.fn("aclrtMemGetAddressRange")(ctypes.c_void_p(address), ctypes.byref(base),
                                                              ctypes.byref(size)):
                return size.value - (address - (base.value or 0))
        return 1  # unknown: the peer's descriptor bounds what is read (LinkDeviceState checks it)

    def ipc_close(self, ptr: int) -> None:
        with self._lock:
            found = self._imported.pop(ptr)
        if found is None:
            raise AclError(f"no peer NPU memory is open at {ptr:#x}", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        self.bind_thread()
        key = found[1]
        assert isinstance(key, bytes)
        self.library.call("aclrtIpcMemClose", key)

    def close(self) -> None:
        """Free what peers let go of meanwhile (nothing else: the memory is its owners')."""
        self._free_closed()


_devices: dict[tuple[int, int], AclDevice] = {}
_devices_lock = threading.Lock()


def acl_device(ordinal: int) -> AclDevice:
    """The shared :class:`AclDevice` of NPU ``ordinal`` (one per process, library and ordinal); raises
    ``LLM_FEATURE_NOT_ENABLED`` saying why without a usable runtime or that NPU."""
    library = acl_library()
    if not 0 <= ordinal < library.device_count:
        raise AclUnavailable(f"NPU {ordinal} does not exist: the ACL runtime sees {library.device_count}")
    with _devices_lock:
        found = _devices.get((id(library), ordinal))
        if found is None:
            found = _devices[(id(library), ordinal)] = AclDevice(library, ordinal)
        return found
