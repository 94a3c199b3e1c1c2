"""LLMStatusCode values and LLMException behaviour, as in LLM-DataDist."""

from __future__ import annotations

import copy
import pickle
from enum import IntEnum

import pytest
from helpers.examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodatadist import LLMException, LLMStatusCode
from aiodatadist.errors import LLMLinkError, LLMTimeoutError

BASE = 0x5010B000

# LLM-DataDist's complete Python list, name -> native value.
REFERENCE_CODES: dict[str, int] = {
    "LLM_SUCCESS": 0,
    "LLM_FAILED": 0xFFFFFFFF,
    "LLM_WAIT_PROCESS_TIMEOUT": BASE + 0x01,
    "LLM_KV_CACHE_NOT_EXIST": BASE + 0x02,
    "LLM_REPEAT_REQUEST": BASE + 0x03,
    "LLM_REQUEST_ALREADY_COMPLETED": BASE + 0x04,
    "LLM_PARAM_INVALID": BASE + 0x05,
    "LLM_ENGINE_FINALIZED": BASE + 0x06,
    "LLM_NOT_YET_LINK": BASE + 0x07,
    "LLM_ALREADY_LINK": BASE + 0x08,
    "LLM_LINK_FAILED": BASE + 0x09,
    "LLM_UNLINK_FAILED": BASE + 0x0A,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": BASE + 0x0B,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": BASE + 0x0C,
    "LLM_PROCESSING_LINK": BASE + 0x0D,
    "LLM_DEVICE_OUT_OF_MEMORY": BASE + 0x0E,
    "LLM_PREFIX_ALREADY_EXIST": BASE + 0x0F,
    "LLM_PREFIX_NOT_EXIST": BASE + 0x10,
    "LLM_SEQ_LENOVERLIMIT": BASE + 0x11,
    "LLM_NO_FREE_BLOCK": BASE + 0x12,
    "LLM_BLOCKS_OUT_OF_MEMORY": BASE + 0x13,
    "LLM_EXIST_LINK": BASE + 0x18,
    "LLM_FEATURE_NOT_ENABLED": BASE + 0x19,
    "LLM_TIMEOUT": BASE + 0x1A,
    "LLM_LINK_BUSY": BASE + 0x1B,
    "LLM_OUT_OF_MEMORY": BASE + 0x1C,
    "LLM_DEVICE_MEM_ERROR": 507053,
    "LLM_SUSPECT_REMOTE_ERROR": 507057,
    "LLM_UNKNOWN_ERROR": -1,
}

# Decimal values quoted in LLM-DataDist's table, as a cross-check of the hex arithmetic above.
REFERENCE_DECIMALS = {
    "LLM_FAILED": 4294967295,
    "LLM_WAIT_PROCESS_TIMEOUT": 1343270913,
    "LLM_PARAM_INVALID": 1343270917,
    "LLM_EXIST_LINK": 1343270936,
    "LLM_TIMEOUT": 1343270938,
    "LLM_OUT_OF_MEMORY": 1343270940,
}

# C++-only codes that the Python enum does not map: they become LLM_FAILED.
UNMAPPED = [BASE + 0x14, BASE + 0x15, BASE + 0x16, BASE + 0x17, BASE + 0x1D, 1, 12345, 507054, -2, 2**40]


# --------------------------------------------------------------------------------------------------------------
# LLMStatusCode
# --------------------------------------------------------------------------------------------------------------


def test_status_code_is_int_enum() -> None:
    assert issubclass(LLMStatusCode, IntEnum)


def test_status_code_member_set_is_the_spec_list() -> None:
    assert {m.name for m in LLMStatusCode} == set(REFERENCE_CODES)


@pytest.mark.parametrize(("name", "value"), sorted(REFERENCE_CODES.items()))
def test_status_code_value_str_and_from_code(name: str, value: int) -> None:
    member = LLMStatusCode[name]
    assert member.value == value
    assert int(member) == value
    assert LLMStatusCode(value) is member
    assert str(member) == f"LLMStatusCode.{name}"
    assert f"{member!s}" == f"LLMStatusCode.{name}"
    assert LLMStatusCode.from_code(value) is member


@pytest.mark.parametrize(("name", "value"), sorted(REFERENCE_DECIMALS.items()))
def test_status_code_decimal_values(name: str, value: int) -> None:
    assert int(LLMStatusCode[name]) == value


def test_status_code_str_timeout_literal() -> None:
    assert str(LLMStatusCode.LLM_TIMEOUT) == "LLMStatusCode.LLM_TIMEOUT"


@pytest.mark.parametrize("code", UNMAPPED)
def test_from_code_unknown_maps_to_failed(code: int) -> None:
    assert LLMStatusCode.from_code(code) is LLMStatusCode.LLM_FAILED


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(min_value=-(2**64), max_value=2**64))
def test_from_code_total(code: int) -> None:
    result = LLMStatusCode.from_code(code)
    assert isinstance(result, LLMStatusCode)
    if code in REFERENCE_CODES.values():
        assert int(result) == code
    else:
        assert result is LLMStatusCode.LLM_FAILED


# --------------------------------------------------------------------------------------------------------------
# LLMException
# --------------------------------------------------------------------------------------------------------------


