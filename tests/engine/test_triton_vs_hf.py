"""End to end with the triton kernels forced on (kernels="triton"; on the CPU they run
under triton's interpreter, so the steps are few and small): greedy outputs equal
Hugging Face transformers and peft token for token in float32, through chunked prefill,
prefix-cache hits and a mixed batch of adapters."""

from __future__ import annotations

import random
from pathlib import Path

from hf_reference import hf_greedy, peft_greedy

from adapters.peft import describe_base
from adapters.registry import AdapterRegistry
from engine import LLM, SamplingParams
from kernels import dispatch

NUM_OUTPUT = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_OUTPUT, ignore_eos=True)


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 8000) for _ in range(n)] for n in lengths]


def test_greedy_matches_hf_with_triton_kernels(demo_model_dir: Path) -> None:
    # 40 tokens in chunks of 24: a chunk that starts mid-sequence; lengths across blocks.
    batch = prompts([1, 5, 17, 40], seed=3)
    expected = hf_greedy(demo_model_dir, batch, NUM_OUTPUT)
    llm = LLM(
        str(demo_model_dir),
        dtype="float32",
        kernels="triton",
        num_kv_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=24,
    )
    assert llm.engine.runner.kernels.backend is dispatch.Backend.TRITON
    for _ in range(2):  # the second pass on a warm prefix cache
        outs = llm.generate(batch, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert max(o.num_cached_tokens for o in outs) > 0


def test_mixed_adapters_match_peft_with_triton_kernels(
    demo_model_dir: Path, demo_adapters: dict[str, Path]
) -> None:
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    names = ["r4-attn", "r16-all"]
    for name in names:
        registry.register(name, demo_adapters[name])
    batch = prompts([9, 20, 3], seed=4)
    loras = [registry.get(names[0]), None, registry.get(names[1])]
    llm = LLM(
        str(demo_model_dir),
        dtype="float32",
        kernels="triton",
        num_kv_blocks=64,
        max_model_len=256,
        max_loras=2,
        lora_loader=registry.load,
    )
    outs = llm.generate(batch, GREEDY, lora_request=loras)
    expected = [
        peft_greedy(demo_model_dir, demo_adapters[names[0]], batch[:1], NUM_OUTPUT)[0],
        hf_greedy(demo_model_dir, batch[1:2], NUM_OUTPUT)[0],
        peft_greedy(demo_model_dir, demo_adapters[names[1]], batch[2:], NUM_OUTPUT)[0],
    ]
    assert [o.outputs[0].token_ids for o in outs] == expected
