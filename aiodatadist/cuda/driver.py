"""The CUDA driver API (``libcuda.so.1``) through ctypes: no compiler, no CUDA toolkit, no torch needed.

:func:`cuda_driver` loads the library on first use (importing this module loads nothing) and raises
:class:`CudaUnavailable` saying why when there is no usable driver or device.  A :class:`Device` works in its
GPU's *primary* context, the one the CUDA runtime (and so torch) uses, so memory is shared with them.

Every failing driver call raises :class:`CudaError` (an :class:`~aiodatadist.errors.LLMException`) with the
message ``"cuXxx failed: CUDA_ERROR_NAME (description)"``.

Environment: ``AIODATADIST_LIBCUDA`` names the driver library to load (several separated by ``:``; nothing
else is tried then).
"""

from __future__ import annotations

import ctypes
import glob
import os
import site
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from ..errors import DeviceCallError, LLMException, LLMStatusCode
from ..settings.environment import ENV_LIBCUDA as _ENV_LIBCUDA
from ..settings.environment import env_knobs

__all__ = [
    "ENV_LIBCUDA",
    "HOST_FN",
    "STREAM_CALLBACK",
    "CUipcMemHandle",
    "CudaDriver",
    "CudaError",
    "CudaUnavailable",
    "Device",
    "cuda_driver",
    "cuda_status",
    "get_device",
    "search_paths",
]

ENV_LIBCUDA: Final = _ENV_LIBCUDA

CUDA_SUCCESS: Final = 0
CUDA_ERROR_INVALID_VALUE: Final = 1
CUDA_ERROR_OUT_OF_MEMORY: Final = 2
CUDA_ERROR_STUB_LIBRARY: Final = 34
CUDA_ERROR_NO_DEVICE: Final = 100
CUDA_ERROR_NOT_READY: Final = 600

CU_IPC_HANDLE_SIZE: Final = 64
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: Final = 0x1
CU_MEMHOSTALLOC_PORTABLE: Final = 0x1
CU_MEMHOSTALLOC_DEVICEMAP: Final = 0x2
CU_MEMHOSTREGISTER_PORTABLE: Final = 0x1
CU_MEMHOSTREGISTER_DEVICEMAP: Final = 0x2
CU_STREAM_NON_BLOCKING: Final = 0x1
CU_EVENT_DISABLE_TIMING: Final = 0x2
CU_POINTER_ATTRIBUTE_MEMORY_TYPE: Final = 2
CU_MEMORYTYPE_HOST: Final = 1
CU_MEMORYTYPE_DEVICE: Final = 2
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: Final = 16
CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: Final = 19
CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: Final = 41
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: Final = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: Final = 76

_SEARCH_DIRS: Final = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/nvidia/lib64",
    "/usr/local/nvidia/lib",
    "/usr/lib/wsl/lib",
)
_NAMES: Final = ("libcuda.so.1", "libcuda.so")


class CUipcMemHandle(ctypes.Structure):
    """``CUipcMemHandle`` / ``cudaIpcMemHandle_t``: 64 opaque bytes, passed *by value* to
    ``cuIpcOpenMemHandle``.  Use ``bytes(handle)`` (the ``reserved`` attribute stops at the first NUL)."""

    _fields_ = [("reserved", ctypes.c_char * CU_IPC_HANDLE_SIZE)]


HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
"""``CUhostFn``: ``void fn(void* userData)`` (``cuLaunchHostFunc``)."""

STREAM_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
"""``CUstreamCallback``: ``void fn(CUstream, CUresult status, void* userData)`` (``cuStreamAddCallback``)."""

_vp, _u64, _sz, _uint, _int = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int
_P = ctypes.POINTER

