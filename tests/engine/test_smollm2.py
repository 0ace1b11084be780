"""SmolLM2-135M-Instruct, a real model: greedy chat answers equal transformers' token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_reference import hf_greedy

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
    llm = LLM(str(smollm2_dir), kv_cache_memory=256 << 20, max_model_len=1024, dtype="float32")
    prompts = [llm.chat_prompt(q) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))

    refs = hf_greedy(smollm2_dir, prompts, MAX_TOKENS, ignore_eos=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert "Paris" in outs[0].outputs[0].text
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks
