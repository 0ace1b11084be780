"""Multi-LoRA end to end: mixed batches of adapters and base requests equal peft token
for token; the prefix cache never shares KV across adapters; adapters come and go
while requests run; memory stays flat."""

from __future__ import annotations

import gc
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hf_reference import hf_greedy, peft_greedy

from adapters.demo import clone_adapter
from adapters.peft import describe_base
from adapters.registry import AdapterRegistry
from engine.frontend.offline import LLM
from engine.lora.types import LoRARequest
from engine.request import SamplingParams

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 8000, size=n).tolist() for n in lengths]


def make_llm(model_dir: Path, registry: AdapterRegistry, **kwargs) -> LLM:
    defaults = dict(
        num_kv_blocks=512, block_size=16, max_loras=4, max_num_batched_tokens=96, dtype="float32"
    )
    return LLM(str(model_dir), lora_loader=registry.load, **(defaults | kwargs))


@pytest.fixture()
def registry(demo_model_dir: Path, demo_adapters: dict[str, Path]) -> AdapterRegistry:
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    for name, path in demo_adapters.items():
        registry.register(name, path)
    return registry


# cpu_kernels: the C++ op over each slot's run of rows; off: kernels/lora.py's torch paths
# (masked dense for these small steps, grouped for the rest).
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["native", "torch"])
def test_a_mixed_batch_of_five_adapters_and_the_base_model_matches_peft(
    demo_model_dir: Path,
    demo_adapters: dict[str, Path],
    registry: AdapterRegistry,
    cpu_kernels: bool,
) -> None:
    names = [*demo_adapters, None]
    # Two prompts per adapter; the second shares the first's 48-token prefix (cache hits).
    firsts = random_prompts([70, 5, 33, 120, 17, 64], seed=1)
    tails = random_prompts([9, 30, 2, 14, 40, 21], seed=2)
    prompts, loras = [], []
    for name, first, tail in zip(names, firsts, tails, strict=True):
        prompts += [first, first[:48] + tail]
        loras += [None if name is None else registry.get(name)] * 2
    # Five adapters, four slots: the fifth waits for a slot to drain, in the same run.
    llm = make_llm(demo_model_dir, registry, max_loras=4, cpu_kernels=cpu_kernels)
    outputs = llm.generate(prompts, GREEDY, lora_request=loras)

    for name in names:
        rows = [i for i, lora in enumerate(loras) if (lora and lora.name) == name]
        mine = [prompts[i] for i in rows]
        expected = (
            hf_greedy(demo_model_dir, mine, MAX_NEW)
            if name is None
            else peft_greedy(demo_model_dir, demo_adapters[name], mine, MAX_NEW)
        )
        assert [outputs[i].outputs[0].token_ids for i in rows] == expected, name
    assert llm.engine.kv.num_free_blocks == 512
    assert llm.engine.lora.num_loads == 5
    # The adapters matter: base outputs differ from every adapter's.
    base = hf_greedy(demo_model_dir, prompts[:2], MAX_NEW)
    assert base != [o.outputs[0].token_ids for o in outputs[:2]]


# Sixteen adapters (twice the eight a step once held), of ranks 8 to 64 on all projections
# and on attention only: each is built by peft (seed 100 + its index).
MIXED_RANKS = [(rank, targets) for targets in ("all", "attention") for rank in (8, 16, 32, 64)] * 2


@dataclass
class MixedRankCase:
    """A short prompt per adapter and one for the base model, then long prompts under four
    adapters of every rank and the base model; each request's peft (or transformers) greedy
    output."""

    registry: AdapterRegistry
    prompts: list[list[int]]
    loras: list[LoRARequest | None]
    expected: list[list[int]]
    num_short: int