# name -> argtypes (every function returns CUresult).  Where cuda.h maps a name to a versioned symbol, that
# symbol is bound; _FALLBACKS lists older names for drivers that predate the versioned one.
_SIGNATURES: Final[dict[str, list[Any]]] = {
    "cuInit": [_uint],
    "cuDriverGetVersion": [_P(_int)],
    "cuGetErrorName": [_int, _P(ctypes.c_char_p)],
    "cuGetErrorString": [_int, _P(ctypes.c_char_p)],
    "cuDeviceGetCount": [_P(_int)],
    "cuDeviceGet": [_P(_int), _int],
    "cuDeviceGetName": [ctypes.c_char_p, _int, _int],
    "cuDeviceGetAttribute": [_P(_int), _int, _int],
    "cuDevicePrimaryCtxRetain": [_P(_vp), _int],
    "cuDevicePrimaryCtxRelease_v2": [_int],
    "cuCtxSetCurrent": [_vp],
    "cuCtxGetCurrent": [_P(_vp)],
    "cuCtxSynchronize": [],
    "cuMemAlloc_v2": [_P(_u64), _sz],
    "cuMemFree_v2": [_u64],
    "cuMemcpyHtoD_v2": [_u64, _vp, _sz],
    "cuMemcpyDtoH_v2": [_vp, _u64, _sz],
    "cuMemcpyDtoD_v2": [_u64, _u64, _sz],
    "cuMemcpyAsync": [_u64, _u64, _sz, _vp],
    "cuMemcpyHtoDAsync_v2": [_u64, _vp, _sz, _vp],
    "cuMemsetD8_v2": [_u64, ctypes.c_ubyte, _sz],
    "cuMemHostRegister_v2": [_vp, _sz, _uint],
    "cuMemHostUnregister": [_vp],
    "cuMemHostGetDevicePointer_v2": [_P(_u64), _vp, _uint],
    "cuMemHostAlloc": [_P(_vp), _sz, _uint],
    "cuMemFreeHost": [_vp],
    "cuMemGetAddressRange_v2": [_P(_u64), _P(_sz), _u64],
    "cuPointerGetAttribute": [_vp, _int, _u64],
    "cuStreamCreate": [_P(_vp), _uint],
    "cuStreamDestroy_v2": [_vp],
    "cuStreamSynchronize": [_vp],
    "cuStreamQuery": [_vp],
    "cuStreamAddCallback": [_vp, STREAM_CALLBACK, _vp, _uint],
    "cuLaunchHostFunc": [_vp, HOST_FN, _vp],
    "cuEventCreate": [_P(_vp), _uint],
    "cuEventDestroy_v2": [_vp],
    "cuEventRecord": [_vp, _vp],
    "cuEventQuery": [_vp],
    "cuEventSynchronize": [_vp],
    "cuEventElapsedTime_v2": [_P(ctypes.c_float), _vp, _vp],
    "cuModuleLoadData": [_P(_vp), _vp],
    "cuModuleUnload": [_vp],
    "cuModuleGetFunction": [_P(_vp), _vp, ctypes.c_char_p],
    "cuLaunchKernel": [_vp, _uint, _uint, _uint, _uint, _uint, _uint, _uint, _vp, _P(_vp), _P(_vp)],
    "cuIpcGetMemHandle": [_P(CUipcMemHandle), _u64],
    "cuIpcOpenMemHandle_v2": [_P(_u64), CUipcMemHandle, _uint],
    "cuIpcCloseMemHandle": [_u64],
}
# cuEventElapsedTime_v2 appeared with CUDA 12.8 drivers; the older symbol has the same signature.
_FALLBACKS: Final[dict[str, tuple[str, ...]]] = {"cuEventElapsedTime_v2": ("cuEventElapsedTime",)}


class CudaUnavailable(LLMException):
    """No usable CUDA driver or device (``LLM_FEATURE_NOT_ENABLED``); the message says why."""

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_FEATURE_NOT_ENABLED) -> None:
        super().__init__(*args, status_code=status_code)


class CudaError(DeviceCallError):
    """A CUDA driver call failed: ``function`` is the call, ``result`` its ``CUresult``.

    The status is ``LLM_DEVICE_OUT_OF_MEMORY`` for ``CUDA_ERROR_OUT_OF_MEMORY``, else ``LLM_DEVICE_MEM_ERROR``.
    """


def _status_for(result: int) -> LLMStatusCode:
    if result == CUDA_ERROR_OUT_OF_MEMORY:
        return LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
    return LLMStatusCode.LLM_DEVICE_MEM_ERROR


# -- loading ------------------------------------------------------------------------------------------------


def _site_dirs() -> list[str]:
    roots: list[str] = []
    try:
        roots.extend(site.getsitepackages())
    except AttributeError:  # old virtualenv's site module
        pass
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else ""
    if isinstance(user, str) and user:
        roots.append(user)
    roots.extend(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    found: list[str] = []
    for root in dict.fromkeys(roots):
        found.extend(sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib"))))
    return found


def _search_dirs() -> list[str]:
    dirs = list(_SEARCH_DIRS)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var, "")
        if home:
            dirs += [os.path.join(home, "lib64"), os.path.join(home, "lib")]
    return [d for d in dict.fromkeys(dirs + _site_dirs()) if not _is_stub(d)]


def search_paths() -> list[str]:
    """Where :func:`cuda_driver` looks for the driver library, in order (``AIODATADIST_LIBCUDA`` alone if set):
    ``libcuda.so.1`` and ``libcuda.so`` through the dynamic loader, then in the usual install directories,
    ``$CUDA_HOME/lib64`` and the ``nvidia/*/lib`` directories of pip wheels.  A library in a ``stubs/``
    directory (link-time only) is never used."""
    configured = env_knobs().libcuda
    if configured:
        return list(configured)
    paths = [*_NAMES, *(os.path.join(d, n) for d in _search_dirs() for n in _NAMES)]
    return [p for p in dict.fromkeys(paths) if not _is_stub(p)]


def _where_looked() -> str:
    if env_knobs().libcuda:
        return f"looked for {', '.join(search_paths()) or '(nothing)'} (from {ENV_LIBCUDA})"
    return (f"looked for {' and '.join(_NAMES)} through the dynamic loader (LD_LIBRARY_PATH, ldconfig) and in "
            f"{', '.join(_search_dirs())}; set {ENV_LIBCUDA} to the library's path")


def _is_stub(path: str) -> bool:
    return "stubs" in Path(path).parts


def _mapped_path(address: int) -> str | None:
    """The file mapped at ``address`` in this process (``/proc/self/maps``), or None if unknown."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                lo, _, hi = fields[0].partition("-")
                if int(lo, 16) <= address < int(hi, 16):
                    return fields[5].strip() if len(fields) == 6 else None
    except (OSError, ValueError, IndexError):
        pass
    return None


def _open_driver() -> CudaDriver:
    """Load, bind and initialise the driver (uncached; :func:`cuda_driver` caches it)."""
    notes: list[str] = []
    candidates = search_paths()
    for candidate in candidates:
        if _is_stub(candidate):  # link-time only: never loaded
            notes.append(f"{candidate}: a stubs/ library, not loaded")
            continue
        if os.sep in candidate and not os.path.exists(candidate):
            continue
        try:
            lib = ctypes.CDLL(candidate)
            init = lib.cuInit
        except (OSError, AttributeError) as exc:
            if "No such file" not in str(exc):  # found but unusable (another architecture, not a driver, ...)
                notes.append(f"{candidate}: {exc}")
            continue
        real = _mapped_path(ctypes.cast(init, ctypes.c_void_p).value or 0) or candidate
        if _is_stub(real):  # found by name through LD_LIBRARY_PATH: loaded, but never initialised or used
            notes.append(f"{real}: a stubs/ library, skipped")
            continue
        init.argtypes, init.restype = [ctypes.c_uint], ctypes.c_int
        result = int(init(0))
        if result == CUDA_ERROR_STUB_LIBRARY:
            notes.append(f"{real}: a stub library (CUDA_ERROR_STUB_LIBRARY), skipped")
            continue
        driver = CudaDriver(lib, real)  # binds every symbol (CudaUnavailable if one is missing)
        if result != CUDA_SUCCESS:
            raise CudaUnavailable(f"CUDA driver at {real}: cuInit failed: {driver.describe(result)}")
        return driver
    detail = f" ({'; '.join(notes)})" if notes else ""
    raise CudaUnavailable(f"CUDA driver library (libcuda.so.1) not found{detail}: {_where_looked()}")


_driver: CudaDriver | None = None
_driver_lock = threading.Lock()
_per_thread = threading.local()


def cuda_driver() -> CudaDriver:
    """The process's :class:`CudaDriver`, loaded and initialised on first use.

    Raises :class:`CudaUnavailable` (``LLM_FEATURE_NOT_ENABLED``) saying why: library not found (and where it
    looked), ``cuInit`` failed (error name and text), or no device is visible.  A failure is not cached.
    """
    global _driver
    driver = _driver
    if driver is not None:
        return driver
    with _driver_lock:
        if _driver is None:
            loaded = _open_driver()
            if loaded.device_count < 1:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                note = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
                raise CudaUnavailable(f"CUDA driver {loaded.version_string} at {loaded.path}: no CUDA device"
                                      f"{note}")
            _driver = loaded
        return _driver


def cuda_status() -> str:
    """One line for ``aiodatadist info``: driver version and devices, or why CUDA cannot be used."""
    try:
        driver = cuda_driver()
    except CudaUnavailable as exc:
        return f"CUDA unavailable: {exc}"
    names: list[str] = []
    for ordinal in range(driver.device_count):
        try:
            names.append(driver.device_name(ordinal))
        except CudaError as exc:
            names.append(f"device {ordinal} ({exc})")
    counts = dict.fromkeys(names, 0)
    for name in names:
        counts[name] += 1
    listed = ", ".join(name if n == 1 else f"{n}x {name}" for name, n in counts.items())
    return f"CUDA driver {driver.version_string}, {driver.device_count} device(s): {listed}"


def get_device(ordinal: int = 0) -> Device:
    """The shared :class:`Device` for ``ordinal`` (see :meth:`CudaDriver.device`)."""
    return cuda_driver().device(ordinal)


class CudaDriver:
    """The loaded driver library with every function used here bound (``argtypes``/``restype`` declared)."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib = lib
        self.path = path
        self._fns: dict[str, Callable[..., Any]] = {}
        for name, argtypes in _SIGNATURES.items():
            for symbol in (name, *_FALLBACKS.get(name, ())):
                try:
                    fn = getattr(lib, symbol)
                except AttributeError:
                    continue
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                self._fns[name] = fn
                break
            else:
                raise CudaUnavailable(f"CUDA driver at {path} lacks {name} (driver too old?)")
        self._devices: dict[int, Device] = {}
        self._lock = threading.Lock()
        version = ctypes.c_int()
        count = ctypes.c_int()
        if self._fns["cuDriverGetVersion"](ctypes.byref(version)) != CUDA_SUCCESS:
            version.value = 0
        self.version = version.value
        """``cuDriverGetVersion``: 1000 * major + 10 * minor (13000 for 13.0)."""
        result = int(self._fns["cuDeviceGetCount"](ctypes.byref(count)))
        self.device_count = count.value if result == CUDA_SUCCESS else 0
        """Devices visible to this process (after ``CUDA_VISIBLE_DEVICES``)."""

    @property
    def version_string(self) -> str:
        """The driver's CUDA version, e.g. ``"13.0"``."""
        return f"{self.version // 1000}.{self.version % 1000 // 10}"

    def fn(self, name: str) -> Callable[..., Any]:
        """The bound foreign function ``name`` (as spelled in ``_SIGNATURES``); returns a raw ``CUresult``."""
        return self._fns[name]

    def call(self, name: str, *args: Any) -> None:
        """Call ``name`` and raise :class:`CudaError` unless it returns ``CUDA_SUCCESS``."""
        result = self._fns[name](*args)
        if result != CUDA_SUCCESS:
            raise self.error(name, int(result))

    def error(self, name: str, result: int) -> CudaError:
        """The exception for ``name`` returning ``result``."""
        return CudaError(f"{name} failed: {self.describe(result)}", status_code=_status_for(result),
                         result=result, function=name)

    def describe(self, result: int) -> str:
        """``"CUDA_ERROR_NAME (description)"`` for a ``CUresult``."""
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        if self._fns["cuGetErrorName"](result, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return f"CUresult {result}"
        if self._fns["cuGetErrorString"](result, ctypes.byref(text)) != CUDA_SUCCESS or not text.value:
            return name.value.decode(errors="replace")
        return f"{name.value.decode(errors='replace')} ({text.value.decode(errors='replace')})"

    def device_name(self, ordinal: int) -> str:
        """The name of device ``ordinal`` (no context is created)."""
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        buf = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", buf, len(buf), dev.value)
        return buf.value.decode(errors="replace")

    def device(self, ordinal: int = 0) -> Device:
        """The shared :class:`Device` for ``ordinal``, created (primary context retained) on first use."""
        with self._lock:
            dev = self._devices.get(ordinal)
            if dev is None:
                dev = self._devices[ordinal] = Device(ordinal, self)
            return dev


class Device:
    """One GPU, used through its primary context (shared with the CUDA runtime and torch in this process).

    Every method first makes that context current on the calling thread (one ``cuCtxGetCurrent``; a
    ``cuCtxSetCurrent`` only when another context is current) and leaves it current, as ``cudaSetDevice``
    would.  Addresses are plain ints; with unified addressing (every 64-bit platform CUDA still supports) a
    device pointer, an IPC-opened pointer and a registered host address are all valid kernel arguments.
    Calls are not synchronised beyond what the driver does: the copy helpers are for tests and tools.
    """

    def __init__(self, ordinal: int = 0, driver: CudaDriver | None = None) -> None:
        self.driver = driver if driver is not None else cuda_driver()
        count = self.driver.device_count
        if not 0 <= ordinal < count:
            raise CudaUnavailable(f"CUDA device {ordinal} out of range: {count} device(s) visible")
        self.ordinal = ordinal
        """The device's ordinal among the visible devices."""
        dev = ctypes.c_int()
        self.driver.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        self._dev = dev.value
        self.name = self.driver.device_name(ordinal)
        """The device's name, e.g. ``"NVIDIA H100 80GB HBM3"``."""
        ctx = ctypes.c_void_p()
        self.driver.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self._dev)
        self._ctx: int = ctx.value or 0
        self._released = False
        self.sm_count = self.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        """Number of streaming multiprocessors."""
        self.compute_capability = (self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                                   self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        """``(major, minor)``, e.g. ``(9, 0)`` for H100."""
        self._get_current = self.driver.fn("cuCtxGetCurrent")

    def __repr__(self) -> str:
        return f"Device({self.ordinal}, {self.name!r})"

    @property
    def context(self) -> int:
        """The primary context's handle (``CUcontext`` as an int)."""
        return self._ctx

    def make_current(self) -> None:
        """Make the device's primary context current on this thread (a no-op when it already is)."""
        try:
            current = _per_thread.current  # (one out-parameter per thread: half the cost of a new one per call)
        except AttributeError:
            current = _per_thread.current = ctypes.c_void_p()
        if self._get_current(current) != CUDA_SUCCESS or current.value != self._ctx:
            if self._released:
                raise CudaUnavailable(f"{self!r} was released")
            self.driver.call("cuCtxSetCurrent", ctypes.c_void_p(self._ctx))

    def attribute(self, attribute: int) -> int:
        """``cuDeviceGetAttribute`` (a ``CU_DEVICE_ATTRIBUTE_*`` number)."""
        value = ctypes.c_int()
        self.driver.call("cuDeviceGetAttribute", ctypes.byref(value), attribute, self._dev)
        return value.value

    def synchronize(self) -> None:
        """Wait until all work of the context (every stream) is done."""
        self.make_current()
        self.driver.call("cuCtxSynchronize")

    def release(self) -> None:
        """Drop this object's reference to the primary context.  The last release destroys the context and
        everything allocated in it, so only call it once no memory of the device is in use; shared devices
        (:func:`get_device`) are never released."""
        if not self._released:
            self._released = True
            self.driver.call("cuDevicePrimaryCtxRelease_v2", self._dev)

    # -- device memory ------------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> int:
        """``cuMemAlloc``: ``nbytes`` of device memory (256-byte aligned); free with :meth:`free`."""
        self.make_current()
        ptr = ctypes.c_uint64()
        self.driver.call("cuMemAlloc_v2", ctypes.byref(ptr), nbytes)
        return ptr.value

    def free(self, ptr: int) -> None:
        """``cuMemFree`` of an :meth:`alloc` pointer."""
        self.make_current()
        self.driver.call("cuMemFree_v2", ptr)

    def memset(self, ptr: int, byte: int, nbytes: int) -> None:
        """Set ``nbytes`` at device address ``ptr`` to ``byte``; returns once done."""
        self.make_current()
        self.driver.call("cuMemsetD8_v2", ptr, byte & 0xFF, nbytes)
        self.driver.call("cuCtxSynchronize")

    def copy_htod(self, dst: int, src_host_addr: int, nbytes: int) -> None:
        """Copy ``nbytes`` from host address ``src_host_addr`` to device address ``dst``; returns once done."""
        self.make_current()
        self.driver.call("cuMemcpyHtoD_v2", dst, src_host_addr, nbytes)
        self.driver.call("cuCtxSynchronize")

    def copy_dtoh(self, dst_host_addr: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from device address ``src`` to host address ``dst_host_addr``; returns once done
        (after the context's other work: it synchronises first, so work on non-blocking streams is included)."""
        self.make_current()
        self.driver.call("cuCtxSynchronize")
        self.driver.call("cuMemcpyDtoH_v2", dst_host_addr, src, nbytes)

    def copy_dtod(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` between device addresses; returns once done."""
        self.make_current()
        self.driver.call("cuMemcpyDtoD_v2", dst, src, nbytes)
        self.driver.call("cuCtxSynchronize")

    def address_range(self, ptr: int) -> tuple[int, int]:
        """``(base, size)`` of the device allocation containing ``ptr`` (``cuMemGetAddressRange``)."""
        self.make_current()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.driver.call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
        return base.value, size.value

    def is_device_pointer(self, ptr: int) -> bool:
        """Whether ``ptr`` is device memory known to CUDA (allocated, or IPC-opened, in this process); False
        for host memory, registered or not, and on any error."""
        self.make_current()
        kind = ctypes.c_uint(0)
        result = self.driver.fn("cuPointerGetAttribute")(ctypes.byref(kind), CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                                           ptr)
        return bool(result == CUDA_SUCCESS and kind.value == CU_MEMORYTYPE_DEVICE)

    # -- IPC ------------------------------------------------------------------------------------------------

    def ipc_handle(self, ptr: int) -> bytes:
        """The 64-byte IPC handle of the allocation that starts at ``ptr`` (``cuIpcGetMemHandle``).

        ``ptr`` must be an allocation's base (see :meth:`address_range`): a handle always maps the whole
        allocation, so another process would otherwise get a pointer to the base, not to ``ptr``.
        """
        self.make_current()
        base, _ = self.address_range(ptr)
        if base != ptr:
            raise LLMException(f"ipc_handle: {ptr:#x} is not an allocation's base ({base:#x}); send the base "
                               "and the offset", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        handle = CUipcMemHandle()
        self.driver.call("cuIpcGetMemHandle", ctypes.byref(handle), ptr)
        return bytes(handle)

    def ipc_open(self, handle: bytes) -> int:
        """Map another process's allocation (its :meth:`ipc_handle` bytes) into this one; returns the base
        address.  Close it with :meth:`ipc_close`.  A handle can be open only once per process at a time."""
        if len(handle) != CU_IPC_HANDLE_SIZE:
            raise LLMException(f"an IPC handle has {CU_IPC_HANDLE_SIZE} bytes, not {len(handle)}",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        self.make_current()
        ptr = ctypes.c_uint64()
        self.driver.call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), CUipcMemHandle.from_buffer_copy(handle),
                         CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        """Unmap an :meth:`ipc_open` mapping (after the work that uses it is done)."""
        self.make_current()
        self.driver.call("cuIpcCloseMemHandle", ptr)

    # -- host memory ------------------------------------------------------------------------------------------

    def register_host(self, addr: int, nbytes: int) -> int:
        """Page-lock and map ``nbytes`` of host memory at ``addr`` (``cuMemHostRegister``, portable, mapped);
        returns its device pointer (equal to ``addr`` with unified addressing).  Undo with
        :meth:`unregister_host` before the memory is freed."""
        self.make_current()
        self.driver.call("cuMemHostRegister_v2", ctypes.c_void_p(addr), nbytes,
                         CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP)
        try:
            return self.host_device_pointer(addr)
        except CudaError:
            self.driver.fn("cuMemHostUnregister")(ctypes.c_void_p(addr))
            raise

    def unregister_host(self, addr: int) -> None:
        """Undo :meth:`register_host` (``addr`` as registered)."""
        self.make_current()
        self.driver.call("cuMemHostUnregister", ctypes.c_void_p(addr))

    def host_device_pointer(self, addr: int) -> int:
        """The device pointer of registered or pinned host memory (``cuMemHostGetDevicePointer``)."""
        self.make_current()
        dptr = ctypes.c_uint64()
        self.driver.call("cuMemHostGetDevicePointer_v2", ctypes.byref(dptr), ctypes.c_void_p(addr), 0)
        return dptr.value

    def alloc_pinned(self, nbytes: int) -> int:
        """``nbytes`` of page-locked, mapped host memory (``cuMemHostAlloc``, portable); its host address, which
        is also its device pointer with unified addressing.  Free with :meth:`free_pinned`."""
        self.make_current()
        ptr = ctypes.c_void_p()
        self.driver.call("cuMemHostAlloc", ctypes.byref(ptr), nbytes,
                         CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP)
        return ptr.value or 0

    def free_pinned(self, ptr: int) -> None:
        """Free :meth:`alloc_pinned` memory."""
        self.make_current()
        self.driver.call("cuMemFreeHost", ctypes.c_void_p(ptr))
