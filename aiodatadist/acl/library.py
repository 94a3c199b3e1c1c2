"""Ascend's ACL runtime (``libascendcl.so``) through ctypes: no compiler, no CANN headers, no torch_npu needed.

:func:`acl_library` loads the library on first use (importing this module loads nothing), calls ``aclInit``
(``ACL_ERROR_REPEAT_INITIALIZE`` counts as success: torch_npu may have initialised it) and raises
:class:`AclUnavailable` saying why when there is no usable runtime or device.  It never calls ``aclFinalize``:
torch_npu may share the runtime, and a finalize would pull it from under it.

Every failing call raises :class:`AclError` (an :class:`~aiodatadist.errors.LLMException`) with the message
``"aclXxx failed: <code> (<name>): <aclGetRecentErrMsg>"``; ACL's message is per thread, so it is read on the
thread whose call failed.

Environment: ``AIODATADIST_LIBASCENDCL`` names the library to load (several separated by ``:``; nothing else is
tried then).  Otherwise ``libascendcl.so`` is looked for through the dynamic loader, then in
``$ASCEND_HOME_PATH/lib64``, ``$ASCEND_TOOLKIT_HOME/lib64``, ``/usr/local/Ascend/ascend-toolkit/latest/lib64``
and ``/usr/local/Ascend/cann/lib64``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any, Final

from ..errors import DeviceCallError, LLMException, LLMStatusCode
from ..settings.environment import ENV_LIBASCENDCL, env_knobs

__all__ = [
    "ENV_LIBASCENDCL",
    "AclError",
    "AclLibrary",
    "AclUnavailable",
    "acl_library",
    "acl_status",
    "search_paths",
]

ACL_SUCCESS: Final = 0
ACL_ERROR_INVALID_PARAM: Final = 100000
ACL_ERROR_REPEAT_INITIALIZE: Final = 100002
ACL_ERROR_COMPILING_STUB_MODE: Final = 100039
ACL_ERROR_BAD_ALLOC: Final = 200000
ACL_ERROR_API_NOT_SUPPORT: Final = 200001
ACL_ERROR_RT_CONTEXT_NULL: Final = 107002
ACL_ERROR_RT_FEATURE_NOT_SUPPORT: Final = 207000
ACL_ERROR_RT_MEMORY_ALLOCATION: Final = 207001
ACL_ERROR_RT_DEVICE_OOM: Final = 207018
ACL_ERROR_RT_STREAM_SYNC_TIMEOUT: Final = 507046
ACL_ERROR_RT_EVENT_SYNC_TIMEOUT: Final = 507047

_NAMES_BY_CODE: Final = {
    100000: "ACL_ERROR_INVALID_PARAM", 100001: "ACL_ERROR_UNINITIALIZE", 100002: "ACL_ERROR_REPEAT_INITIALIZE",
    100039: "ACL_ERROR_COMPILING_STUB_MODE", 200000: "ACL_ERROR_BAD_ALLOC", 200001: "ACL_ERROR_API_NOT_SUPPORT",
    200002: "ACL_ERROR_INVALID_DEVICE", 107000: "ACL_ERROR_RT_PARAM_INVALID", 107001: "ACL_ERROR_RT_INVALID_DEVICEID",
    107002: "ACL_ERROR_RT_CONTEXT_NULL", 107003: "ACL_ERROR_RT_STREAM_CONTEXT", 107008: "ACL_ERROR_RT_ADDR_UNALIGNED",
    207000: "ACL_ERROR_RT_FEATURE_NOT_SUPPORT", 207001: "ACL_ERROR_RT_MEMORY_ALLOCATION",
    207004: "ACL_ERROR_RT_NO_DEVICE", 207018: "ACL_ERROR_RT_DEVICE_OOM", 507000: "ACL_ERROR_RT_INTERNAL_ERROR",
    507022: "ACL_ERROR_RT_IPC_ERROR", 507046: "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT",
    507047: "ACL_ERROR_RT_EVENT_SYNC_TIMEOUT", 507053: "ACL_ERROR_RT_DEVICE_MEM_ERROR",
    507055: "ACL_ERROR_RT_SUSPECT_DEVICE_MEM_ERROR", 507056: "ACL_ERROR_RT_LINK_ERROR",
    507057: "ACL_ERROR_RT_SUSPECT_REMOTE_ERROR",
}
_OUT_OF_MEMORY: Final = frozenset({ACL_ERROR_BAD_ALLOC, ACL_ERROR_RT_MEMORY_ALLOCATION, ACL_ERROR_RT_DEVICE_OOM})

_SEARCH_DIRS: Final = ("/usr/local/Ascend/ascend-toolkit/latest/lib64", "/usr/local/Ascend/cann/lib64")
_NAME: Final = "libascendcl.so"

_vp, _sz, _u32, _i32, _u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64
_P = ctypes.POINTER
_char_p = ctypes.c_char_p

# name -> argtypes (every function returns aclError, an int).  None: optional, absent from older runtimes.
_SIGNATURES: Final[dict[str, list[Any]]] = {
    "aclInit": [_char_p],
    "aclrtGetVersion": [_P(_i32), _P(_i32), _P(_i32)],
    "aclrtGetDeviceCount": [_P(_u32)],
    "aclrtSetDevice": [_i32],
    "aclrtGetCurrentContext": [_P(_vp)],
    "aclrtSetCurrentContext": [_vp],
    "aclrtMalloc": [_P(_vp), _sz, ctypes.c_int],
    "aclrtFree": [_vp],
    "aclrtMallocHost": [_P(_vp), _sz],
    "aclrtFreeHost": [_vp],
    "aclrtMemcpy": [_vp, _sz, _vp, _sz, ctypes.c_int],
    "aclrtMemcpyAsync": [_vp, _sz, _vp, _sz, ctypes.c_int, _vp],
    "aclrtCreateStream": [_P(_vp)],
    "aclrtDestroyStream": [_vp],
    "aclrtSynchronizeStream": [_vp],
    "aclrtStreamQuery": [_vp, _P(ctypes.c_int)],
    "aclrtCreateEvent": [_P(_vp)],
    "aclrtRecordEvent": [_vp, _vp],
    "aclrtQueryEventStatus": [_vp, _P(ctypes.c_int)],
    "aclrtSynchronizeEvent": [_vp],
    "aclrtDestroyEvent": [_vp],
    "aclrtIpcMemGetExportKey": [_vp, _sz, _char_p, _sz, _u64],
    "aclrtIpcMemImportByKey": [_P(_vp), _char_p, _u64],
    "aclrtIpcMemClose": [_char_p],
}
_OPTIONAL: Final[dict[str, list[Any]]] = {
    "aclFinalizeReference": [_P(_u64)],
    "aclsysGetVersionStr": [_char_p, _char_p],
    "aclrtCreateStreamWithConfig": [_P(_vp), _u32, _u32],
    "aclrtSetStreamFailureMode": [_vp, _u64],
    "aclrtStreamAbort": [_vp],
    "aclrtSynchronizeStreamWithTimeout": [_vp, _i32],
    "aclrtCreateEventExWithFlag": [_P(_vp), _u32],
    "aclrtSynchronizeEventWithTimeout": [_vp, _i32],
    "aclrtHostRegisterV2": [_vp, _u64, _u32],
    "aclrtHostUnregister": [_vp],
    "aclrtPointerGetAttributes": [_vp, _vp],
    "aclrtMemGetAddressRange": [_vp, _P(_vp), _P(_sz)],
    "aclrtMemcpyBatchAsync": [_P(_vp), _P(_sz), _P(_vp), _P(_sz), _sz, _vp, _P(_sz), _sz, _P(_sz), _vp],
    "aclrtIpcMemSetImportPid": [_char_p, _P(_i32), _sz],
    "aclrtDeviceGetBareTgid": [_P(_i32)],
    "aclrtGetMemInfo": [ctypes.c_int, _P(_sz), _P(_sz)],
}


class AclUnavailable(LLMException):
    """No usable ACL runtime or device (``LLM_FEATURE_NOT_ENABLED``); the message says why."""

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_FEATURE_NOT_ENABLED) -> None:
        super().__init__(*args, status_code=status_code)


class AclError(DeviceCallError):
    """An ACL call failed: ``function`` is the call, ``result`` its ``aclError``.

    The status is ``LLM_DEVICE_OUT_OF_MEMORY`` for ACL's allocation failures, else ``LLM_DEVICE_MEM_ERROR``.
    """


def describe(result: int) -> str:
    """``"507053 (ACL_ERROR_RT_DEVICE_MEM_ERROR)"``."""
    name = _NAMES_BY_CODE.get(result)
    return f"{result} ({name})" if name else str(result)


# -- loading ------------------------------------------------------------------------------------------------


def _search_dirs() -> list[str]:
    dirs = [os.path.join(os.environ[var], "lib64") for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
            if os.environ.get(var)]
    return list(dict.fromkeys([*dirs, *_SEARCH_DIRS]))


def search_paths() -> list[str]:
    """Where :func:`acl_library` looks for ``libascendcl.so``, in order (``AIODATADIST_LIBASCENDCL`` alone if
    set)."""
    configured = env_knobs().libascendcl
    if configured:
        return list(configured)
    return [_NAME, *(os.path.join(d, _NAME) for d in _search_dirs())]


def _where_looked() -> str:
    if env_knobs().libascendcl:
        return f"looked for {', '.join(search_paths())} (from {ENV_LIBASCENDCL})"
    return (f"looked for {_NAME} through the dynamic loader (LD_LIBRARY_PATH, ldconfig) and in "
            f"{', '.join(_search_dirs())}; set {ENV_LIBASCENDCL} to the library's path")


def _open_library() -> AclLibrary:
    notes: list[str] = []
    for candidate in search_paths():
        if os.sep in candidate and not os.path.exists(candidate):
            continue
        try:
            lib = ctypes.CDLL(candidate)
            init = lib.aclInit
        except (OSError, AttributeError) as exc:
            if "No such file" not in str(exc) and "cannot open shared object" not in str(exc):
                notes.append(f"{candidate}: {exc}")
            continue
        init.argtypes, init.restype = [ctypes.c_char_p], ctypes.c_int
        result = int(init(None))
        if result == ACL_ERROR_COMPILING_STUB_MODE:
            notes.append(f"{candidate}: a stub library (ACL_ERROR_COMPILING_STUB_MODE), skipped")
            continue
        library = AclLibrary(lib, candidate)
        if result not in (ACL_SUCCESS, ACL_ERROR_REPEAT_INITIALIZE):
            raise AclUnavailable(f"ACL runtime at {candidate}: aclInit failed: {library.describe(result)}")
        return library
    detail = f" ({'; '.join(notes)})" if notes else ""
    raise AclUnavailable(f"ACL runtime library ({_NAME}) not found{detail}: {_where_looked()}")


_library: AclLibrary | None = None
_library_lock = threading.Lock()


def acl_library() -> AclLibrary:
    """The process's :class:`AclLibrary`, loaded and initialised on first use.

    Raises :class:`AclUnavailable` (``LLM_FEATURE_NOT_ENABLED``) saying why: library not found (and where it
    looked), a stub library, ``aclInit`` failed, or no device is visible.  A failure is not cached.
    """
    global _library
    library = _library
    if library is not None:
        return library
    with _library_lock:
        if _library is None:
            loaded = _open_library()
            if loaded.device_count < 1:
                visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
                note = f" (ASCEND_RT_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
                raise AclUnavailable(f"ACL runtime {loaded.version_string} at {loaded.path}: no NPU{note}")
            _library = loaded
        return _library


def acl_status() -> str:
    """One line for ``aiodatadist info``: the runtime's version and devices, or why ACL cannot be used."""
    try:
        library = acl_library()
    except AclUnavailable as exc:
        return f"ACL unavailable: {exc}"
    return f"ACL runtime {library.version_string} at {library.path}, {library.device_count} NPU(s)"


