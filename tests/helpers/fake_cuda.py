"""An emulated GPU for machines without one (CI): a fake ``libcuda.so.1`` built from ``fake_libcuda.c``.

It is a named fake of the NVIDIA driver, the one part that cannot exist on a machine without an NVIDIA GPU:
"device" memory is shared host memory (memfd, so that IPC handles open in other processes), each stream is a
thread, and the pointer-list kernel is emulated by ``memcpy`` over the descriptors it was launched with.  It
checks what the real driver would refuse (unknown pointers, kernel spans outside known memory -> a sticky
``CUDA_ERROR_ILLEGAL_ADDRESS``, descriptors outside device memory, a non-current context), so code that passes
against it uses the driver correctly; it says nothing about speed.  Knobs: ``FAKE_CUDA_DELAY_US`` (each stream
operation sleeps that long first), ``FAKE_CUDA_MEM_LIMIT``, ``FAKE_CUDA_DEVICES``, ``FAKE_CUDA_INIT``,
``FAKE_CUDA_FAIL_LAUNCH``, ``FAKE_CUDA_FAIL_CALLBACK``; the library's ``fake_fault(code)`` (a sticky error from
then on, until ``fake_reset()``); and its ``int fake_hold``
(``ctypes.c_int.in_dll``): while it is set, each copy and kernel waits before it runs (at most 60 s), so that a
test keeps a copy on the "GPU" for as long as it needs instead of guessing what a delay covers on a loaded
machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_libcuda.c")


def compile_fake(source: Path, out: Path) -> Path | None:
    """Compile an emulated runtime's C source into the shared library ``out``; None without a C compiler."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-pthread", str(source), "-o", str(out)], check=True,
                   timeout=120)
    return out


def build_fake_libcuda(folder: Path) -> Path | None:
    """Compile the fake into ``folder/libcuda.so.1``; None without a C compiler."""
    return compile_fake(SOURCE, folder / "libcuda.so.1")
