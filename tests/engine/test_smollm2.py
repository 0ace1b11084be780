"""SmolLM2-135M-Instruct, a real model: greedy chat answers equal transformers' token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams

pytestmark = pytest.mark.smollm2

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
]
MAX_TOKENS = 32


def test_greedy_chat_matches_transformers(smollm2_dir: Path) -> None:
    llm = LLM(str(smollm2_dir), kv_cache_memory=256 << 20, max_model_len=1024)
    tok = llm.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in QUESTIONS
    ]
    prompts = [
        list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p)
        for p in prompts
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
        )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref
    assert "Paris" in outs[0].outputs[0].text
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks
