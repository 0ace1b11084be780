"""Guided decoding on the demo model and SmolLM2: JSON schemas, JSON objects, regex, choice and
EBNF grammars; refusals and limits; what guided rows must leave alone."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from guided_schemas import SCHEMAS

from adapters.peft import describe_base
from adapters.registry import AdapterRegistry
from engine import LLM, SamplingParams
from engine.errors import GuidedSpecError
from engine.guided import GrammarBitmask, GrammarCache, GuidedLimits, mask_logits_cpu
from engine.outputs import CompletionOutput
from engine.request import GuidedSpec, Request

FORMATS = jsonschema.FormatChecker()
REGEXES = [
    r"[0-9]{3}-[a-z]{2,4}",
    r"(yes|no)!?",
    r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6})?",
    r"0x[0-9a-f]{4}",
]
CHOICES = ["red", "green", "blue", "light blue", 'say "hi"']
# A bracketed list of one- or two-digit numbers, as an EBNF grammar and as the equivalent regex.
EBNF = 'root ::= "[" num ("," num)* "]"\nnum ::= [1-9] [0-9]?'
EBNF_AS_REGEX = r"\[[1-9][0-9]?(,[1-9][0-9]?)*\]"


# One torch thread: these models' matmuls are too small to split, and on a shared two-core
# machine a second thread mostly waits for the first (several times slower under load).
THREADS = 1


@pytest.fixture(scope="module")
def llm(demo_model_dir: Path) -> LLM:
    return LLM(
        str(demo_model_dir),
        kv_cache_memory=64 << 20,
        max_model_len=1024,
        num_threads=THREADS,
        dtype="float32",
    )


def chat_prompt(llm: LLM, message: str) -> list[int]:
    return llm.chat_prompt(message)


def run_schemas(llm: LLM, max_tokens: int, sampled: bool) -> dict[str, CompletionOutput]:
    """Every schema of SCHEMAS in one batch: greedy, and (if `sampled`) seeded at temperature 1.
    The prompt stays short (prefill dominates on a CPU); the grammar does the rest."""
    prompt = chat_prompt(llm, "Reply with a small JSON example.")
    prompts, params, keys = [], [], []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        spec = GuidedSpec(json_schema=schema)
        prompts.append(prompt)
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens, guided=spec))
        keys.append(f"{name}/greedy")
        if sampled:
            prompts.append(prompts[-1])
            params.append(
                SamplingParams(
                    temperature=1.0, top_p=0.9, seed=i, max_tokens=max_tokens, guided=spec
                )
            )
            keys.append(f"{name}/sampled")
    outputs = llm.generate(prompts, params)
    assert_all_blocks_free(llm)
    return {key: out.outputs[0] for key, out in zip(keys, outputs, strict=True)}


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not llm.engine.sequences and not llm.engine.parents


def assert_valid(output: CompletionOutput, schema: dict[str, Any]) -> None:
    """A finished output parses, validates, and is compact; one cut by max_tokens proves nothing."""
    assert output.finish_reason in ("stop", "length"), output
    if output.finish_reason == "stop":
        jsonschema.validate(json.loads(output.text), schema, format_checker=FORMATS)
    assert not has_free_whitespace(output.text), output.text


def has_free_whitespace(text: str) -> bool:
    """Whitespace outside JSON strings (compact JSON has none)."""
    in_string = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif in_string:
            escaped = ch == "\\"
            in_string = ch != '"'
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            return True
    return False


def stop_share(outputs: dict[str, CompletionOutput]) -> float:
    return sum(o.finish_reason == "stop" for o in outputs.values()) / len(outputs)


# -- JSON schemas ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_outputs(llm: LLM) -> dict[str, CompletionOutput]:
    return run_schemas(llm, max_tokens=128, sampled=True)


def test_there_are_thirty_schemas_or_more() -> None:
    assert len(SCHEMAS) >= 30


@pytest.mark.parametrize("name", SCHEMAS)
def test_demo_json_follows_the_schema(demo_outputs: dict[str, CompletionOutput], name: str) -> None:
    assert_valid(demo_outputs[f"{name}/greedy"], SCHEMAS[name])
    assert_valid(demo_outputs[f"{name}/sampled"], SCHEMAS[name])


def test_most_demo_outputs_finish_within_max_tokens(
    demo_outputs: dict[str, CompletionOutput],
) -> None:
    # Only unbounded numbers and strings may run to max_tokens on random weights.
    assert stop_share(demo_outputs) >= 0.8


def test_json_object_gives_objects(llm: LLM) -> None:
    params = [
        SamplingParams(
            temperature=1.0, seed=seed, max_tokens=128, guided=GuidedSpec(json_object=True)
        )
        for seed in range(8)
    ]
    outputs = [o.outputs[0] for o in llm.generate(["Give me a JSON object:"] * 8, params)]
    finished = [o for o in outputs if o.finish_reason == "stop"]
    assert finished
    for output in finished:
        assert isinstance(json.loads(output.text), dict)
    for output in outputs:
        assert output.text.startswith("{")


# -- regex, choice, grammar -----------------------------------------------------------------


def run_patterns(
    llm: LLM, prompts: list[str | list[int]]
) -> list[tuple[GuidedSpec, CompletionOutput]]:
    specs = [GuidedSpec(regex=r) for r in REGEXES] + [
        GuidedSpec(choice=tuple(CHOICES)),
        GuidedSpec(grammar=EBNF),
    ]
    jobs = [(spec, prompt) for spec in specs for prompt in prompts]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=48, guided=spec)
        for i, (spec, _) in enumerate(jobs)
    ]
    outputs = llm.generate([prompt for _, prompt in jobs], params)
    return [(spec, out.outputs[0]) for (spec, _), out in zip(jobs, outputs, strict=True)]


def assert_matches(spec: GuidedSpec, output: CompletionOutput) -> None:
    if spec.choice is not None:
        assert output.finish_reason == "stop" and output.text in spec.choice
        return
    pattern = spec.regex if spec.regex is not None else EBNF_AS_REGEX
    if output.finish_reason == "stop":
        assert re.fullmatch(pattern, output.text), (pattern, output.text)
    else:
        assert output.finish_reason == "length"


def test_regex_choice_and_grammar_outputs_match(llm: LLM) -> None:
    results = run_patterns(llm, ["The answer:", "Once upon a time", "x", "Pick one"])
    for spec, output in results:
        assert_matches(spec, output)
    assert sum(o.finish_reason == "stop" for _, o in results) >= 0.8 * len(results)
    assert_all_blocks_free(llm)


def test_n_samples_each_follow_the_grammar(llm: LLM) -> None:
    spec = GuidedSpec(json_schema=SCHEMAS["array_of_objects"])
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=96, guided=spec)
    outputs = llm.generate(["Inventory:"], params)[0].outputs
    assert [o.index for o in outputs] == [0, 1, 2, 3]
    for output in outputs:
        assert_valid(output, SCHEMAS["array_of_objects"])
    assert len({o.text for o in outputs}) > 1


# -- ends -----------------------------------------------------------------------------------


def test_a_grammar_that_can_only_end_ends_without_an_eos_step(llm: LLM) -> None:
    eos = llm.engine.eos_token_ids
    spec = GuidedSpec(choice=("forty-two",))
    for params in (
        SamplingParams(temperature=0, max_tokens=32, guided=spec),
        # The grammar's end wins over ignore_eos and min_tokens.
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, min_tokens=20, guided=spec),
    ):
        output = llm.generate(["The answer is"], params)[0].outputs[0]
        assert (output.text, output.finish_reason) == ("forty-two", "stop")
        assert not set(output.token_ids) & eos


def test_max_tokens_before_the_grammar_ends_is_length(llm: LLM) -> None:
    spec = GuidedSpec(json_schema=SCHEMAS["closed_object_many"])
    output = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=4, guided=spec))[0]
    assert output.outputs[0].finish_reason == "length"
    assert len(output.outputs[0].token_ids) == 4
    assert output.outputs[0].text.startswith('{"f0"')


def test_min_tokens_holds_back_eos_only_where_the_grammar_goes_on(llm: LLM) -> None:
    spec = GuidedSpec(regex=r"[0-9]+")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, min_tokens=6, guided=spec)
    for output in llm.generate(["Digits:"] * 4, params):
        completion = output.outputs[0]
        assert len(completion.token_ids) >= 6
        assert re.fullmatch("[0-9]+", completion.text)


def test_eos_is_allowed_only_where_the_grammar_can_end(llm: LLM) -> None:
    """The step bitmask itself: no EOS before a digit, EOS allowed after one."""
    engine = llm.engine
    future = engine.grammars.submit(GuidedSpec(regex=r"[0-9]+"))
    request = Request("r", [1, 2, 3], SamplingParams(), min(engine.eos_token_ids))
    request.grammar = engine.grammars.sequence_grammar(future)
    future.result()
    assert request.grammar.try_start(0.0)
    eos = min(engine.eos_token_ids)
    digit = llm.tokenizer.convert_tokens_to_ids("7")
    letter = llm.tokenizer.convert_tokens_to_ids("a")

    def allowed() -> torch.Tensor:
        logits = torch.zeros(2, engine.vocab_size)
        GrammarBitmask().apply(logits, [Request("u", [1], SamplingParams(), eos), request])
        assert torch.equal(logits[0], torch.zeros(engine.vocab_size))  # unguided row untouched
        return logits[1] > float("-inf")

    first = allowed()
    assert first[digit] and not first[letter] and not first[eos]
    assert request.grammar.accept(digit) and not request.grammar.must_end()
    after = allowed()
    assert after[digit] and after[eos] and not after[letter]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [8192, 49155])
def test_cpu_masking_equals_xgrammars_kernel(vocab: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    sparse = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=generator)
    sparse[:3] &= sparse[3:]  # some rows sparser than others
    sparse[4, : words // 2] = -1  # half the vocabulary allowed
    logits = torch.randn(6, vocab, generator=generator).to(dtype)
    for rows in ([0, 1, 2, 3, 4, 5], [1, 4], [5]):
        ours, theirs = logits.clone(), logits.clone()
        mask_logits_cpu(ours, sparse, rows)
        xgr.apply_token_bitmask_inplace(theirs, sparse, vocab_size=vocab, indices=rows)
        assert torch.equal(ours, theirs)


# -- what guided rows leave alone -----------------------------------------------------------


def test_unguided_rows_are_token_identical_next_to_guided_ones(llm: LLM) -> None:
    plain = ["The cat sat on the", "Once upon a time", "café naïve", list(range(300, 340))]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=12, max_tokens=24),
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True),
    ]
    alone = [o.outputs[0].token_ids for o in llm.generate(plain, params)]
    guided = [
        SamplingParams(temperature=t, seed=s, max_tokens=24, guided=GuidedSpec(json_schema=schema))
        for t, s, schema in zip(
            (0, 1.0, 0.5, 0),
            (1, 2, 3, 4),
            (SCHEMAS["defs_ref"], SCHEMAS["string_map"], SCHEMAS["matrix"], SCHEMAS["number_free"]),
            strict=True,
        )
    ]
    mixed_prompts: list[str | list[int]] = []
    mixed_params = []
    for prompt, p, g in zip(plain, params, guided, strict=True):
        mixed_prompts += [prompt, "JSON:"]
        mixed_params += [p, g]
    mixed = llm.generate(mixed_prompts, mixed_params)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == alone


def test_guided_requests_under_lora_adapters(
    demo_model_dir: Path, demo_adapters: dict[str, Path]
) -> None:
    """Adapters change the logits, the grammar masks them: guided outputs under adapters
    validate and equal their runs alone; unguided adapter rows beside them are untouched."""
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    for name in ("r4-attn", "r8-all"):
        registry.register(name, demo_adapters[name])
    llm = LLM(
        str(demo_model_dir),
        num_kv_blocks=256,
        max_loras=2,
        lora_loader=registry.load,
        num_threads=THREADS,
        dtype="float32",
    )
    loras = [registry.get("r4-attn"), registry.get("r8-all"), None] * 2
    schemas = ["array_of_objects", "defs_ref", "any_of_objects"] * 2
    guided = [
        SamplingParams(temperature=0, max_tokens=48, guided=GuidedSpec(json_schema=SCHEMAS[n]))
        for n in schemas
    ]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [list(range(200 + 9 * i, 240 + 9 * i)) for i in range(len(loras))]
    guided_alone = llm.generate(prompts, guided, lora_request=loras)
    plain_alone = llm.generate(prompts, plain, lora_request=loras)
    mixed = llm.generate(prompts * 2, guided + [plain] * len(prompts), lora_request=loras + loras)
    n = len(prompts)
    assert [o.outputs[0].token_ids for o in mixed[:n]] == [
        o.outputs[0].token_ids for o in guided_alone
    ]
    assert [o.outputs[0].token_ids for o in mixed[n:]] == [
        o.outputs[0].token_ids for o in plain_alone
    ]
    for name, output in zip(schemas, guided_alone, strict=True):
        assert_valid(output.outputs[0], SCHEMAS[name])
    assert sum(o.outputs[0].finish_reason == "stop" for o in guided_alone) >= n - 1
    # The adapters reach guided rows: some documents differ from the base model's.
    base = llm.generate(prompts, guided)
    adapted = [i for i, lora in enumerate(loras) if lora is not None]
    assert any(base[i].outputs[0].text != guided_alone[i].outputs[0].text for i in adapted)
    assert_all_blocks_free(llm)


def test_preemption_does_not_advance_a_matcher_twice(demo_model_dir: Path, llm: LLM) -> None:
    names = ["array_of_objects", "defs_ref", "closed_object_many", "chained_refs"] * 2
    prompts = [list(range(100 + 7 * i, 160 + 7 * i)) for i in range(len(names))]
    params = [
        SamplingParams(temperature=0, max_tokens=48, guided=GuidedSpec(json_schema=SCHEMAS[n]))
        for n in names
    ]
    roomy = llm.generate(prompts, params)
    tight = LLM(
        str(demo_model_dir),
        num_kv_blocks=40,
        block_size=4,
        max_model_len=160,
        num_threads=THREADS,
        dtype="float32",
    )
    cramped = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    for name, a, b in zip(names, roomy, cramped, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert_valid(b.outputs[0], SCHEMAS[name])
    assert_all_blocks_free(tight)


# -- compiling: off the step loop, cached, refused ------------------------------------------


def test_a_slow_compile_stalls_nobody(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    release = threading.Event()
    real = engine.grammars._compile_unchecked

    def held(spec: GuidedSpec) -> Any:
        release.wait(60)
        return real(spec)

    monkeypatch.setattr(engine.grammars, "_compile_unchecked", held)
    slow = GuidedSpec(regex=r"slow [a-z]{1,5}")
    engine.add_request("guided", "x", SamplingParams(temperature=0, max_tokens=8, guided=slow))
    engine.add_request("plain", "y", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finished: dict[str, list[int]] = {"guided": [], "plain": []}
    while "plain" in engine.parents:
        for update in engine.step():
            finished[update.request_id] += update.new_token_ids
    assert len(finished["plain"]) == 8 and finished["guided"] == []
    release.set()
    while engine.has_unfinished_requests():
        for update in engine.step():
            finished[update.request_id] += update.new_token_ids
    assert llm.tokenizer.decode(finished["guided"], skip_special_tokens=True).startswith("slow ")
    assert_all_blocks_free(llm)


def test_a_compile_past_the_timeout_fails_only_its_request(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    release = threading.Event()
    real = engine.grammars._compile_unchecked
    monkeypatch.setattr(
        engine.grammars, "_compile_unchecked", lambda spec: release.wait(60) and real(spec)
    )
    monkeypatch.setattr(engine.grammars, "compile_timeout", 0.05)
    params = [
        SamplingParams(temperature=0, max_tokens=8, guided=GuidedSpec(regex="never [0-9]")),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    ]
    stuck, fine = llm.generate(["x", "y"], params)
    release.set()
    assert stuck.outputs[0].finish_reason == "error" and "did not compile within" in stuck.error
    assert fine.outputs[0].finish_reason == "length" and len(fine.outputs[0].token_ids) == 8
    assert_all_blocks_free(llm)


def test_compiled_grammars_are_cached_by_canonical_text(demo_model_dir: Path, llm: LLM) -> None:
    cache = GrammarCache(
        llm.tokenizer,
        llm.engine.vocab_size,
        llm.engine.eos_token_ids,
        GuidedLimits(cache_size=2, max_schema_bytes=1 << 16, max_schema_depth=32),
    )
    a = cache.submit(GuidedSpec(json_schema=json.loads('{"type": "object",  "required": []}')))
    assert cache.submit(GuidedSpec(json_schema={"type": "object", "required": []})) is a
    reordered = {"required": [], "type": "object"}  # property order is output order: another key
    assert cache.submit(GuidedSpec(json_schema=reordered)) is not a
    cache.submit(GuidedSpec(regex="[a-z]"))
    assert len(cache._entries) == 2  # bounded: the least recently used went first
    assert cache.submit(GuidedSpec(json_schema={"type": "object", "required": []})) is not a


def test_guided_spec_takes_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        GuidedSpec()
    with pytest.raises(ValueError, match="exactly one"):
        GuidedSpec(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="at least one"):
        GuidedSpec(choice=())
    with pytest.raises(ValueError, match="non-empty"):
        GuidedSpec(choice=("a", ""))
    with pytest.raises(ValueError, match="JSON object"):
        GuidedSpec(json_schema=[1, 2])  # type: ignore[arg-type]
    assert GuidedSpec(choice=["a", "b"]).choice == ("a", "b")  # type: ignore[arg-type]


def refusal(llm: LLM, spec: GuidedSpec) -> GuidedSpecError:
    """The compile's refusal: raised at once when already known, else the future's result."""
    try:
        result = llm.engine.grammars.submit(spec).result()
    except GuidedSpecError as exc:
        return exc
    assert isinstance(result, GuidedSpecError), result
    return result


def deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


DEPENDENT_REQUIRED = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "dependentRequired": {"a": ["b"]},
}
# (schema, words the refusal must contain)
REFUSED = [
    ({"type": "frobnicate"}, "invalid JSON schema"),
    ({"type": "object", "required": "name"}, "invalid JSON schema"),
    ({"type": "string", "pattern": "(("}, "invalid JSON schema"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
    ({"$ref": "#/$defs/missing"}, "at /$ref: cannot resolve '#/$defs/missing'"),
    ({"$ref": "https://example.com/schema.json"}, "only references inside the schema"),
    ({"$defs": {"a": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"}, "only references"),
    ({"not": {"type": "integer"}}, "at /not/type: the complement of type integer"),
    ({"if": {"format": "email"}, "then": {"minLength": 5}}, "at /if/format: the complement"),
    ({"type": "array", "contains": {"type": "integer"}}, "at /contains: contains cannot"),
    (deep_schema(40), "nests 41 levels deep"),
]


@pytest.mark.parametrize(("schema", "words"), REFUSED, ids=[w for _, w in REFUSED])
def test_bad_or_unsupported_schemas_are_refused_clearly(
    llm: LLM, schema: dict[str, Any], words: str
) -> None:
    error = refusal(llm, GuidedSpec(json_schema=schema))
    assert words in str(error) and "/project/cpp" not in str(error)
    # Cached: the next request with it is refused at once.
    with pytest.raises(GuidedSpecError, match=re.escape(words)):
        llm.engine.add_request("again", "x", SamplingParams(guided=GuidedSpec(json_schema=schema)))
    assert not llm.engine.sequences


@pytest.mark.parametrize(
    ("schema", "violation"),
    [
        ({"not": {"type": "string"}}, '"abc"'),
        ({"if": {"type": "string"}, "then": {"minLength": 5}}, '"abc"'),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "{}"),
        (DEPENDENT_REQUIRED, '{"a":1}'),
        ({"$defs": {"a": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"}, '"x"'),
    ],
)
def test_rewritten_or_refused_keywords_are_ones_xgrammar_would_not_enforce(
    llm: LLM, schema: dict[str, Any], violation: str
) -> None:
    """Why they are rewritten or refused; when xgrammar starts enforcing one, this fails:
    pass it through then."""
    info = xgr.TokenizerInfo.from_huggingface(llm.tokenizer, vocab_size=llm.engine.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":")
    )
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(violation) and matcher.is_completed()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(violation), schema)


def test_limits_refuse_at_once_and_the_engine_keeps_serving(llm: LLM) -> None:
    engine = llm.engine
    huge = GuidedSpec(choice=tuple(f"option {i}" for i in range(20_000)))
    with pytest.raises(GuidedSpecError, match="bytes; the limit is"):
        engine.add_request("huge", "x", SamplingParams(guided=huge))
    nested: Any = 1
    for _ in range(5_000):
        nested = [nested]
    with pytest.raises(GuidedSpecError, match="nests too deeply"):
        engine.add_request(
            "deep", "x", SamplingParams(guided=GuidedSpec(json_schema={"a": nested}))
        )
    out = llm.generate(["still here"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert_all_blocks_free(llm)


def test_a_grammar_matching_only_the_empty_string_is_refused(llm: LLM) -> None:
    assert "only the empty string" in str(refusal(llm, GuidedSpec(grammar='root ::= ""')))


# -- SmolLM2 --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> LLM:
    return LLM(
        str(smollm2_dir),
        kv_cache_memory=256 << 20,
        max_model_len=1024,
        num_threads=THREADS,
        dtype="float32",
    )


@pytest.fixture(scope="module")
def smollm2_outputs(smollm2: LLM) -> dict[str, CompletionOutput]:
    return run_schemas(smollm2, max_tokens=48, sampled=False)


@pytest.mark.smollm2
@pytest.mark.parametrize("name", SCHEMAS)
def test_smollm2_json_follows_the_schema(
    smollm2_outputs: dict[str, CompletionOutput], name: str
) -> None:
    assert_valid(smollm2_outputs[f"{name}/greedy"], SCHEMAS[name])


@pytest.mark.smollm2
def test_smollm2_outputs_finish(smollm2_outputs: dict[str, CompletionOutput]) -> None:
    assert stop_share(smollm2_outputs) >= 0.9


@pytest.mark.smollm2
def test_smollm2_patterns_and_unguided_neighbours(smollm2: LLM) -> None:
    for spec, output in run_patterns(smollm2, ["Pick a colour and a code."]):
        assert_matches(spec, output)
    tok = smollm2.tokenizer
    question = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    plain = SamplingParams(temperature=0, max_tokens=16)
    alone = smollm2.generate([question], plain)[0].outputs[0].token_ids
    guided = SamplingParams(
        temperature=0, max_tokens=16, guided=GuidedSpec(choice=("Paris", "Rome"))
    )
    mixed = smollm2.generate([question, question], [plain, guided])
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].text == "Paris"
    assert_all_blocks_free(smollm2)
