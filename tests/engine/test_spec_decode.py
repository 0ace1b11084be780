"""n-gram speculative decoding: proposals, greedy outputs equal to the non-speculative
engine's and transformers' (prefix caching, chunked prefill, preemption, LoRA and guided
requests in the batch), no KV left behind, and rejection sampling that keeps the sampling
distribution."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hf_reference import hf_greedy

from adapters.peft import describe_base
from adapters.registry import AdapterRegistry
from engine import LLM, SamplingParams
from engine.request import GuidedSpec, Request
from engine.sampler import Sampler
from engine.spec_decode import NgramIndex, SpeculativeConfig, verify

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
NUM_OUTPUT = 48


def _brute_force(tokens: list[int], config: SpeculativeConfig, limit: int) -> list[int]:
    k = min(config.num_speculative_tokens, limit)
    for n in range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k] if k > 0 else []
    return []


def test_the_index_proposes_what_followed_the_latest_longest_match() -> None:
    rng = random.Random(0)
    for trial in range(300):
        config = SpeculativeConfig(
            num_speculative_tokens=rng.randint(1, 6),
            prompt_lookup_min=(lo := rng.randint(1, 3)),
            prompt_lookup_max=rng.randint(lo, 5),
        )
        index = NgramIndex(config)
        tokens = [rng.randrange(6) for _ in range(rng.randint(1, 12))]
        for _ in range(20):  # grown a token at a time, as a request's output is
            limit = rng.randint(0, 6)
            assert index.propose(tokens, limit) == _brute_force(tokens, config, limit), (
                trial,
                tokens,
            )
            tokens.append(rng.randrange(6))


def test_the_config_takes_vllms_names_and_refuses_the_rest() -> None:
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (5, 4)
    for bad, message in [
        ('{"method": "eagle"}', "must be one of"),
        ('{"num_speculative_tokens": 3}', 'needs "method"'),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "lookup_min"),
        ('{"method": "ngram", "draft_model": "x"}', "unknown"),
        ("[1]", "JSON object"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)


@pytest.fixture(scope="module")
def registry(demo_model_dir: Path, demo_adapters: dict[str, Path]) -> AdapterRegistry:
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    registry.register("r8-all", demo_adapters["r8-all"])
    return registry


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts that repeat themselves (so drafts are proposed and accepted) and plain ones."""
    rng = random.Random(3)
    looping = [[rng.randrange(10, 4000) for _ in range(n)] * 4 for n in (3, 9, 20, 40)]
    plain = [[rng.randrange(10, 8000) for _ in range(n)] for n in (1, 17, 100)]
    return looping + plain


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(demo_model_dir, prompts, NUM_OUTPUT)


