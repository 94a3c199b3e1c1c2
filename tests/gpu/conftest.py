"""Device tests.  On a machine with an NVIDIA GPU they run against it.  Without one they run against the *emulated
GPU* (``tests/helpers/fake_cuda.py``: a named fake of the NVIDIA driver, built with the machine's C compiler),
which checks that the driver is used correctly but says nothing about speed; tests marked ``real_gpu`` (timings,
sizes beyond what host memory holds; registered in ``pyproject.toml``) are skipped there.  With neither,
everything here is skipped (never deselected, so pytest never exits with "no tests collected").

The runtime-generic modules (``pytestmark = pytest.mark.usefixtures("device_runtime")``) run once per device
runtime: CUDA as above, and ACL against an Ascend NPU when the machine has one (``AIODATADIST_REAL_NPU=1``), else
against the *emulated ACL runtime* (``tests/helpers/fake_acl.py``, a named fake of ``libascendcl.so``).

Fixtures
    ``device``          the shared :class:`~aiodatadist.cuda.Device` 0.
    ``gpu_mode``        ``"real"`` or ``"emulated"`` (the CUDA driver).
    ``device_runtime``  ``"cuda"`` or ``"acl"`` (module scope): ``AIODATADIST_DEVICE_RUNTIME`` while it lasts.
    ``runtime_mode``    ``"real"`` or ``"emulated"``: the current runtime's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.device_runtimes import RUNTIMES
from helpers.fake_acl import build_fake_libascendcl
from helpers.fake_cuda import build_fake_libcuda

from aiodatadist.acl import library as acl
from aiodatadist.cuda import Device, cuda_driver, driver, get_device
from aiodatadist.errors import LLMException
from aiodatadist.settings.environment import ENV_DEVICE_RUNTIME

_HERE = Path(__file__).resolve().parent
EMULATED_ENV = "AIODATADIST_EMULATED_GPU"
REAL_NPU_ENV = "AIODATADIST_REAL_NPU"
_state: dict[str, str | None] = {"mode": None, "fake": None, "acl_mode": None, "fake_acl": None,
                                 "acl_missing": None}


def _real_gpu_missing() -> str | None:
    try:
        if cuda_driver().device_count < 1:
            return "no CUDA device"
    except (LLMException, OSError) as exc:  # CudaUnavailable says why
        return f"no usable CUDA GPU: {exc}"
    return None


def pytest_unconfigure(config: pytest.Config) -> None:
    for name in ("fake", "fake_acl"):
        if _state[name] is not None:
            shutil.rmtree(Path(str(_state[name])).parent, ignore_errors=True)


def _choose_acl() -> None:
    """A real NPU when asked for (``AIODATADIST_REAL_NPU=1``, e.g. ``scripts/npu_checks.sh``), else the emulated
    ACL runtime."""
    if os.environ.get(REAL_NPU_ENV) == "1":
        _state["acl_mode"] = "real"
        return
    fake = build_fake_libascendcl(Path(tempfile.mkdtemp(prefix="aiodatadist-fake-acl-")))
    if fake is None:
        _state["acl_missing"] = "no C compiler for the emulated ACL runtime"
        return
    _state.update(acl_mode="emulated", fake_acl=str(fake))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hook sees every collected item of the session: mark only this directory's.
    mine = [item for item in items if _HERE in Path(str(item.path)).resolve().parents]
    if not mine:
        return
    _choose_acl()
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


@pytest.fixture(scope="module", params=RUNTIMES)
def device_runtime(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a module's tests on each device runtime in turn (``AIODATADIST_DEVICE_RUNTIME``, and the emulated ACL
    runtime's library where there is no NPU); everything is restored afterwards."""
    name: str = request.param
    if name == "acl" and _state["acl_mode"] is None:
        pytest.skip(f"no ACL runtime: {_state['acl_missing']}")
    saved = {k: os.environ.get(k) for k in (ENV_DEVICE_RUNTIME, acl.ENV_LIBASCENDCL)}
    saved_library = acl._library
    os.environ[ENV_DEVICE_RUNTIME] = name
    if name == "acl" and _state["acl_mode"] == "emulated":
        os.environ[acl.ENV_LIBASCENDCL] = str(_state["fake_acl"])
    try:
        yield name
    finally:
        for k, value in saved.items():
            if value is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = value
        acl._library = saved_library  # the emulated runtime stays loaded, but later tests do not find it


@pytest.fixture(scope="module")
def runtime_mode(device_runtime: str) -> str:
    """``"real"`` or ``"emulated"``: the device runtime this module's tests run on now."""
    mode = _state["acl_mode"] if device_runtime == "acl" else _state["mode"]
    return str(mode or "real")
