"""In-process changes to SGLang server processes started by ``bench sglang`` and the SGLang tests.

A server process gets them through a ``sitecustomize`` module (:func:`site_dir` writes it) on its ``PYTHONPATH``
and the names in ``AIODATADIST_BENCH_TWEAKS`` (comma-separated); each tweak patches its target module right after
that module is first imported, in every process of the server.  Tweaks:

* ``nixl_dram``: SGLang's NIXL backend registers the KV pool as GPU memory (``VRAM``), which UCX refuses for host
  memory; report ``DRAM`` instead (NIXL on a CPU machine does not work without it).
* ``nixl_quiet_prefill``: the prefill's NIXL agent without progress thread and without UCX thread pool (SGLang's
  NIXL backend at its best settings here; on both sides, the first transfer hangs).
* ``corrupt_sources``: the prefill zeroes the source pages of every chunk just before pushing them (aiodatadist
  backend): the negative control of the tests (the decode must then produce other tokens).
* ``gc_log``: every garbage collection longer than 5 ms in a scheduler process is written to its log (generation,
  duration, wall-clock time).

Nothing here is imported by the library; SGLang is imported only inside the patches.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["ENV", "TWEAKS", "apply_from_env", "site_dir"]

ENV = "AIODATADIST_BENCH_TWEAKS"


def _nixl_dram(module: ModuleType) -> None:
    def normalize(kinds: Any, expected_len: int) -> list[str]:
        return ["DRAM"] * expected_len

    module._normalize_kv_mem_kinds = normalize  # type: ignore[attr-defined]


def _nixl_quiet_prefill(module: ModuleType) -> None:
    api: Any = importlib.import_module("nixl._api")
    make_config = api.nixl_agent_config
    create_backend = api.nixl_agent.create_backend

    def config(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(enable_prog_thread=False, num_threads=0)
        return make_config(*args, **kwargs)

    def backend(self: Any, name: str, params: dict[str, str] | None = None) -> Any:
        params = {key: value for key, value in (params or {}).items() if key != "num_threads"}
        return create_backend(self, name, params)

    api.nixl_agent_config = config  # SGLang imports both inside its manager's __init__
    api.nixl_agent.create_backend = backend


def _corrupt_sources(module: ModuleType) -> None:
    endpoint_class = module.Endpoint
    original = endpoint_class.push_pages

    async def push_pages(self: Any, cluster_id: int, model_id: int, src: Any, dst: Any, **kwargs: Any) -> None:
        for tensor in self.caches[model_id].tensors:
            tensor[list(map(int, src))] = 0
        await original(self, cluster_id, model_id, src, dst, **kwargs)

    endpoint_class.push_pages = push_pages


def _gc_log(module: ModuleType) -> None:
    import gc
    import time

    started: dict[int, float] = {}

    def callback(phase: str, info: dict[str, Any]) -> None:
        generation = int(info.get("generation", -1))
        if phase == "start":
            started[generation] = time.perf_counter()
        elif generation in started:
            took = time.perf_counter() - started.pop(generation)
            if took > 0.005:
                sys.stderr.write(f"aiodatadist-bench gc: generation {generation} took {took * 1000:.1f} ms "
                                 f"({info.get('collected')} collected) at {time.time():.3f}\n")

    gc.callbacks.append(callback)


TWEAKS: dict[str, tuple[str, Callable[[ModuleType], None]]] = {
    "gc_log": ("sglang.srt.managers.scheduler", _gc_log),
    "nixl_dram": ("sglang.srt.disaggregation.nixl.conn", _nixl_dram),
    "nixl_quiet_prefill": ("sglang.srt.disaggregation.nixl.conn", _nixl_quiet_prefill),
    "corrupt_sources": ("aiodatadist.integrations.sglang.endpoint", _corrupt_sources),
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name]`` on module ``name`` right after it executed (once)."""

    def __init__(self, patches: dict[str, list[Callable[[ModuleType], None]]]) -> None:
        self.patches = patches

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.patches:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        patches = self.patches.pop(fullname)
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            for patch in patches:
                patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def apply_from_env() -> None:
    """Install the tweaks named in ``AIODATADIST_BENCH_TWEAKS`` (called by the generated ``sitecustomize``)."""
    names = [name.strip() for name in os.environ.get(ENV, "").split(",") if name.strip()]
    patches: dict[str, list[Callable[[ModuleType], None]]] = {}
    for name in names:
        module_name, patch = TWEAKS[name]
        if module_name in sys.modules:
            patch(sys.modules[module_name])
        else:
            patches.setdefault(module_name, []).append(patch)
    if patches:
        sys.meta_path.insert(0, _AfterImport(patches))


@functools.cache
def site_dir() -> str:
    """A directory holding a ``sitecustomize.py`` that calls :func:`apply_from_env` (put it on ``PYTHONPATH``); one
    per process, removed at exit."""
    directory = Path(tempfile.mkdtemp(prefix="aiodatadist-sglang-site-"))
    atexit.register(shutil.rmtree, directory, True)
    (directory / "sitecustomize.py").write_text(
        "import os\n"
        f"if os.environ.get({ENV!r}):\n"
        "    from aiodatadist_benchmarks.bench.sglang_tweaks import apply_from_env\n"
        "    apply_from_env()\n")
    return str(directory)
