"""Sampling, stops, detokenization, abort and request validation on the demo model."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import SequenceUpdate
from engine.request import OutputKind


@pytest.fixture(scope="module")
def llm(demo_model_dir: Path) -> LLM:
    return LLM(str(demo_model_dir), kv_cache_memory=64 << 20, max_model_len=512, dtype="float32")


PROMPTS = ["The cat sat on the", "Once upon a time", 'JSON: {"a": 1,', "café naïve 日本語"]


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not llm.engine.sequences and not llm.engine.parents


def test_seed_reproduces_whatever_shares_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    crowd = (
        llm.generate(
            PROMPTS[1:] + [PROMPTS[0]],
            [SamplingParams(temperature=0.8, max_tokens=20)] * 3 + [seeded],
        )[-1]
        .outputs[0]
        .token_ids
    )
    assert alone == crowd
    other = (
        llm.generate(
            [PROMPTS[0]], SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
        )[0]
        .outputs[0]
        .token_ids
    )
    assert other != alone
    assert_all_blocks_free(llm)


def test_n_samples_share_the_prompt_and_differ(llm: LLM) -> None:
    prompt = list(range(100, 180))  # five full blocks of 16
    out = llm.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=16, ignore_eos=True)
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 16 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # Siblings after the first hit the prompt blocks the first one computes.
    assert out.num_cached_tokens == 64
    assert_all_blocks_free(llm)


def test_top_k_1_is_greedy_and_top_p_keeps_sampling_valid(llm: LLM) -> None:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    top1 = llm.generate(
        PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]
    tiny_p = llm.generate(
        PROMPTS, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in tiny_p]


def test_repetition_penalty_changes_greedy_output(llm: LLM) -> None:
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    penalized = llm.generate(
        PROMPTS,
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=5.0),
    )
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in penalized]
    # A strong frequency penalty forbids repeats in the short run.
    freq = llm.generate(
        [PROMPTS[0]],
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            frequency_penalty=2.0,
            presence_penalty=2.0,
        ),
    )
    tokens = freq[0].outputs[0].token_ids
    assert len(tokens) == 20


def test_logprobs_match_hf(llm: LLM, demo_model_dir: Path) -> None:
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, logprobs=5, ignore_eos=True)
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    first = out.logprobs[0]
    assert len(first) == 5 and out.token_ids[0] in first
    assert max(first, key=first.__getitem__) == out.token_ids[0]
    hf = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    ids = llm.tokenizer(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], dim=-1)
    for token_id, logprob in first.items():
        assert logprob == pytest.approx(float(ref[token_id]), abs=1e-4)


def test_stop_string_across_token_boundaries_is_excluded(llm: LLM) -> None:
    base = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    text = base[0].outputs[0].text
    assert len(text) > 12
    stop = text[5:9]
    out = llm.generate(
        [PROMPTS[1]],
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "never-appears"]),
    )[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert_all_blocks_free(llm)


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    base = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    tokens = base[0].outputs[0].token_ids
    stop_at = tokens[4]
    out = llm.generate(
        [PROMPTS[2]],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]),
    )[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens holds stops back.
    held = llm.generate(
        [PROMPTS[2]],
        SamplingParams(
            temperature=0, max_tokens=20, min_tokens=10, stop_token_ids=[stop_at], ignore_eos=True
        ),
    )[0].outputs[0]
    assert len(held.token_ids) >= 10


def test_max_model_len_ends_generation(demo_model_dir: Path) -> None:
    llm = LLM(str(demo_model_dir), kv_cache_memory=16 << 20, max_model_len=40, dtype="float32")
    out = llm.generate(
        [list(range(50, 80))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    )[0]
    assert len(out.outputs[0].token_ids) == 10
    assert out.outputs[0].finish_reason == "length"


def test_incremental_detokenizer_handles_multibyte_characters(llm: LLM) -> None:
    tokenizer = llm.tokenizer
    text = "naïve café 日本語 🙂 done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 6
    detok = IncrementalDetokenizer(tokenizer, [], [], skip_special_tokens=True)
    for token_id in ids:
        detok.update(token_id)
        assert "\ufffd" not in detok.text
    assert detok.text == text


def test_abort_frees_blocks_at_once(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("x", list(range(10, 300)), SamplingParams(max_tokens=50))
    engine.add_request("y", list(range(10, 100)), SamplingParams(max_tokens=50, n=2))
    engine.step()
    assert engine.kv.num_free_blocks < engine.kv.pool.num_blocks
    engine.abort("x")
    engine.abort("y")
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([1] * 500, SamplingParams(max_tokens=100), "maximum context length"),
        ([10**6], SamplingParams(), "token ids"),
    ],
)
def test_impossible_requests_are_refused_clearly(
    llm: LLM, prompt: list[int], params: SamplingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", prompt, params)
    assert_all_blocks_free(llm)


def test_bad_sampling_values_are_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="n must"):
        SamplingParams(n=0)


def test_updates_carry_each_character_once_and_never_a_held_back_one(llm: LLM) -> None:
    """A step's update carries the text appended since the last one: the deltas of a stream
    join to the finished text, and text that a stop string could still begin is held back
    until it cannot, so no delta holds a character the finished text lacks."""
    base = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    text = base[0].outputs[0].text
    stop = text[14:19]
    engine = llm.engine
    streams: dict[str, list[str]] = {"plain": [], "stopped": []}
    engine.add_request(
        "plain", PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )
    engine.add_request(
        "stopped",
        PROMPTS[1],
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
    )
    while engine.has_unfinished_requests():
        for update in engine.step():
            streams[update.request_id].append(update.text_delta)
    assert "".join(streams["plain"]) == text
    assert sum(1 for delta in streams["plain"] if delta) > 5  # streamed, not sent at the end
    assert "".join(streams["stopped"]) == text[: text.index(stop)]
    assert_all_blocks_free(llm)


def test_a_final_only_request_gets_one_update_with_what_a_stream_carries(llm: LLM) -> None:
    """OutputKind.FINAL_ONLY: one update per sequence, at its end, with every token, the
    whole text and every logprob that the same request's per-step updates carry, beside
    streamed requests in the same steps; its decode time spans its tokens."""
    stop = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=40))[0]
    cases = {
        "plain": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        "stopped": SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, stop=[stop.outputs[0].text[10:14]]
        ),
        "sampled": SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20, logprobs=2),
    }
    engine = llm.engine
    received: dict[tuple[str, str, int], list[SequenceUpdate]] = {}
    for name, params in cases.items():
        prompt = PROMPTS[len(name) % len(PROMPTS)]
        engine.add_request(f"delta-{name}", prompt, params)
        final = replace(params, output_kind=OutputKind.FINAL_ONLY)
        engine.add_request(f"final-{name}", prompt, final)
    start = time.monotonic()
    while engine.has_unfinished_requests():
        for update in engine.step():
            kind, name = update.request_id.split("-")
            received.setdefault((name, kind, update.index), []).append(update)
    elapsed = time.monotonic() - start
    for (name, kind, index), updates in received.items():
        if kind == "delta":
            continue
        assert len(updates) == 1 and updates[0].finished, name
        (final,) = updates
        streamed = received[(name, "delta", index)]
        assert final.new_token_ids == [t for u in streamed for t in u.new_token_ids], name
        assert final.text_delta == "".join(u.text_delta for u in streamed), name
        assert final.finish_reason == streamed[-1].finish_reason
        assert final.stop_reason == streamed[-1].stop_reason
        if cases[name].logprobs is None:
            assert final.new_logprobs is None
        else:
            assert final.new_logprobs == [p for u in streamed for p in u.new_logprobs or []]
        assert 0.0 < final.decode_time < elapsed
        assert all(u.decode_time == 0.0 for u in streamed)
    assert {k for k in received if k[1] == "final"} == {
        (n, "final", i) for n, p in cases.items() for i in range(p.n)
    }
    assert_all_blocks_free(llm)
