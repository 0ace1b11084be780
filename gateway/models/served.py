"""The base models one gateway serves: each one's name, engine, tokenizer and bounds.

A request's `model` names a base model (or an adapter of one: gateway.tenancy.adapter_catalog), and
from there on everything about it — its tokenizer and chat template, the vocabulary its token
ids are checked against, its context length, the engine its sequences join — is that model's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from engine.messages import EngineRequest, EngineStats
from engine.outputs import SequenceUpdate
from engine.request import GuidedSpec
from gateway.http.request_limits import RequestLimits, ServerBounds


class ModelEngine(Protocol):
    """What the gateway asks of a model's engine: an engine loop (engine.engine_client's
    EngineClient: a process, or a thread), or one started on demand
    (gateway.models.on_demand)."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def health(self) -> str: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[SequenceUpdate]: ...

    async def compile_grammar(self, spec: GuidedSpec) -> None: ...

    def stats(self) -> EngineStats: ...

    def unload_lora(self, adapter_id: str) -> None: ...

    async def shutdown(self, grace_period: float = 10.0) -> None: ...


# How a server's health reads when its models' engines disagree: the worst one speaks.
_HEALTH_ORDER = ("dead", "stopping", "restarting", "ok")


@dataclass(frozen=True, slots=True)
class Scaling:
    """What an autoscaler reads of an engine (/metrics' `engine_replicas`, `engine_cold_starts`,
    `model_pending_requests`, and the admin REST's /admin/engines)."""

    num_ready: int  # engines ready to serve
    num_cold_starts: int  # engines started on demand
    num_held: int  # requests held for an engine to start


def scaling(engine: ModelEngine) -> Scaling:
    """Engines on demand, pools and picked engines count their replicas, starts and held
    requests; any other engine is one, ready while ok, started with the server, holding none."""
    ready = getattr(engine, "num_replicas", None)
    return Scaling(
        int(engine.health == "ok") if ready is None else int(ready),
        int(getattr(engine, "num_cold_starts", 0)),
        int(getattr(engine, "num_held", 0)),
    )


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    engine: ModelEngine
    tokenizer: Any
    bounds: ServerBounds

    @classmethod
    def of(cls, name: str, engine: ModelEngine, limits: RequestLimits) -> ServedModel:
        bounds = ServerBounds(limits, engine.vocab_size, engine.max_model_len)
        return cls(name, engine, engine.tokenizer, bounds)


class ServedModels:
    """The served base models by name, in the order they were configured."""

    def __init__(self, engines: Mapping[str, ModelEngine], limits: RequestLimits) -> None:
        if not engines:
            raise ValueError("a gateway serves at least one model")
        self._models = {name: ServedModel.of(name, e, limits) for name, e in engines.items()}

    def get(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    def __getitem__(self, name: str) -> ServedModel:
        return self._models[name]

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

    @property
    def names(self) -> list[str]:
        return list(self._models)

    @property
    def health(self) -> str:
        """ "ok" while every model's engine serves; else the worst engine's status."""
        return min((m.engine.health for m in self), key=_HEALTH_ORDER.index)

    def unload_lora(self, adapter_id: str) -> None:
        """An adapter no row references any more leaves every engine that may hold it."""
        for model in self:
            model.engine.unload_lora(adapter_id)
