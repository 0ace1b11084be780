"""What crosses the engine boundary, typed: the one request the gateway builds, the messages
that reach the step loop (a thread's queue or the engine process's pipe), and what the engine
process sends back. Over the pipe each is pickled as it is.

    gateway ── EngineRequest | Abort | UnloadLoRA | LoadLoRA ──▶ step loop
            ◀── Progress… Ready | Fatal, then StepResult | Refused | Failed … Stopped ──

and, on the engine process's pipe only, a grammar compile asked and answered:

    gateway ── CompileGrammar ──▶ engine's grammar cache ── GrammarCompiled ──▶ gateway

A warm spare says `SpareReady` once it has imported what an engine needs; a `StartEngine` then
makes it one, and from there its pipe carries the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.frontend.facts import EngineFacts
from engine.lora.types import LoRALoader, LoRARequest
from engine.outputs import SequenceUpdate
from engine.request import GuidedSpec, SamplingParams

# -- in: to the step loop ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """Everything the engine takes of one request, built once (by the gateway, from the
    tenant it authenticated) and passed whole: to EngineClient.generate, over the pipe, to
    LLMEngine.add. The salt, the fairness key and its weight are the tenant's, never the
    client's."""

    request_id: str
    prompt: str | Sequence[int]  # token ids, or text the engine tokenizes
    params: SamplingParams
    lora: LoRARequest | None = None
    cache_salt: str | None = None  # one tenant never reads another's prefix cache
    fairness_key: str | None = None  # whose share the "fair" policy charges (a tenant)
    fairness_weight: float = 1.0  # that key's share relative to other keys'
    # The client's name for a shared prefix (prompt_cache_key): replicas are chosen by it,
    # joined to the salt, in place of the prompt's first block.
    routing_key: str | None = None
    # Its band (vLLM's `priority`: lower runs first; engine/priority.py). The gateway bounds
    # it: a tenant's request never asks for a band better than 0; batch lines run below.
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class UnloadLoRA:
    adapter_id: str


@dataclass(frozen=True, slots=True)
class LoadLoRA:
    """Put an adapter in a slot ahead of its requests (`loragate engine`'s load route)."""

    lora: LoRARequest


Inbound = EngineRequest | Abort | UnloadLoRA | LoadLoRA


@dataclass(frozen=True, slots=True)
class CompileGrammar:
    """Compile a guided spec into the engine's grammar cache; `GrammarCompiled` answers. The
    gateway asks before it submits a guided request, so that a grammar that cannot compile is a
    400 before anything streams, and the request then finds it compiled: it compiles once, in
    the engine. Only the engine process's pipe carries it: a loop in the gateway's process
    shares the gateway's memory, cache included."""

    ticket: int  # the answer's
    spec: GuidedSpec


# What the engine process's pipe carries in (None: stop).
ProcessInbound = Inbound | CompileGrammar


# -- to a warm spare (engine/frontend/warm_spare.py) -----------------------------------------


@dataclass(frozen=True, slots=True)
class StartEngine:
    """Become this engine: what a fresh engine process gets as its arguments (run_engine's)."""

    config: EngineConfig
    lora_loader: LoRALoader | None
    preload: tuple[LoRARequest, ...]
    handed_at: float  # time.time() when the gateway handed it over: the `process` phase's start


@dataclass(frozen=True, slots=True)
class SpareReady:
    """A spare has imported what an engine needs and waits for its StartEngine."""


# -- out: what the engine reports -------------------------------------------------------------


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine for /metrics (vLLM's meanings)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_failed_requests: int = 0  # sequences that alone failed an engine step
    num_yielded_steps: int = 0  # steps that gave way to a better band part through
    # The KV pool's shape (vLLM's cache_config_info: block_size, num_gpu_blocks, on CPU too);
    # 0 while there is no engine to ask.
    block_size: int = 0
    num_kv_blocks: int = 0
    spec_decode: tuple[int, int, int] | None = None  # drafts, draft tokens, accepted; None: off
    max_loras: int | None = None  # None: LoRA disabled
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)
    lora_slots_used: int = 0
    resident_adapter_ids: list[str] = field(default_factory=list)  # in a slot now (routing)
    cached_adapter_ids: list[str] = field(default_factory=list)  # in CPU memory, read from disk
    lora_disk_loads: int = 0
    lora_evictions: int = 0  # adapters taken out of the pool to make room
    lora_pool_usage: float = 0.0  # fraction of the LoRA pool's rank units holding adapters


@dataclass(frozen=True, slots=True)
class Progress:
    """Loading the model: `done` of `total` tensors."""

    done: int
    total: int


@dataclass(frozen=True, slots=True)
class Ready:
    facts: EngineFacts  # its tokenizer None: the gateway's side has its own
    stats: EngineStats
    # Seconds per phase of the start: `process` (spawn, interpreter, imports; in a warm
    # spare, the handover: its StartEngine sent and read), then the engine's own
    # (engine.load_timings).
    load_seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Fatal:
    """The engine could not start."""

    message: str


@dataclass(frozen=True, slots=True)
class StepResult:
    """One step: its updates, the requests now wholly finished, and (at most every
    STATS_INTERVAL) a stats snapshot."""

    updates: list[SequenceUpdate]
    finished: list[str]
    stats: EngineStats | None


@dataclass(frozen=True, slots=True)
class Refused:
    """A request the engine would not take; `error` is what its caller raises."""

    request_id: str
    error: BaseException


@dataclass(frozen=True, slots=True)
class Failed:
    """A step failed outside any one request's doing: these requests failed with it."""

    request_ids: list[str]
    message: str


@dataclass(frozen=True, slots=True)
class GrammarCompiled:
    """A CompileGrammar's answer: compiled (error None), or the GuidedSpecError's message."""

    ticket: int
    error: str | None


@dataclass(frozen=True, slots=True)
class Stopped:
    """The engine aborted what was left and exits."""


Outbound = Progress | Ready | Fatal | StepResult | Refused | Failed | GrammarCompiled | Stopped
