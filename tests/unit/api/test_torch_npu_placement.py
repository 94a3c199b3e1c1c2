"""aiodatadist.torch and Ascend NPUs: torch_npu's ``npu`` device type is ``Placement.DEVICE`` (recognised by
name, torch_npu never imported), and the ACL runtime imports neither torch nor torch_npu.

Skipped without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import aiodatadist.torch as adt
from aiodatadist import LLMException, LLMStatusCode, Placement


@pytest.mark.parametrize(("device", "placement"), [
    ("npu:0", Placement.DEVICE),
    ("npu", Placement.DEVICE),
    ("npu:3", Placement.DEVICE),
    ("cuda:1", Placement.DEVICE),
    ("cuda", Placement.DEVICE),
    ("cpu", Placement.HOST),
])
def test_placement_of_device_strings(device: str, placement: Placement) -> None:
    assert adt.placement_of(device) is placement


def test_placement_of_torch_devices() -> None:
    assert adt.placement_of(torch.device("cpu")) is Placement.HOST
    assert adt.placement_of(torch.device("cuda", 1)) is Placement.DEVICE


def test_meta_is_refused() -> None:
    for device in ("meta", torch.device("meta")):
        with pytest.raises(LLMException) as info:
            adt.placement_of(device)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_npu_is_a_device_type() -> None:
    assert "npu" in adt.DEVICE_TYPES
    assert "cuda" in adt.DEVICE_TYPES


def test_the_acl_runtime_imports_neither_torch_nor_torch_npu() -> None:
    code = ("import sys\n"
            "import aiodatadist, aiodatadist.acl.runtime, aiodatadist.copy.device_runtime\n"
            "print(sorted(m for m in ('torch', 'torch_npu') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
