"""SGLang servers on this machine's CPU, for ``bench sglang`` and the SGLang tests: start, query, stop.

Each server is ``python -m sglang.launch_server`` in a process group of its own (stopped as a group: SGLang starts
a scheduler and a detokenizer under it); the P/D router is ``python -m sglang_router.launch_router
--pd-disaggregation``.  The flags a CPU needs (SGLang 0.5.23): ``--device cpu --attention-backend torch_native``,
``--sleep-on-idle`` (idle schedulers otherwise spin), ``--disable-overlap-schedule`` on the prefill (a radix-cache
hit with the overlap scheduler records a CUDA event) and ``--disaggregation-decode-retraction-backup cpu_tensor``
on the decode; the environment ``SGLANG_USE_CPU_ENGINE=1``.  A machine without CUDA also needs the ``sgl_kernel``
shim first on ``PYTHONPATH`` (``scripts/sglang_tests.sh`` builds it): the servers inherit the caller's environment.

Only the standard library is used here (HTTP through ``urllib``); SGLang runs in the child processes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiodatadist.testing import free_port

from .sglang_tweaks import ENV as TWEAKS_ENV

__all__ = ["Router", "Server", "ServerError", "ServerSettings", "free_port", "generate", "metric", "stage_sums"]

READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0


class ServerError(RuntimeError):
    """A server did not start, died, or answered with an error."""


@dataclass(frozen=True)
class ServerSettings:
    """What every server of a run shares."""

    model_dir: str
    page_size: int = 16
    dtype: str = "bfloat16"
    max_total_tokens: int = 32768
    chunked_prefill_size: int | None = None
    log_dir: str = ""
    site_dir: str = ""  # a directory with the tweaks' sitecustomize (sglang_tweaks.site_dir)
    enable_metrics: bool = False
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


def _command(settings: ServerSettings, role: str, backend: str | None, port: int, bootstrap_port: int,
             radix_cache: bool) -> list[str]:
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", settings.model_dir, "--device", "cpu",
               "--attention-backend", "torch_native", "--host", "127.0.0.1", "--port", str(port), "--sleep-on-idle",
               "--disable-overlap-schedule", "--page-size", str(settings.page_size), "--dtype", settings.dtype,
               "--max-total-tokens", str(settings.max_total_tokens), "--random-seed", "0",
               "--log-level", "warning", "--skip-server-warmup"]
    if settings.chunked_prefill_size:
        command += ["--chunked-prefill-size", str(settings.chunked_prefill_size)]
    if settings.enable_metrics:
        command += ["--enable-metrics"]
    if not radix_cache:
        command += ["--disable-radix-cache"]
    if role != "single":
        assert backend is not None
        command += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", backend,
                    "--disaggregation-bootstrap-port", str(bootstrap_port)]
    if role == "decode":
        command += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return command + list(settings.extra_args)


def _env(settings: ServerSettings, tweaks: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    env.update(settings.env)
    if tweaks:
        env[TWEAKS_ENV] = tweaks
        env["PYTHONPATH"] = os.pathsep.join(p for p in (settings.site_dir, env.get("PYTHONPATH", "")) if p)
    return env


class _Process:
    """A child process in a session of its own, logging to a file; ``cpus``: the CPUs it (and its children) may
    run on (None: all)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: str,
                 cpus: set[int] | None = None) -> None:
        self.name = name
        directory = Path(log_dir or ".")
        directory.mkdir(parents=True, exist_ok=True)
        self.log_path = directory / f"{name}.log"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(_pinned(command, cpus), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        """The end of the process's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the group's other processes too
        except ProcessLookupError:
            pass
        self.process.wait(10)


def _pinned(command: list[str], cpus: set[int] | None) -> list[str]:
    """``command`` run on ``cpus`` only (``taskset``; its children inherit the affinity)."""
    if cpus is None:
        return command
    taskset = shutil.which("taskset")
    if taskset is None:
        raise ServerError("pinning a server to CPUs needs taskset (util-linux)")
    return [taskset, "-c", ",".join(map(str, sorted(cpus))), *command]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return 0, ""


class Server(_Process):
    """An SGLang server: ``role`` ``single``, ``prefill`` or ``decode``; ``backend`` the transfer backend of a
    P/D role; ``tweaks`` (comma-separated :mod:`.sglang_tweaks` names) for this server's processes; ``cpus`` the
    CPUs its processes run on (and as many torch threads)."""

    def __init__(self, name: str, settings: ServerSettings, role: str, backend: str | None = None, *,
                 port: int = 0, bootstrap_port: int = 0, tweaks: str = "", radix_cache: bool = True,
                 cpus: set[int] | None = None) -> None:
        self.port = port or free_port()
        self.bootstrap_port = bootstrap_port or (free_port() if role == "prefill" else 0)
        self.url = f"http://127.0.0.1:{self.port}"
        self.started = time.perf_counter()
        env = _env(settings, tweaks)
        if cpus is not None:
            env["OMP_NUM_THREADS"] = str(len(cpus))  # torch's threads, one per CPU it may use
        super().__init__(name, _command(settings, role, backend, self.port, self.bootstrap_port, radix_cache),
                         env, settings.log_dir, cpus)
        self.startup_s = 0.0

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> Server:
        """Wait until ``/health`` answers 200; ``ServerError`` if the server died or took longer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerError(f"{self.name} exited with code {self.process.returncode}:\n{self.tail()}")
            if _get(self.url + "/health", 2.0)[0] == 200:
                self.startup_s = time.perf_counter() - self.started
                return self
            time.sleep(0.5)
        raise ServerError(f"{self.name} not ready after {timeout:.0f} s:\n{self.tail()}")

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics`` (``--enable-metrics``)."""
        return _get(self.url + "/metrics")[1]

    def freeze_gc(self) -> None:
        """``/freeze_gc``: the garbage collectors of the server's processes leave what they hold now alone."""
        _post(self.url + "/freeze_gc", {}, 60.0, json_answer=False)  # it answers in plain text

    def abort(self, rid: str) -> None:
        """``/abort_request`` of request ``rid``."""
        _post(self.url + "/abort_request", {"rid": rid}, 10.0)


class Router(_Process):
    """SGLang's P/D router in front of one prefill and one decode server, without retries (a failed request is
    reported, not sent again)."""

    def __init__(self, prefill: Server, decode: Server, log_dir: str = "") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill",
                   prefill.url, str(prefill.bootstrap_port), "--decode", decode.url, "--host", "127.0.0.1",
                   "--port", str(self.port), "--log-level", "warn", "--disable-retries",
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        super().__init__("router", command, dict(os.environ), log_dir)

    def wait_ready(self, probe: list[int], timeout: float = 120.0) -> Router:
        """Wait until a one-token request through the router succeeds (it reports healthy before its workers
        registered)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerError(f"router exited with code {self.process.returncode}:\n{self.tail()}")
            try:
                generate(self.url, probe, 1, timeout=60.0)
                return self
            except ServerError as exc:
                last = str(exc)
                time.sleep(1.0)
        raise ServerError(f"router not ready after {timeout:.0f} s: {last}\n{self.tail()}")


def _post(url: str, body: dict[str, Any], timeout: float, *, json_answer: bool = True) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ServerError(f"{url}: {exc}") from None
    if not json_answer:
        return {"text": text}
    try:
        answer: dict[str, Any] = json.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise ServerError(f"{url}: not JSON: {text[:200]!r}") from exc
    return answer


def generate(url: str, input_ids: list[int], max_new_tokens: int, *, rid: str | None = None,
             timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """Greedy ``/generate`` of token ids; returns ``output_ids``, ``meta_info`` and ``seconds`` (client side)."""
    body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
    if rid is not None:
        body["rid"] = rid
    started = time.perf_counter()
    answer = _post(url + "/generate", body, timeout)
    seconds = time.perf_counter() - started
    if "output_ids" not in answer:
        raise ServerError(f"{url}/generate: no output_ids in {str(answer)[:300]}")
    return {"output_ids": list(answer["output_ids"]), "meta_info": answer.get("meta_info", {}), "seconds": seconds}


STAGE_METRIC = "sglang:per_stage_req_latency_seconds_sum"


def stage_sums(text: str) -> dict[str, float]:
    """Seconds spent so far in each request stage (``--enable-metrics``: the sums of SGLang's per-stage latency
    histogram, by their ``stage`` label, e.g. ``prefill_forward``, ``prefill_transfer_kv_cache``,
    ``decode_waiting``)."""
    out: dict[str, float] = {}
    for labels, value in _samples(text, STAGE_METRIC):
        stage = re.search(r'stage="([^"]+)"', labels)
        if stage is not None:
            out[stage.group(1)] = out.get(stage.group(1), 0.0) + value
    return out


def _samples(text: str, name: str) -> Iterator[tuple[str, float]]:
    """(labels, value) of every sample of Prometheus metric ``name`` in ``text`` (labels: ``{...}`` or "")."""
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name):len(name) + 1] in (" ", "{")):
            labels, _, value = line.rpartition(" ")
            try:
                number = float(value)
            except ValueError:
                continue
            yield labels[len(name):], number


def metric(text: str, name: str) -> float | None:
    """The value of an unlabelled-or-single-series Prometheus sample ``name`` (summed over label sets)."""
    values = [value for _, value in _samples(text, name)]
    return sum(values) if values else None
