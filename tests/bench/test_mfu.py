"""bench/mfu.py's FLOP count against torch's own FLOP counter on the HF model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from bench.mfu import ModelFlops, matmul_peak, mfu


@pytest.mark.parametrize("prompt_len", [1, 7, 33])
def test_a_prompt_s_flops_are_what_torch_counts_on_hf(
    demo_model_dir: Path, prompt_len: int
) -> None:
    """One prefill with the last position's logits: the linears and logits exactly as
    torch counts them; attention is the causal half of the full square torch counts."""
    config = AutoConfig.from_pretrained(demo_model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, attn_implementation="eager").eval()
    ids = torch.arange(3, 3 + prompt_len).unsqueeze(0)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=ids, logits_to_keep=1)
    counted = counter.get_flop_counts()["Global"]
    total = counter.get_total_flops()
    # Eager attention: QK^T and AV as batched matmuls over the full square (the linears and
    # the logits are aten.mm).
    sdpa = total - counted[torch.ops.aten.mm]
    flops = ModelFlops.from_config(config)
    assert total - sdpa == prompt_len * flops.linear + flops.logits
    full_square = prompt_len * prompt_len * flops.attention_per_position
    assert sdpa == full_square
    causal = prompt_len * (prompt_len + 1) // 2 * flops.attention_per_position
    assert flops.sequence(prompt_len, 0, 1) == prompt_len * flops.linear + causal + flops.logits


def test_cached_tokens_and_decoded_tokens() -> None:
    flops = ModelFlops(linear=10, attention_per_position=1, logits=100)
    # Prompt of 4 with 2 cached: positions 3 and 4 computed; 3 outputs: 2 fed back (5, 6).
    assert flops.sequence(4, 2, 3) == 4 * 10 + (3 + 4 + 5 + 6) + 3 * 100
    assert flops.run([4, 4], 3, cached_tokens=4) == 2 * flops.sequence(4, 2, 3)


def test_the_peak_is_a_plausible_rate() -> None:
    peak = matmul_peak(torch.float32, size=256, repeats=2)
    assert 1e8 < peak < 1e15
    assert mfu(int(peak), 2.0, peak) == pytest.approx(0.5)
