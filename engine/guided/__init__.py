"""Guided decoding: compile a GuidedSpec into a grammar, give each sequence a matcher, and
mask each step's logits to the tokens the grammars allow next (xgrammar).

The objects, in the order a request meets them:

- `GrammarCache` compiles specs on background threads, so a slow compile never stalls the
  step loop, and keeps the results (grammars and refusals) in a bounded LRU keyed by the
  spec's canonical text. Meanwhile the request waits in the queue: `grammar_ready` is a
  scheduler admission gate.
- `SequenceGrammar` is one sequence's matcher. It accepts each token the engine appends and
  says when the output must end: the grammar took a stop token, or it is complete and
  allows nothing but a stop token next (then the engine ends it without that extra step).
- `GrammarBitmask` is one int32 bitmask for all guided rows of a step, filled together and
  applied to those rows' logits before sampling; other rows are not touched.

JSON comes out compact (`{"a":1,"b":[2,3]}`): the grammar leaves no whitespace to choose.
With free whitespace a small model tends to emit spaces or newlines until max_tokens.

Importing xgrammar takes over a second, so it happens on first use: an engine that never
sees a guided request never pays for it.

The package's modules: `grammar_cache` (compiling, the LRU), `matcher` (one sequence's
grammar), `bitmask` (one step's mask); and the JSON Schema side: `schema` (the normalizer:
JSON Schema rewritten into what xgrammar enforces), `schema_types`, `negation`, `patterns`.
"""

from engine.errors import GuidedSpecError
from engine.guided.bitmask import GrammarBitmask, mask_logits_cpu
from engine.guided.grammar_cache import (
    GrammarCache,
    GuidedLimits,
    canonical_text,
    check_schema,
    schema_end_checks,
)
from engine.guided.matcher import CompiledSpec, SequenceGrammar, grammar_ready
from engine.request import GuidedSpec

__all__ = [
    "CompiledSpec",
    "GrammarBitmask",
    "GrammarCache",
    "GuidedLimits",
    "GuidedSpec",
    "GuidedSpecError",
    "SequenceGrammar",
    "canonical_text",
    "check_schema",
    "grammar_ready",
    "mask_logits_cpu",
    "schema_end_checks",
]