def test_exception_is_runtime_error() -> None:
    assert issubclass(LLMException, RuntimeError)
    with pytest.raises(RuntimeError):
        raise LLMException("boom")


def test_exception_default_status_success() -> None:
    exc = LLMException("x")
    assert exc.status_code is LLMStatusCode.LLM_SUCCESS
    assert exc.args == ("x",)
    assert str(exc) == "x"
    assert type(exc) is LLMException


def test_exception_no_args() -> None:
    exc = LLMException()
    assert exc.status_code is LLMStatusCode.LLM_SUCCESS
    assert exc.args == ()


def test_status_code_is_keyword_only() -> None:
    exc = LLMException("x", LLMStatusCode.LLM_TIMEOUT)
    # A positional code is just another message argument.
    assert exc.status_code is LLMStatusCode.LLM_SUCCESS
    assert exc.args == ("x", LLMStatusCode.LLM_TIMEOUT)


def test_status_code_is_read_only() -> None:
    exc = LLMException("x", status_code=LLMStatusCode.LLM_PARAM_INVALID)
    with pytest.raises(AttributeError):
        exc.status_code = LLMStatusCode.LLM_FAILED  # type: ignore[misc]
    assert exc.status_code is LLMStatusCode.LLM_PARAM_INVALID


@pytest.mark.parametrize("name", sorted(REFERENCE_CODES))
def test_exception_keeps_every_code(name: str) -> None:
    code = LLMStatusCode[name]
    exc = LLMException("msg", status_code=code)
    assert exc.status_code is code
    assert isinstance(exc.status_code, LLMStatusCode)
    assert isinstance(exc, LLMException)
    assert isinstance(exc, RuntimeError)
    assert "msg" in str(exc)


def test_timeout_is_timeout_error() -> None:
    exc = LLMException("x", status_code=LLMStatusCode.LLM_TIMEOUT)
    assert isinstance(exc, LLMTimeoutError)
    assert isinstance(exc, TimeoutError)
    assert isinstance(exc, LLMException)
    assert isinstance(exc, RuntimeError)
    assert exc.status_code is LLMStatusCode.LLM_TIMEOUT
    assert str(exc) == "x"
    assert exc.args == ("x",)


def test_timeout_caught_by_except_timeout_error() -> None:
    with pytest.raises(TimeoutError) as info:
        raise LLMException("deadline", status_code=LLMStatusCode.LLM_TIMEOUT)
    assert info.value.status_code is LLMStatusCode.LLM_TIMEOUT  # type: ignore[attr-defined]


def test_timeout_from_raw_int_code() -> None:
    exc = LLMException("x", status_code=BASE + 0x1A)  # type: ignore[arg-type]
    assert isinstance(exc, TimeoutError)
    assert exc.status_code is LLMStatusCode.LLM_TIMEOUT


def test_link_failed_is_connection_error() -> None:
    exc = LLMException("x", status_code=LLMStatusCode.LLM_LINK_FAILED)
    assert isinstance(exc, LLMLinkError)
    assert isinstance(exc, ConnectionError)
    assert isinstance(exc, LLMException)
    assert isinstance(exc, RuntimeError)
    assert exc.status_code is LLMStatusCode.LLM_LINK_FAILED
    assert str(exc) == "x"


@pytest.mark.parametrize(
    "name",
    [
        "LLM_SUCCESS",
        "LLM_FAILED",
        "LLM_PARAM_INVALID",
        "LLM_KV_CACHE_NOT_EXIST",
        "LLM_NOT_YET_LINK",
        "LLM_FEATURE_NOT_ENABLED",
        "LLM_EXIST_LINK",
        "LLM_OUT_OF_MEMORY",
    ],
)
def test_other_codes_are_neither_timeout_nor_connection(name: str) -> None:
    exc = LLMException("x", status_code=LLMStatusCode[name])
    assert not isinstance(exc, TimeoutError)
    assert not isinstance(exc, ConnectionError)
    assert not isinstance(exc, OSError)


def test_subclasses_default_codes() -> None:
    assert LLMTimeoutError("t").status_code is LLMStatusCode.LLM_TIMEOUT
    assert LLMLinkError("l").status_code is LLMStatusCode.LLM_LINK_FAILED


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("LLM_SUCCESS", LLMException),
        ("LLM_PARAM_INVALID", LLMException),
        ("LLM_FAILED", LLMException),
        ("LLM_UNKNOWN_ERROR", LLMException),
        ("LLM_TIMEOUT", LLMTimeoutError),
        ("LLM_LINK_FAILED", LLMLinkError),
    ],
)
@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_pickle_keeps_class_code_and_args(name: str, cls: type, protocol: int) -> None:
    exc = LLMException("pull failed", status_code=LLMStatusCode[name])
    assert type(exc) is cls
    back = pickle.loads(pickle.dumps(exc, protocol=protocol))
    assert type(back) is cls
    assert back.status_code is LLMStatusCode[name]
    assert back.args == ("pull failed",)
    assert str(back) == str(exc)


def test_copy_keeps_class_and_code() -> None:
    exc = LLMException("x", status_code=LLMStatusCode.LLM_TIMEOUT)
    dup = copy.copy(exc)
    assert type(dup) is LLMTimeoutError
    assert dup.status_code is LLMStatusCode.LLM_TIMEOUT
