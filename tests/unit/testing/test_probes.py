"""The benchmark hooks of ``aiodatadist.testing.probes`` that need no GPU (the GPU ones: ``gpu/test_probes.py``;
the native streaming copy: ``native/test_stream_copy_limit.py``)."""

from __future__ import annotations

import pytest

from aiodatadist.native import native_available
from aiodatadist.settings.environment import env_knobs, env_knobs_cache_clear
from aiodatadist.testing import probes


def test_the_copy_threads_are_the_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODATADIST_COPY_THREADS", "3")
    env_knobs_cache_clear()
    try:
        assert probes.copy_threads() == env_knobs().copy_threads == 3
    finally:
        monkeypatch.delenv("AIODATADIST_COPY_THREADS")
        env_knobs_cache_clear()


def test_native_availability_and_the_streaming_copy_agree() -> None:
    assert probes.native_available() == native_available()
    assert (probes.stream_copy_function() is not None) == native_available()


def test_cuda_status_is_one_line() -> None:
    status = probes.cuda_status()
    assert status and "\n" not in status
