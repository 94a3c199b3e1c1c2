"""Prefill/decode with transformers: a prompt process prefills, a decoder process pulls the KV cache and decodes.

Run it with no arguments (both dtypes), or with ``--dtype float32`` / ``--dtype bfloat16``::

    python examples/transformers_pd.py

Needs ``torch`` and ``transformers`` (no network, no model hub, no tokenizer): both processes build the same tiny
random ``LlamaForCausalLM`` from a ``LlamaConfig`` with a fixed seed and use fixed token ids as the prompt.

* This process is the **decoder**. It starts a second process running this file as the **prompt**
  (``--role prompt``) and, meanwhile, computes the reference: 32 greedy tokens from one ``model.generate`` in this
  process, as a single-process engine would.
* The **prompt** listens (port 0: ``listen_address`` says which port it got), runs the prefill
  (``generate(max_new_tokens=1)``: the prompt's KV cache and the first token), copies the KV cache, K and V of
  every layer, into an aiodatadist cache allocated for it (``cache_desc_from_tensors``, ``tensors_of``) and bound
  to ``CacheKey(PROMPT_ID, REQ_ID)``. It hands the decoder what it needs on stdout, as a router would carry it
  (address, prompt length, first token), and waits for the decoder's notification before it frees the cache.
* The **decoder** (the blocking API, ``aiodatadist.sync``, as an engine's worker thread would use it) links,
  allocates a cache of the same layout, ``pull_cache``-s the request with ``notify=b"done"``, rebuilds the
  model's ``past_key_values`` (a ``DynamicCache``) from torch views of it and generates the 31 tokens after the
  first one.

An engine that keeps its KV tensors in its own memory would register them instead of copying
(``register_cache_from_tensors``; inside ``allocate_host_memory`` memory for the mapped path, see docs/api.md).

Exit status 0 when the decoder's 32 tokens are identical to the reference for every dtype, else 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.generation.utils import GenerateDecoderOnlyOutput

from aiodatadist import CacheDesc, CacheKey, LLMClusterInfo, LLMConfig, LLMRole, Placement, sync
from aiodatadist.torch import cache_desc_from_tensors, from_torch_dtype, tensors_of

PROMPT_ID, DECODER_ID, REQ_ID = 1, 2, 7
NEW_TOKENS = 32
PROMPT_IDS = [(37 * i + 11) % 1000 + 2 for i in range(40)]   # fixed token ids: no tokenizer needed
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEADLINE_S = 120
# generate's cache: `cache=` and `.cache` since transformers 5.2x, `past_key_values` before
CACHE = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


def build_model(dtype: torch.dtype) -> LlamaForCausalLM:
    """A tiny random Llama (GQA: 8 query heads, 4 KV heads), the same weights in every process."""
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0,
                         initializer_range=0.1)          # larger than the default: varied, not repeated, tokens
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None    # never stop early: always NEW_TOKENS tokens
    return model


def greedy(model: LlamaForCausalLM, ids: torch.Tensor, n: int, **kwargs: object) -> object:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, return_dict_in_generate=True, **kwargs)


def kv_tensors(cache: DynamicCache) -> list[torch.Tensor]:
    """K0, V0, K1, V1, ...: each ``(batch, kv_heads, seq, head_dim)``."""
    if hasattr(cache, "layers"):                           # transformers >= 4.56
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [t for kv in zip(cache.key_cache, cache.value_cache) for t in kv]


def options(**extra: str) -> dict[str, str]:
    config = LLMConfig()
    config.sync_kv_timeout = 10_000                        # ms, bounds the pull
    return {**config.generate_options(), **extra}


# -- prompt (the second process) -------------------------------------------------------------------------------

def run_prompt(dtype: torch.dtype) -> int:
    model = build_model(dtype)
    ids = torch.tensor([PROMPT_IDS])
    with sync.LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        dd.init(options(**{"llm.listenIpInfo": "127.0.0.1:0"}))
        start = time.perf_counter()
        with torch.no_grad():
            out = greedy(model, ids, 1)                    # the prefill: KV of the prompt and the first token
        kv = [t.contiguous() for t in kv_tensors(getattr(out, CACHE))]
        cache = dd.cache_manager.allocate_cache(cache_desc_from_tensors(kv), [CacheKey(PROMPT_ID, REQ_ID)])
        for dst, src in zip(tensors_of(cache), kv):
            dst.copy_(src)
        prefill_ms = (time.perf_counter() - start) * 1e3
        ip, port = dd.listen_address
        first = int(out.sequences[0, -1])
        nbytes = cache.cache_desc.size * cache.cache_desc.num_tensors
        print(f"[prompt] prefill of {len(PROMPT_IDS)} tokens in {prefill_ms:.1f} ms, KV {len(kv)} tensors "
              f"{tuple(kv[0].shape)} {dtype} ({nbytes / 1024:.0f} KiB), first token {first}", file=sys.stderr,
              flush=True)
        print(f"{ip} {port} {len(PROMPT_IDS)} {first}", flush=True)       # what the router hands the decoder
        note = dd.get_notification(timeout=DEADLINE_S)                     # the decoder pulled it
        print(f"[prompt] notification from cluster {note and note.cluster_id}: {note and note.message!r}; "
              f"freeing the cache", file=sys.stderr, flush=True)
        dd.cache_manager.deallocate_cache(cache)
        dd.finalize()
    return 0 if note is not None else 1


# -- decoder (this process) ------------------------------------------------------------------------------------

def run_decoder(dtype_name: str) -> bool:
    dtype = DTYPES[dtype_name]
    start = time.perf_counter()
    prompt = subprocess.Popen([sys.executable, __file__, "--role", "prompt", "--dtype", dtype_name],
                              stdout=subprocess.PIPE, text=True)
    try:
        model = build_model(dtype)
        ids = torch.tensor([PROMPT_IDS])
        t0 = time.perf_counter()
        with torch.no_grad():
            reference = greedy(model, ids, NEW_TOKENS).sequences[0, len(PROMPT_IDS):].tolist()
        reference_ms = (time.perf_counter() - t0) * 1e3

        ip, port, seq_len, first = prompt.stdout.readline().split()    # blocks until the prefill is done
        layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        desc = CacheDesc(2 * layers, (1, kv_heads, int(seq_len), head_dim), from_torch_dtype(dtype), Placement.HOST)
        with sync.LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
            dd.init(options())
            info = LLMClusterInfo()
            info.remote_cluster_id = PROMPT_ID
            info.append_local_ip_info("127.0.0.1", 0)
            info.append_remote_ip_info(ip, int(port))
            dd.link_clusters([info])
            cache = dd.cache_manager.allocate_cache(desc)
            t0 = time.perf_counter()
            dd.cache_manager.pull_cache(CacheKey(PROMPT_ID, REQ_ID), cache, notify=b"done")
            pull_ms = (time.perf_counter() - t0) * 1e3
            kv = tensors_of(cache)                         # zero-copy torch views, dtype included (bf16 too)
            past = DynamicCache()
            for layer in range(layers):
                past.update(kv[2 * layer].clone(), kv[2 * layer + 1].clone(), layer)
            dd.cache_manager.deallocate_cache(cache)
            ids = torch.tensor([PROMPT_IDS + [int(first)]])
            t0 = time.perf_counter()
            with torch.no_grad():
                rest = greedy(model, ids, NEW_TOKENS - 1, **{CACHE: past}).sequences[0, ids.shape[1]:]
            decode_ms = (time.perf_counter() - t0) * 1e3
            decoded = [int(first)] + rest.tolist()
            dd.unlink_clusters([info])
        rc = prompt.wait(timeout=DEADLINE_S)
    finally:
        if prompt.poll() is None:
            prompt.kill()
            prompt.wait()
    same = decoded == reference and rc == 0
    print(f"[decoder] {dtype_name}: pulled {desc.num_tensors} KV tensors ({desc.size * desc.num_tensors / 1024:.0f}"
          f" KiB) in {pull_ms:.2f} ms, decoded {len(decoded) - 1} tokens in {decode_ms:.0f} ms; reference "
          f"generate({NEW_TOKENS}) in {reference_ms:.0f} ms; prompt exited with {rc}; "
          f"{time.perf_counter() - start:.2f} s in all")
    print(f"[decoder] {dtype_name} P/D:       {decoded}")
    print(f"[decoder] {dtype_name} reference: {reference}")
    print(f"[decoder] {dtype_name}: {'identical' if same else 'MISMATCH'}", flush=True)
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="one dtype (default: both)")
    parser.add_argument("--role", choices=["prompt"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "prompt":
        return run_prompt(DTYPES[args.dtype])
    results = [run_decoder(name) for name in ([args.dtype] if args.dtype else DTYPES)]
    print("PASS" if all(results) else "FAIL", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