CONFIGS = {
    "default": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-24": {"max_num_batched_tokens": 24},
    "preempting": {"num_kv_blocks": 24, "max_model_len": 384},
    "torch-kernels": {"cpu_kernels": False},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_transformers_token_for_token(
    name: str, demo_model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    llm = LLM(
        str(demo_model_dir),
        dtype="float32",
        kv_cache_memory=64 << 20,
        speculative_config=SPEC,
        **CONFIGS[name],
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_OUTPUT, ignore_eos=True)
    for _ in range(2):  # the second pass on a warm prefix cache
        outs = llm.generate(prompts, params)
        for i, (out, ref) in enumerate(zip(outs, reference, strict=True)):
            assert out.outputs[0].token_ids == ref, f"prompt {i}"
        kv = llm.engine.kv
        assert kv.num_free_blocks == kv.pool.num_blocks
    engine = llm.engine
    # The demo model's output never repeats: its drafts are proposed (from the looping
    # prompts) and rejected, which exercises the roll-back; SmolLM2 below accepts them.
    assert engine.num_draft_tokens > 0
    if name == "preempting":
        assert engine.scheduler.num_preemptions > 0


def test_lora_and_guided_requests_share_the_batch(
    demo_model_dir: Path, registry: AdapterRegistry, prompts: list[list[int]]
) -> None:
    """Adapters speculate under their own weights; guided requests do not speculate and
    keep their grammar; every output equals the engine without speculation."""
    lora = registry.get("r8-all")
    guided = SamplingParams(
        temperature=0.0, max_tokens=24, guided=GuidedSpec(regex=r"(ab|cd){2,8}")
    )
    plain = SamplingParams(temperature=0.0, max_tokens=NUM_OUTPUT, ignore_eos=True)
    batch = prompts + prompts[:3] + prompts[:2]
    params = [plain] * (len(prompts) + 3) + [guided] * 2
    loras = [None] * len(prompts) + [lora] * 3 + [None, lora]
    outputs = {}
    for spec in (None, SPEC):
        llm = LLM(
            str(demo_model_dir),
            dtype="float32",
            kv_cache_memory=64 << 20,
            max_model_len=512,
            lora_loader=registry.load,
            speculative_config=spec,
        )
        outs = llm.generate(batch, params, lora_request=loras)
        outputs[spec] = [o.outputs[0].token_ids for o in outs]
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks
        if spec is not None:
            assert llm.engine.num_draft_tokens > 0
            assert all(c in "abcd" for o in outs[-2:] for c in o.outputs[0].text)
    assert outputs[SPEC] == outputs[None]


def _request(temperature: float, seed: int | None = None) -> Request:
    params = SamplingParams(temperature=temperature, max_tokens=100, ignore_eos=True, seed=seed)
    return Request("r", [1, 2, 3], params, eos_token_id=None)


def test_rejection_sampling_keeps_the_distribution() -> None:
    """Whatever the draft, the first token is distributed as p and the second as the
    model's distribution after the first: drawn 20,000 times against exact probabilities."""
    torch.manual_seed(0)
    vocab, trials = 5, 20_000
    logits = torch.tensor(
        [[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 1.5, -0.5, 1.0, 0.2], [1.0, 0.0, 0.0, 2.0, -2.0]]
    )
    p = torch.softmax(logits / 0.8, dim=-1)
    sampler = Sampler(torch.device("cpu"), seed=1)
    request = _request(0.8)
    for drafts in ([0, 1], [3, 3], [4, 0]):
        first = torch.zeros(vocab)
        second_given_draft = torch.zeros(vocab)
        num_first_is_draft = 0
        for _ in range(trials):
            tokens = verify(logits, request, drafts, sampler)
            first[tokens[0]] += 1
            if tokens[0] == drafts[0]:
                num_first_is_draft += 1
                assert len(tokens) >= 2
                second_given_draft[tokens[1]] += 1
        # Within ~4.5 standard errors of a binomial count at every token.
        for counts, probs, n in (
            (first, p[0], trials),
            (second_given_draft, p[1], num_first_is_draft),
        ):
            expected = probs * n
            tolerance = 4.5 * torch.sqrt(n * probs * (1 - probs)) + 1
            assert torch.all((counts - expected).abs() <= tolerance), (drafts, counts, expected)


def test_greedy_verification_takes_the_agreeing_prefix() -> None:
    logits = torch.full((4, 6), -5.0)
    for position, token in enumerate([2, 4, 1, 5]):
        logits[position, token] = 5.0
    sampler = Sampler(torch.device("cpu"), seed=0)
    greedy = _request(0.0)
    assert verify(logits, greedy, [2, 4, 1], sampler) == [2, 4, 1, 5]  # all, then the bonus
    assert verify(logits, greedy, [2, 3, 1], sampler) == [2, 4]  # stops at the first miss
    assert verify(logits, greedy, [0, 4, 1], sampler) == [2]


def test_a_seeded_request_draws_the_same_tokens_again() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    sampler = Sampler(torch.device("cpu"), seed=0)
    runs = {tuple(verify(logits, _request(1.0, seed=7), [3, 9, 11], sampler)) for _ in range(5)}
    assert len(runs) == 1


DOCUMENTS = [
    "Invoice INV-2024-0042. Customer: Acme Robotics Ltd, 14 Harbour Street, Bristol. "
    "Items: 3 x servo motor SM-220 at 45.00; 2 x controller board CB-9 at 120.00. "
    "Total: 375.00 GBP.",
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):"
    "\n    return 2 * (width + height)\n",
    "Monday: stand-up at 9:30, design review at 11:00, lunch with Priya at 12:30, "
    "release planning at 15:00.",
]
SMOLLM2_CONFIGS = {
    "default": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-32": {"max_num_batched_tokens": 32},
    "preempting": {"num_kv_blocks": 14, "max_model_len": 224},
}


@pytest.mark.smollm2
@pytest.mark.parametrize("name", list(SMOLLM2_CONFIGS))
def test_smollm2_copies_with_most_drafts_accepted(name: str, smollm2_dir: Path) -> None:
    """A real model copying from its prompt accepts most drafts; its greedy output is the
    non-speculative engine's, token for token, in every scheduling configuration."""
    outputs, engines = [], []
    for spec in (None, SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2)):
        llm = LLM(
            str(smollm2_dir),
            dtype="float32",
            **({"kv_cache_memory": 256 << 20, "max_model_len": 1024} | SMOLLM2_CONFIGS[name]),
            speculative_config=spec,
        )
        prompts = [llm.chat_prompt(f"Repeat this exactly:\n\n{doc}") for doc in DOCUMENTS]
        params = SamplingParams(temperature=0, max_tokens=48)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        engines.append(llm.engine)
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks
    assert outputs[1] == outputs[0]
    spec_engine = engines[1]
    assert spec_engine.num_accepted_tokens > spec_engine.num_draft_tokens // 2
    if name == "preempting":
        assert spec_engine.scheduler.num_preemptions > 0