@pytest.fixture(scope="module")
def mixed_rank_case(demo_model_dir: Path, demo_adapter: Callable[..., Path]) -> MixedRankCase:
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=64)
    paths = {
        f"m{i}-r{rank}-{targets}": demo_adapter(rank, targets, seed=100 + i)
        for i, (rank, targets) in enumerate(MIXED_RANKS)
    }
    adapters = [registry.register(name, path) for name, path in paths.items()]
    loras: list[LoRARequest | None] = [*adapters, None]
    num_short = len(loras)
    prompts = random_prompts([3 + i % 6 for i in range(num_short)], seed=9)
    # Ranks 8, 16, 32 and 64; 70 to 150 tokens, chunked over several steps.
    loras += [adapters[0], adapters[5], adapters[10], adapters[15], None]
    prompts += random_prompts([70, 150, 95, 120, 60], seed=10)
    expected = [
        hf_greedy(demo_model_dir, [prompt], MAX_NEW)[0]
        if lora is None
        else peft_greedy(demo_model_dir, paths[lora.name], [prompt], MAX_NEW)[0]
        for prompt, lora in zip(prompts, loras, strict=True)
    ]
    return MixedRankCase(registry, prompts, loras, expected, num_short)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["native", "torch"])
def test_sixteen_adapters_of_ranks_8_to_64_in_one_step_match_peft(
    demo_model_dir: Path, mixed_rank_case: MixedRankCase, cpu_kernels: bool
) -> None:
    case = mixed_rank_case
    llm = make_llm(
        demo_model_dir,
        case.registry,
        max_loras=16,
        max_lora_rank=64,
        max_num_batched_tokens=128,
        cpu_kernels=cpu_kernels,
    )
    # Adapters load off the engine thread: one token under each first, so that all sixteen
    # are in their slots when the batch comes.
    adapters = case.loras[: case.num_short - 1]
    warm = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([[7]] * len(adapters), warm, lora_request=adapters)
    engine = llm.engine
    for i, (prompt, lora) in enumerate(zip(case.prompts, case.loras, strict=True)):
        engine.add_request(str(i), prompt, GREEDY, lora=lora)
    outputs: list[list[int]] = [[] for _ in case.prompts]
    first_step: dict[int, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for update in engine.step():
            i = int(update.request_id)
            first_step.setdefault(i, step)
            outputs[i] += update.new_token_ids
    # Every short prompt in the first step: sixteen adapters of four ranks and the base model
    # in one forward pass; then their decode rows beside the long prompts' chunks (128 tokens
    # a step: each long prompt's prefill spans two steps or more).
    assert [first_step[i] for i in range(case.num_short)] == [1] * case.num_short
    assert min(first_step[i] for i in range(case.num_short, len(case.prompts))) >= 2
    for i, (lora, got, expected) in enumerate(zip(case.loras, outputs, case.expected, strict=True)):
        assert got == expected, (i, lora and lora.name)
    assert engine.kv.num_free_blocks == 512


def cached_tokens(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> tuple[int, list[int]]:
    out = llm.generate([prompt], GREEDY, lora_request=lora)[0]
    return out.num_cached_tokens, out.outputs[0].token_ids


def test_prefix_cache_blocks_are_shared_under_one_adapter_only(
    demo_model_dir: Path, demo_adapters: dict[str, Path], registry: AdapterRegistry, tmp_path: Path
) -> None:
    llm = make_llm(demo_model_dir, registry)
    prompt = random_prompts([64], seed=3)[0]
    a, b = registry.get("r8-all"), registry.get("r4-attn")
    assert cached_tokens(llm, prompt, a)[0] == 0
    assert cached_tokens(llm, prompt, b)[0] == 0  # another adapter: no shared blocks
    assert cached_tokens(llm, prompt, None)[0] == 0  # the base model neither
    hits, first_out = cached_tokens(llm, prompt, a)
    assert hits == 48  # the same adapter: every full block but the last token's

    # The same name, new weights: a new identity, so new blocks and the new weights' output.
    replaced = tmp_path / "replaced"
    clone_adapter(demo_adapters["r8-all"], replaced, seed=99)
    registry.register("r8-all", replaced)
    a2 = registry.get("r8-all")
    assert a2.adapter_id != a.adapter_id
    hits, new_out = cached_tokens(llm, prompt, a2)
    assert hits == 0
    assert new_out == peft_greedy(demo_model_dir, replaced, [prompt], MAX_NEW)[0] != first_out


def test_adapters_load_and_unload_while_requests_run(
    demo_model_dir: Path, demo_adapters: dict[str, Path], registry: AdapterRegistry
) -> None:
    llm = make_llm(demo_model_dir, registry, max_loras=2)
    engine = llm.engine
    prompts = random_prompts([20, 20, 20], seed=4)
    a, b, c = (registry.get(n) for n in ("r4-attn", "r8-all", "r16-all"))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompts[0], params, lora=a)
    engine.add_request("b", prompts[1], params, lora=b)
    outputs: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    steps = 0
    while engine.has_unfinished_requests():
        for update in engine.step():
            outputs[update.request_id] += update.new_token_ids
        steps += 1
        if steps == 10:
            engine.lora.unload(a.adapter_id)  # pinned by "a": stays until "a" finishes
            engine.add_request("c", prompts[2], params, lora=c)  # waits for a slot
    assert outputs["a"] == peft_greedy(demo_model_dir, demo_adapters["r4-attn"], prompts[:1], 40)[0]
    assert outputs["b"] == peft_greedy(demo_model_dir, demo_adapters["r8-all"], prompts[1:2], 40)[0]
    assert outputs["c"] == peft_greedy(demo_model_dir, demo_adapters["r16-all"], prompts[2:], 40)[0]
    assert a.adapter_id not in engine.lora.slot_of and a.adapter_id not in engine.lora.cpu_cache
    assert engine.kv.num_free_blocks == 512


def test_an_adapter_whose_files_changed_fails_its_request_and_the_engine_keeps_serving(
    demo_model_dir: Path, demo_adapters: dict[str, Path], tmp_path: Path
) -> None:
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    path = tmp_path / "moving"
    clone_adapter(demo_adapters["r4-attn"], path, seed=5)
    lora = registry.register("moving", path)
    clone_adapter(demo_adapters["r4-attn"], tmp_path / "other", seed=6)
    shutil.rmtree(path)
    shutil.copytree(tmp_path / "other", path)  # swapped behind the registry's back
    llm = make_llm(demo_model_dir, registry)
    prompt = random_prompts([10], seed=7)
    bad, good = llm.generate(prompt * 2, GREEDY, lora_request=[lora, None])
    assert bad.outputs[0].finish_reason == "error"
    assert "changed since registration" in (bad.error or "")
    assert good.outputs[0].token_ids == hf_greedy(demo_model_dir, prompt, MAX_NEW)[0]
    assert llm.engine.kv.num_free_blocks == 512


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_cycling_a_thousand_adapters_through_four_slots_leaves_memory_flat(
    demo_model_dir: Path, demo_adapters: dict[str, Path], tmp_path: Path
) -> None:
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    loras = []
    for i in range(1000):
        path = tmp_path / f"a{i}"
        clone_adapter(demo_adapters["r8-all"], path, seed=1000 + i)
        loras.append(registry.register(f"a{i}", path))
    llm = make_llm(demo_model_dir, registry, max_loras=4, max_cpu_loras=8)
    prompts = random_prompts([8] * 1000, seed=8)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    # The KV pool takes memory as its blocks are first written (engine.heap.lazily_zeroed):
    # written whole first, so that what grows below is the adapters' doing.
    for key_cache, value_cache in llm.engine.runner.kv_caches:
        key_cache.zero_()
        value_cache.zero_()
    rss = []
    for start in range(0, 1000, 100):
        outs = llm.generate(
            prompts[start : start + 100], params, lora_request=loras[start : start + 100]
        )
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        gc.collect()
        rss.append(_rss_bytes())
    lora = llm.engine.lora
    assert lora.num_loads == lora.num_disk_loads == 1000  # no adapter read twice
    assert len(lora.cpu_cache) == 8
    assert lora.cpu_cache_bytes == 8 * next(iter(lora.cpu_cache.values())).nbytes
    assert llm.engine.kv.num_free_blocks == 512
    # After the first hundred, the process does not grow with the adapters it has seen
    # (each adapter's weights are ~70 KiB: 900 leaked copies would be ~60 MiB).
    assert rss[-1] - rss[0] < 16 << 20, [r >> 20 for r in rss]