class AclLibrary:
    """The loaded runtime with every function used here bound (``argtypes``/``restype`` declared); optional
    ones (newer runtimes only) are None in :attr:`optional` when absent."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib = lib
        self.path = path
        self._fns: dict[str, Callable[..., int]] = {}
        for name, argtypes in _SIGNATURES.items():
            try:
                f = getattr(lib, name)
            except AttributeError as exc:
                raise AclUnavailable(f"ACL runtime at {path} lacks {name}: too old for aiodatadist") from exc
            f.argtypes, f.restype = argtypes, ctypes.c_int
            self._fns[name] = f
        for name, argtypes in _OPTIONAL.items():
            f = getattr(lib, name, None)
            if f is not None:
                f.argtypes, f.restype = argtypes, ctypes.c_int
                self._fns[name] = f
        message = getattr(lib, "aclGetRecentErrMsg", None)
        if message is not None:
            message.argtypes, message.restype = [], ctypes.c_char_p
        self._message = message
        major, minor, patch = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
        self.version = (0, 0, 0)
        if not self._fns["aclrtGetVersion"](ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch)):
            self.version = (major.value, minor.value, patch.value)
        count = ctypes.c_uint32()
        result = self._fns["aclrtGetDeviceCount"](ctypes.byref(count))
        self.device_count = count.value if result == ACL_SUCCESS else 0
        self.cann_version = self._cann_version()

    def _cann_version(self) -> str:
        get = self._fns.get("aclsysGetVersionStr")
        if get is None:
            return ""
        text = ctypes.create_string_buffer(256)
        if get(b"runtime", text):
            return ""
        return text.value.decode(errors="replace")

    @property
    def version_string(self) -> str:
        """``"ACL 1.17.0 (CANN 9.0.0)"``: the ACL API version and, where the runtime says, the CANN package's."""
        api = ".".join(str(v) for v in self.version)
        return f"ACL {api} (CANN {self.cann_version})" if self.cann_version else f"ACL {api}"

    def has(self, name: str) -> bool:
        """Whether the runtime has ``name`` (an optional function)."""
        return name in self._fns

    def fn(self, name: str) -> Callable[..., int]:
        """The bound function ``name`` (raises ``AclError`` ``LLM_FEATURE_NOT_ENABLED`` when this runtime lacks
        an optional one)."""
        f = self._fns.get(name)
        if f is None:
            raise AclError(f"{name} is not in the ACL runtime at {self.path} ({self.version_string})",
                           status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED, result=ACL_ERROR_API_NOT_SUPPORT,
                           function=name)
        return f

    def call(self, name: str, *args: Any) -> None:
        """Call ``name``; raise :class:`AclError` unless it returns ``ACL_SUCCESS``."""
        result = self.fn(name)(*args)
        if result:
            raise self.error(name, result)

    def recent_message(self) -> str:
        """ACL's message of the latest error on this thread (empty if none)."""
        if self._message is None:
            return ""
        text = self._message()
        return text.decode(errors="replace").strip() if text else ""

    def error(self, name: str, result: int) -> AclError:
        """The exception of ``name`` having returned ``result`` (on this thread: ACL's message is per thread)."""
        message = self.recent_message()
        status = (LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY if result in _OUT_OF_MEMORY
                  else LLMStatusCode.LLM_DEVICE_MEM_ERROR)
        detail = f": {message}" if message else ""
        return AclError(f"{name} failed: {self.describe(result)}{detail}", status_code=status, result=result,
                        function=name)

    def describe(self, result: int) -> str:
        return describe(result)
