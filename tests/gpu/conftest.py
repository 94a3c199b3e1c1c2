"""GPU tests.  On a machine with an NVIDIA GPU they run against it.  Without one they run against the *emulated
GPU* (``tests/helpers/fake_cuda.py``: a named fake of the NVIDIA driver, built with the machine's C compiler),
which checks that the driver is used correctly but says nothing about speed; tests marked ``real_gpu`` (timings,
sizes beyond what host memory holds; registered in ``pyproject.toml``) are skipped there.  With neither,
everything here is skipped (never deselected, so pytest never exits with "no tests collected").

Fixtures
    ``device``    the shared :class:`~aiodatadist.cuda.Device` 0.
    ``gpu_mode``  ``"real"`` or ``"emulated"``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.fake_cuda import build_fake_libcuda

from aiodatadist.cuda import Device, cuda_driver, driver, get_device
from aiodatadist.errors import LLMException

_HERE = Path(__file__).resolve().parent
EMULATED_ENV = "AIODATADIST_EMULATED_GPU"
_state: dict[str, str | None] = {"mode": None, "fake": None}


def _real_gpu_missing() -> str | None:
    try:
        if cuda_driver().device_count < 1:
            return "no CUDA device"
    except (LLMException, OSError) as exc:  # CudaUnavailable says why
        return f"no usable CUDA GPU: {exc}"
    return None


def pytest_unconfigure(config: pytest.Config) -> None:
    if _state["fake"] is not None:
        shutil.rmtree(Path(_state["fake"]).parent, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hook sees every collected item of the session: mark only this directory's.
    mine = [item for item in items if _HERE in Path(str(item.path)).resolve().parents]
    if not mine:
        return
    missing = _real_gpu_missing()
    if missing is None:
        _state["mode"] = "real"
        return
    fake = build_fake_libcuda(Path(tempfile.mkdtemp(prefix="aiodatadist-fake-cuda-")))
    if fake is None:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=f"{missing}; no C compiler for the emulated GPU"))
        return
    _state.update(mode="emulated", fake=str(fake))
    for item in mine:
        if item.get_closest_marker("real_gpu"):
            item.add_marker(pytest.mark.skip(reason=f"needs a real NVIDIA GPU ({missing}); ran on the emulated GPU"))


@pytest.fixture(scope="package", autouse=True)
def gpu_mode() -> Iterator[str]:
    """Select the emulated GPU for this directory's tests (and the peer processes they start) when there is no
    real one; everything is restored afterwards."""
    if _state["mode"] != "emulated":
        yield "real"
        return
    saved = {name: os.environ.get(name) for name in (driver.ENV_LIBCUDA, EMULATED_ENV)}
    saved_driver = driver._driver
    os.environ[driver.ENV_LIBCUDA] = str(_state["fake"])
    os.environ[EMULATED_ENV] = "1"
    driver._driver = None
    try:
        yield "emulated"
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        driver._driver = saved_driver


@pytest.fixture
def device() -> Device:
    return get_device(0)
