"""The two contenders of bench/guided_backends.py behind one interface: `compile(schema)` gives
(handle or None, refusal, warnings), `run(handle, tokens)` a `Verdict`. xgrammar goes through the
engine's own compile path; llguidance takes the raw schema."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Verdict:
    """One document through one backend's matcher."""

    accepted: bool
    mask_us: list[float]
    mask_mismatches: int  # tokens whose mask bit disagreed with the matcher's accept


def _bit(mask: Any, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


class Xgrammar:
    """The engine's own compile path: its GrammarCache, its limits, strict by default."""

    name = "xgrammar"

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos: list[int], model_dir: str, strict: bool
    ) -> None:
        from engine.config import EngineConfig
        from engine.llm_engine import grammar_cache

        self.cache = grammar_cache(EngineConfig(model=model_dir), tokenizer, vocab_size, eos)
        self.cache._xgrammar_compiler()  # tokenizer info: once, not part of a compile
        self.stop, self.vocab_size, self.strict = eos[0], vocab_size, strict

    def compile(self, schema: Any) -> tuple[Any, str, list[str]]:
        from engine.errors import GuidedSpecError
        from engine.request import GuidedSpec

        try:
            result = self.cache.submit(GuidedSpec(json_schema=schema, strict=self.strict)).result()
        except (GuidedSpecError, ValueError) as exc:
            return None, str(exc), []
        if isinstance(result, Exception):
            return None, str(result), []
        return result, "", []

    def end_check_keywords(self, compiled: Any) -> set[str]:
        return {keyword for _, keyword in compiled.end_checks}

    def run(self, compiled: Any, tokens: list[int]) -> Verdict:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled.grammar)
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        times, mismatches = [], 0
        for token in tokens + [self.stop]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(1e6 * (time.perf_counter() - t0))
            allowed = _bit(mask[0], token)
            taken = matcher.accept_token(token)
            mismatches += allowed != taken
            if not taken:
                return Verdict(False, times, mismatches)
        return Verdict(matcher.is_terminated(), times, mismatches)


class Llguidance:
    """llguidance on the raw schema: its JSON Schema support, its refusals and warnings."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.stop, self.vocab_size = eos[0], vocab_size
        self.compile({"type": "object"})  # first-use set-up, not part of any schema's compile

    def compile(self, schema: Any) -> tuple[Any, str, list[str]]:
        import llguidance.numpy as llnp

        options: Any = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        try:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=options
            )
        except ValueError as exc:
            return None, str(exc), []
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return None, matcher.get_error(), []
        llnp.fill_next_token_bitmask(matcher, llnp.allocate_token_bitmask(1, self.vocab_size))
        if matcher.is_error():
            return None, matcher.get_error(), []
        matcher.reset()
        return grammar, "", list(matcher.get_grammar_warnings())

    def run(self, grammar: Any, tokens: list[int]) -> Verdict:
        import llguidance.numpy as llnp

        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        mask = llnp.allocate_token_bitmask(1, self.vocab_size)
        times, mismatches = [], 0
        for token in tokens + [self.stop]:
            t0 = time.perf_counter()
            llnp.fill_next_token_bitmask(matcher, mask)
            times.append(1e6 * (time.perf_counter() - t0))
            allowed = _bit(mask[0], token)
            taken = matcher.consume_token(token)
            mismatches += allowed != taken
            if not taken:
                return Verdict(False, times, mismatches)
        return Verdict(not matcher.is_error(), times, mismatches)
