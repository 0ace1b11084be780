"""Model-FLOPs utilisation: the model FLOPs of the tokens a run processed, per second, over
the peak a large matmul reaches on this machine in the same dtype, measured in the same run.

FLOPs are counted as the model defines them, not as an implementation spends them (PaLM's
MFU): per computed token 2 x the parameters of every linear layer (q, k, v, o, gate, up,
down), plus attention, 4 x layers x heads x head_dim x the token's context (QK^T and AV,
causal: the positions before it and itself); per sampled token 2 x hidden x vocab for the
logits. Prompt tokens read from the prefix cache are not computed and not counted. The
peak is the best of a few `torch.matmul`s of `size`-cubed matrices, with the run's threads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

PEAK_SIZE = 2048


@dataclass(frozen=True, slots=True)
class ModelFlops:
    """FLOPs per token of a decoder-only transformer (Llama, Mistral, Qwen2 shapes)."""

    linear: int  # 2 x linear parameters, per computed token
    attention_per_position: int  # x the token's context length
    logits: int  # per sampled token

    @classmethod
    def from_config(cls, config: Any) -> ModelFlops:
        hidden = int(config.hidden_size)
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        inter = int(config.intermediate_size)
        per_layer = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
        per_layer += 3 * hidden * inter
        return cls(
            linear=2 * layers * per_layer,
            attention_per_position=4 * layers * heads * head_dim,
            logits=2 * hidden * int(config.vocab_size),
        )

    def sequence(self, prompt_len: int, cached: int, output_len: int) -> int:
        """One sequence: its prompt computed from `cached` on, then `output_len` sampled
        tokens (the last of which is never fed back)."""
        computed = range(cached + 1, prompt_len + 1)  # contexts of the computed prompt tokens
        decoded = range(prompt_len + 1, prompt_len + output_len)
        tokens = len(computed) + len(decoded)
        contexts = sum(computed) + sum(decoded)
        return (
            tokens * self.linear + contexts * self.attention_per_position + output_len * self.logits
        )

    def run(self, prompt_lens: list[int], output_len: int, cached_tokens: int = 0) -> int:
        """A run of prompts, `cached_tokens` of theirs read from the prefix cache (spread
        evenly: the bench workloads share prefixes of equal length)."""
        each = cached_tokens // max(1, len(prompt_lens))
        return sum(self.sequence(p, min(each, p - 1), output_len) for p in prompt_lens)


def matmul_peak(dtype: torch.dtype, size: int = PEAK_SIZE, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` square matmuls in this dtype, on the current threads."""
    a = torch.randn(size, size, dtype=torch.float32).to(dtype)
    b = torch.randn(size, size, dtype=torch.float32).to(dtype)
    torch.matmul(a, b)  # warm: oneDNN picks and caches its kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def mfu(flops: int, seconds: float, peak: float) -> float:
    return flops / seconds / peak if seconds > 0 and peak > 0 else 0.0
