"""`EngineClient`: what the gateway asks of a model's engine, whatever runs it: a loop in this
process or an engine process of its own (engine/frontend/loop_client.py's clients), one started on
demand, several behind a routing pool, or engines elsewhere (gateway/models, gateway/remote).

Requests go in whole (`EngineRequest`) and their updates come out as an async iterator; what the
edge checks requests against is the engine's `EngineFacts`; what /metrics and an autoscaler read
is its `EngineStats` and its `Scaling`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from engine.frontend.facts import EngineFacts
from engine.messages import EngineRequest, EngineStats
from engine.outputs import SequenceUpdate
from engine.request import GuidedSpec


@dataclass(frozen=True, slots=True)
class Scaling:
    """What an autoscaler reads of an engine (/metrics' `engine_replicas`, `engine_cold_starts`,
    `model_pending_requests`, and the admin REST's /admin/engines)."""

    num_ready: int  # engines ready to serve
    num_cold_starts: int  # engines started on demand
    num_held: int  # requests held for an engine to start


class EngineClient(Protocol):
    """The gateway's handle on a model's engine. Implementations subclass it, which makes mypy
    check each against it."""

    @property
    def facts(self) -> EngineFacts: ...

    @property
    def health(self) -> str:
        """What /health reports: ok, starting, restarting, stopping or dead."""
        ...

    def generate(self, request: EngineRequest) -> AsyncGenerator[SequenceUpdate]:
        """Every update of the request's sequences until all have finished. Raises what
        engine.errors names (RequestRefused, EngineOverloaded, EngineDead, StepFailed);
        leaving the iteration early aborts the request."""
        ...

    async def compile_grammar(self, spec: GuidedSpec) -> None:
        """Compile (or find compiled) a request's grammar in the engine that will run it;
        raises GuidedSpecError for one it cannot run."""
        ...

    def stats(self) -> EngineStats: ...

    def scaling(self) -> Scaling: ...

    def unload_lora(self, adapter_id: str) -> None: ...

    async def shutdown(self, grace_period: float = 10.0) -> None:
        """Stop admitting, let running requests finish for `grace_period`, abort the rest."""
        ...
