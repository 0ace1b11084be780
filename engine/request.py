"""A request's state as the engine sees it: token ids, sampling knobs, progress."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from engine.lora.types import LoRARequest


class Grammar(Protocol):
    """One sequence's grammar (engine.guided.matcher.SequenceGrammar), as the engine calls it.
    Named here, not imported, so that this module depends on nothing of guided decoding or
    speculative decoding (both of which read requests)."""

    matcher: Any  # the xgrammar matcher once the compile is done, else None
    token_filter: Any

    def try_start(self, now: float) -> bool: ...
    def accept(self, token_id: int) -> bool: ...
    def must_end(self) -> bool: ...


class Proposer(Protocol):
    """A request's draft proposer (engine.spec_decode.NgramIndex)."""

    def propose(self, tokens: list[int], limit: int) -> list[int]: ...


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class OutputKind(enum.StrEnum):
    """What a request's updates carry (vLLM's RequestOutputKind). DELTA: each step's new
    tokens and text as they come, for a stream. FINAL_ONLY: one update, when the request
    finishes, with all of them: an answer collected whole (a batch line) costs no per-step
    updates to build, send and apply beside everyone else's."""

    DELTA = "delta"
    FINAL_ONLY = "final_only"


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    """Constrain the output to exactly one of: a JSON schema, any JSON object, a regular
    expression, one string of a list, an EBNF grammar, or an xgrammar structural tag (free
    text in which each trigger starts a tag whose content follows a JSON schema: tool calls)
    (engine.guided compiles it).

    Frozen: n > 1 samples share one spec (each gets its own matcher). `strict` (JSON schema
    only) keeps objects to the properties the schema names, as OpenAI's strict mode does;
    False allows what JSON Schema allows.
    """

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.verify()

    def verify(self) -> None:
        """Raise ValueError for a malformed spec (cheap; schema limits are engine.guided's)."""
        kinds = [
            self.json_schema is not None,
            self.json_object,
            self.regex is not None,
            self.choice is not None,
            self.grammar is not None,
            self.structural_tag is not None,
        ]
        if sum(kinds) != 1:
            raise ValueError(
                "guided decoding takes exactly one of json_schema, json_object, regex, choice, "
                "grammar and structural_tag"
            )
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise ValueError("a structural tag must be a JSON object")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
        if self.regex is not None and not self.regex:
            raise ValueError("the regex must not be empty")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("the grammar must not be empty")
        if self.choice is not None:
            if not self.choice:
                raise ValueError("choice must list at least one string")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("every choice must be a non-empty string")

    @property
    def kind(self) -> str:
        if self.json_schema is not None:
            return "json_schema"
        if self.json_object:
            return "json_object"
        if self.regex is not None:
            return "regex"
        if self.structural_tag is not None:
            return "structural_tag"
        return "choice" if self.choice is not None else "grammar"


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass(slots=True)
class SamplingParams:
    """What to generate and when to stop. Names and defaults follow vLLM's."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # any 64-bit integer, signed or not
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token; 0 = sampled token only
    skip_special_tokens: bool = True
    guided: GuidedSpec | None = None  # constrain the output to a grammar (engine.guided)
    output_kind: OutputKind = OutputKind.DELTA

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # A remote engine's request arrives as JSON: the kind's value.
        self.output_kind = OutputKind(self.output_kind)
        self.verify()

    def verify(self) -> None:
        """Raise ValueError naming the first bad field; the gateway maps it to HTTP 400."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in _FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError("seed must be a 64-bit integer")
        if self.logit_bias:
            if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
                raise ValueError("logit_bias keys must be non-negative token ids")
            if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.guided is not None:
            self.guided.verify()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True, slots=True)
class Owner:
    """Whose a request is, as the engine sees it (an EngineRequest's tenant fields): the
    adapter it runs under, the salt that keeps its prefix cache its own, and the key whose
    share the "fair" policy charges, with that key's weight (engine/fairness.py)."""

    lora: LoRARequest | None = None
    cache_salt: str | None = None
    fairness_key: str | None = None
    fairness_weight: float = 1.0


# A request of nobody in particular: the base model, one shared prefix cache and fairness line.
ANONYMOUS = Owner()


class Request:
    """One sequence being generated. `n > 1` fans out into one Request per sample.

    The engine's single rule: `num_computed_tokens` catches up with `num_tokens`.
    Prefill, chunked prefill, prefix-cache hits and recompute after preemption
    are all that rule seen from different starting points.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "owner",
        "lora_slot",
        "num_charged_prompt_tokens",
        "arrival_time",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "status",
        "stop_reason",
        "error",
        "block_hashes",
        "generator",
        "logprobs",
        "num_preemptions",
        "first_token_time",
        "scheduled_time",
        "grammar",
        "spec_token_ids",
        "ngram_index",
        "priority",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        owner: Owner = ANONYMOUS,
        *,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.owner = owner
        self.lora_slot = -1  # the device slot pinned while running; -1: none
        # Prompt tokens counted as its key's service: recompute after preemption is not.
        self.num_charged_prompt_tokens = 0
        self.arrival_time = time.monotonic()
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until then
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.block_hashes: list[bytes] = []
        self.generator: torch.Generator | None = None  # per-request seed, made on first use
        self.logprobs: list[dict[int, float]] | None = (
            [] if sampling_params.logprobs is not None else None
        )
        self.num_preemptions = 0
        self.first_token_time: float | None = None
        self.scheduled_time: float | None = None
        # Guided requests: this sequence's matcher, once its grammar is compiled.
        self.grammar: Grammar | None = None
        # Speculative decoding (engine/spec_decode.py): the drafts the next step verifies
        # (never among the known tokens), and where this request's n-grams occurred.
        self.spec_token_ids: list[int] = []
        self.ngram_index: Proposer | None = None
        # Its band (engine/priority.py): lower runs first. The starvation bound may promote
        # a waiting request into a better band; it never moves it down.
        self.priority = priority

    @property
    def lora(self) -> LoRARequest | None:
        return self.owner.lora

    @property
    def cache_salt(self) -> str | None:
        return self.owner.cache_salt

    @property
    def fairness_key(self) -> str | None:
        return self.owner.fairness_key

    @property
    def fairness_weight(self) -> float:
        """Its key's share under contention (engine/fairness.py)."""
        return self.owner.fairness_weight

    @property
    def adapter_id(self) -> str | None:
        """The adapter's content hash: the prefix cache keys by it, never by name."""
        lora = self.owner.lora
        return None if lora is None else lora.adapter_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.name})"
        )
