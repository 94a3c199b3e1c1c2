"""Status codes and exceptions, numerically identical to LLM-DataDist's."""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Any, ClassVar, Self

__all__ = [
    "DeviceCallError",
    "LLMException",
    "LLMLinkError",
    "LLMNotInitializedError",
    "LLMStatusCode",
    "LLMTimeoutError",
    "LinkDropReason",
]

_BASE = 0x5010B000


class LLMStatusCode(IntEnum):
    """Status codes with the native values of LLM-DataDist (``0x5010B000 + n``)."""

    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = _BASE + 0x01
    LLM_KV_CACHE_NOT_EXIST = _BASE + 0x02
    LLM_REPEAT_REQUEST = _BASE + 0x03
    LLM_REQUEST_ALREADY_COMPLETED = _BASE + 0x04
    LLM_PARAM_INVALID = _BASE + 0x05
    LLM_ENGINE_FINALIZED = _BASE + 0x06
    LLM_NOT_YET_LINK = _BASE + 0x07
    LLM_ALREADY_LINK = _BASE + 0x08
    LLM_LINK_FAILED = _BASE + 0x09
    LLM_UNLINK_FAILED = _BASE + 0x0A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _BASE + 0x0B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _BASE + 0x0C
    LLM_PROCESSING_LINK = _BASE + 0x0D
    LLM_DEVICE_OUT_OF_MEMORY = _BASE + 0x0E
    LLM_PREFIX_ALREADY_EXIST = _BASE + 0x0F
    LLM_PREFIX_NOT_EXIST = _BASE + 0x10
    LLM_SEQ_LENOVERLIMIT = _BASE + 0x11
    LLM_NO_FREE_BLOCK = _BASE + 0x12
    LLM_BLOCKS_OUT_OF_MEMORY = _BASE + 0x13
    LLM_EXIST_LINK = _BASE + 0x18
    LLM_FEATURE_NOT_ENABLED = _BASE + 0x19
    LLM_TIMEOUT = _BASE + 0x1A
    LLM_LINK_BUSY = _BASE + 0x1B
    LLM_OUT_OF_MEMORY = _BASE + 0x1C
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:
        return f"LLMStatusCode.{self.name}"

    @classmethod
    def from_code(cls, code: int) -> LLMStatusCode:
        """Map a numeric code to a member; unknown codes become ``LLM_FAILED`` (as the reference does)."""
        try:
            return cls(code)
        except ValueError:
            return cls.LLM_FAILED


class LLMException(RuntimeError):
    """Root of every error aiodatadist raises for a failed operation; carries ``status_code``.

    Constructing ``LLMException(..., status_code=LLM_TIMEOUT)`` returns an :class:`LLMTimeoutError`
    (also a :class:`TimeoutError`), and link failures return an :class:`LLMLinkError` (also a
    :class:`ConnectionError`), so callers can catch either family.
    """

    _by_code: ClassVar[dict[LLMStatusCode, type[LLMException]]] = {}

    def __new__(cls, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS,  # noqa: PYI034 - it picks the subclass of the code
                **_: Any) -> LLMException:
        target = cls
        if cls is LLMException:
            target = LLMException._by_code.get(LLMStatusCode.from_code(int(status_code)), cls)
        # OSError-derived subclasses (TimeoutError, ConnectionError) need OSError's allocator.
        base_new = OSError.__new__ if issubclass(target, OSError) else RuntimeError.__new__
        return base_new(target, *args)

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS) -> None:
        super().__init__(*args)
        self._status_code = LLMStatusCode.from_code(int(status_code))

    @property
    def status_code(self) -> LLMStatusCode:
        """The :class:`LLMStatusCode` of the failure."""
        return self._status_code

    def __str__(self) -> str:
        # Same text for every subclass (OSError-based ones would otherwise print "[Errno a] b").
        return str(self.args[0]) if len(self.args) == 1 else str(self.args) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, int(self._status_code)))


def _rebuild(cls: type[LLMException], args: tuple[Any, ...], code: int) -> LLMException:
    return cls(*args, status_code=LLMStatusCode.from_code(code))


