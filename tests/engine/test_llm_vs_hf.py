"""End to end: greedy outputs equal Hugging Face transformers token for token,
in every scheduling configuration, and every block is free afterwards."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hf_reference import hf_greedy

from engine import LLM, SamplingParams

NUM_OUTPUT = 24
PROMPT_LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 100, 127, 128, 129, 200, 300]


@pytest.fixture(scope="module")
def prompts(demo_model_dir: Path) -> list[list[int]]:
    rng = random.Random(1234)
    vocab = 8192
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_outputs(demo_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(demo_model_dir, prompts, NUM_OUTPUT)


CONFIGS = {
    "default": {},
    # Decode attention on its torch path (the specification) rather than the C++ kernel.
    "torch-attention": {"cpu_kernels": False},
    "torch-attention-preempting": {"cpu_kernels": False, "num_kv_blocks": 30, "max_model_len": 480},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-32": {"max_num_batched_tokens": 32},
    "no-chunking": {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 2048,
        "max_model_len": 2048,
    },
    "block-1": {"block_size": 1},
    "block-32": {"block_size": 32},
    # 30 blocks of 16 = 480 tokens for 16 prompts of up to 324 tokens: preemption is certain.
    "preempting": {"num_kv_blocks": 30, "max_model_len": 480},
    "preempting-chunked-no-cache": {
        "num_kv_blocks": 30,
        "max_model_len": 480,
        "max_num_batched_tokens": 48,
        "enable_prefix_caching": False,
    },
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf(
    name: str, demo_model_dir: Path, prompts: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    llm = LLM(str(demo_model_dir), kv_cache_memory=64 << 20, **CONFIGS[name], dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_OUTPUT, ignore_eos=True)
    # Twice: the second pass runs on a warm prefix cache.
    for _ in range(2):
        outs = llm.generate(prompts, params)
        for i, (out, ref) in enumerate(zip(outs, hf_outputs, strict=True)):
            assert out.outputs[0].token_ids == ref, f"prompt {i} (len {len(prompts[i])})"
            assert out.outputs[0].finish_reason == "length"
        kv = llm.engine.kv
        assert kv.num_free_blocks == kv.pool.num_blocks
    if "preempting" in name:
        assert llm.engine.scheduler.num_preemptions > 0
    if name == "default":
        assert outs[0].num_cached_tokens == 0
        assert max(o.num_cached_tokens for o in outs) > 0


def test_batch_composition_does_not_change_greedy_output(
    demo_model_dir: Path, prompts: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    llm = LLM(str(demo_model_dir), kv_cache_memory=64 << 20, max_num_seqs=3, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_OUTPUT, ignore_eos=True)
    outs = llm.generate(prompts[::-1], params)
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs[::-1]
