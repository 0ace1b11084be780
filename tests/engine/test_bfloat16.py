"""bfloat16 end to end: what `--dtype auto` picks, and greedy outputs held against
transformers in bf16, which they must follow until the first near-tie of its logits (the
float32 path is held token for token elsewhere)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hf_reference import greedy
from transformers import AutoConfig, AutoModelForCausalLM

from bench.agreement import QUESTIONS, first_divergence, run_agreement
from engine import LLM, SamplingParams
from engine.model_runner import resolve_dtype
from kernels import linear

NUM_OUTPUT = 16


def test_auto_is_bfloat16_where_the_cpu_has_bf16_dot_products(demo_model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(demo_model_dir)  # a float32 checkpoint
    expected = torch.bfloat16 if linear.native_bf16() else torch.float32
    assert resolve_dtype("auto", config, torch.device("cpu")) == expected
    assert resolve_dtype("float32", config, torch.device("cpu")) == torch.float32


def test_the_kv_cache_is_half_the_bytes(demo_model_dir: Path) -> None:
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(demo_model_dir), kv_cache_memory=16 << 20, dtype=dtype)
        runner = llm.engine.runner
        assert runner.kv_caches[0][0].dtype == getattr(torch, dtype)
        assert next(runner.model.parameters()).dtype == getattr(torch, dtype)
        sizes[dtype] = (runner.bytes_per_block, llm.engine.kv.pool.num_blocks)
    assert sizes["bfloat16"][0] * 2 == sizes["float32"][0]
    assert sizes["bfloat16"][1] >= 2 * sizes["float32"][1] - 1  # twice the tokens per byte


CONFIGS = {
    "default": {},
    "torch-kernels": {"cpu_kernels": False},
    "chunked-32": {"max_num_batched_tokens": 32},
    "preempting": {"num_kv_blocks": 30, "max_model_len": 480},
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(10, 8192) for _ in range(n)] for n in (3, 17, 64, 129, 200, 300)]


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def reference_outputs(reference: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    return greedy(reference, prompts, NUM_OUTPUT)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_demo_model_follows_transformers_until_a_near_tie(
    name: str,
    demo_model_dir: Path,
    prompts: list[list[int]],
    reference: torch.nn.Module,
    reference_outputs: list[list[int]],
) -> None:
    llm = LLM(str(demo_model_dir), kv_cache_memory=64 << 20, dtype="bfloat16", **CONFIGS[name])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_OUTPUT, ignore_eos=True)
    for _ in range(2):  # the second pass on a warm prefix cache
        outs = llm.generate(prompts, params)
        for prompt, out, ref in zip(prompts, outs, reference_outputs, strict=True):
            div = first_divergence(reference, prompt, out.outputs[0].token_ids, ref)
            assert div is None or div.is_near_tie, f"len {len(prompt)}: {div}"
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks
    if name == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.smollm2
def test_smollm2_chat_follows_transformers_until_a_near_tie(smollm2_dir: Path) -> None:
    results = run_agreement(str(smollm2_dir), "bfloat16", max_tokens=24)
    assert len(results) == len(QUESTIONS)
    for i, (_, div) in enumerate(results):
        assert div is None or div.is_near_tie, f"question {i}: {div}"
