"""A small random Llama and a locally trained tokenizer, for running vLLM offline on a CPU.

``build_model(directory)`` writes a ``transformers`` Llama checkpoint with random weights (fixed seed) and a
word-level ``PreTrainedTokenizerFast`` into ``directory``; vLLM loads it with ``LLM(model=directory)``, no hub
access.  The shapes keep one request's KV cache realistic in size (32 layers x 2 KV heads x head_dim 128,
float32: 64 KiB a token, 28 MiB for a 448-token prompt) while the compute stays small (hidden size 256).

``torch`` and ``transformers`` are imported only inside the functions: the package's core never imports them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

__all__ = ["ModelSpec", "build_model", "kv_bytes_per_token", "random_prompts"]

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class ModelSpec:
    """The shapes of the random Llama; the defaults give 64 KiB of float32 KV cache a token at 32 layers."""

    layers: int = 32
    hidden_size: int = 256
    intermediate_size: int = 512
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    vocab_size: int = 2048
    max_positions: int = 1024
    dtype: str = "float32"
    seed: int = 0


def kv_bytes_per_token(spec: ModelSpec) -> int:
    """Bytes of K and V cache one token takes over all layers."""
    itemsize = 2 if spec.dtype in ("bfloat16", "float16") else 4
    return 2 * spec.layers * spec.kv_heads * spec.head_dim * itemsize


def _train_tokenizer(directory: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer over ``vocab_size`` made-up words, saved as a fast HF tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    tokenizer = Tokenizer(models.WordLevel(unk_token=SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                        min_frequency=1)
    corpus = [" ".join(words[i:i + 64]) for i in range(0, len(words), 64)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call, unused-ignore]
        tokenizer_object=tokenizer, unk_token=SPECIAL_TOKENS[0], bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2])
    fast.save_pretrained(str(directory))


def _save_random_llama(directory: Path, spec: ModelSpec) -> None:
    """A ``LlamaForCausalLM`` with seeded random weights, saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_positions, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False, dtype=spec.dtype,
        # peaked logits: greedy decoding stays away from near-ties that float rounding could flip
        initializer_range=0.1,
    )
    torch.manual_seed(spec.seed)
    model = cast(Any, LlamaForCausalLM)(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(str(directory), safe_serialization=True)


def build_model(directory: str | os.PathLike[str], spec: ModelSpec | None = None) -> Path:
    """Write the random Llama of ``spec`` (default ``ModelSpec()``) and its tokenizer into ``directory``."""
    spec = spec or ModelSpec()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _save_random_llama(path, spec)
    _train_tokenizer(path, spec.vocab_size)
    return path


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 1) -> list[list[int]]:
    """``count`` different prompts of ``length`` random token ids, none of them a special token."""
    import random

    rng = random.Random(seed)
    low = len(SPECIAL_TOKENS)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(count)]