class LLMTimeoutError(LLMException, TimeoutError):
    """``LLM_TIMEOUT``: a transfer exceeded ``sync_kv_timeout`` or was cancelled by a deadline."""

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_TIMEOUT) -> None:
        super().__init__(*args, status_code=status_code)


class LinkDropReason(StrEnum):
    """Why a link went away (:attr:`LLMLinkError.reason`); the value is the phrase messages use."""

    PEER_GONE = "peer gone"
    """The connection closed and the peer's address refuses new ones: its process died or stopped listening."""
    HEARTBEAT_LOST = "heartbeat lost"
    """The connection was dropped while the peer's address still accepts connections, or does not answer: the
    peer stopped answering ZeroMQ heartbeats (stopped or hung process, failed network)."""
    CONNECTION_LOST = "connection lost"
    """The server side lost its client's connection (its process died, or it stopped answering heartbeats)."""
    DATA_CONNECTION_LOST = "data connection lost"
    """A TCP data connection of the link failed while the peer still accepts connections."""
    UNLINKED_BY_PEER = "unlinked by the peer"
    """The peer unlinked (``unlink_clusters``, ``unlink``) or finalized, and said so."""
    UNLINKED = "unlinked"
    """This side unlinked (``unlink_clusters``, ``unlink``)."""
    FINALIZED = "finalized"
    """This instance was finalized."""
    AUTH_FAILED = "authentication failed"
    """The last link attempt to that cluster failed authentication (``llm.AuthKey``, CURVE keys)."""
    PROTOCOL_ERROR = "protocol error"
    """The peer broke the protocol (e.g. it did not confirm that a cut-short transfer stopped)."""
    INTERNAL_ERROR = "internal error"
    """A bug on this side (the link's reader failed)."""


class LLMLinkError(LLMException, ConnectionError):
    """The link to a peer failed or went away during an operation (``LLM_LINK_FAILED`` and kin).

    ``reason`` (a :class:`LinkDropReason`, or None when unknown) says why the link went away; a call to a cluster
    whose link dropped earlier raises it with ``LLM_NOT_YET_LINK`` (there is no link now) and the reason."""

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_LINK_FAILED,
                 reason: LinkDropReason | None = None) -> None:
        super().__init__(*args, status_code=status_code)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_link_error, (type(self), self.args, int(self.status_code), self.reason))


def _rebuild_link_error(cls: type[LLMLinkError], args: tuple[Any, ...], code: int,
                        reason: LinkDropReason | None) -> LLMLinkError:
    return cls(*args, status_code=LLMStatusCode.from_code(code), reason=reason)


class DeviceCallError(LLMException):
    """A device runtime's call failed (CUDA's ``CudaError``, ACL's ``AclError``): ``function`` is the call,
    ``result`` the runtime's own code.  ``LLM_DEVICE_MEM_ERROR`` unless the runtime says otherwise (out of
    memory: ``LLM_DEVICE_OUT_OF_MEMORY``)."""

    def __new__(cls, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_DEVICE_MEM_ERROR,
                result: int = 0, function: str = "") -> Self:
        obj = super().__new__(cls, *args, status_code=status_code)
        assert isinstance(obj, cls)
        return obj

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_DEVICE_MEM_ERROR,
                 result: int = 0, function: str = "") -> None:
        super().__init__(*args, status_code=status_code)
        self.result = result
        self.function = function

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_device_error, (type(self), self.args, int(self.status_code), self.result, self.function))


def _rebuild_device_error(cls: type[DeviceCallError], args: tuple[Any, ...], code: int, result: int,
                          function: str) -> DeviceCallError:
    return cls(*args, status_code=LLMStatusCode.from_code(code), result=result, function=function)


class LLMNotInitializedError(LLMException):
    """A method was called on an ``LLMDataDist`` that is not initialized (or already finalized)."""

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_FAILED) -> None:
        super().__init__(*(args or ("llm datadist is not initialized",)), status_code=status_code)


LLMException._by_code.update(
    {
        LLMStatusCode.LLM_TIMEOUT: LLMTimeoutError,
        LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT: LLMTimeoutError,
        LLMStatusCode.LLM_LINK_FAILED: LLMLinkError,
    }
)

