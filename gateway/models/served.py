"""The base models one gateway serves: each one's name, engine, tokenizer and bounds.

A request's `model` names a base model (or an adapter of one: gateway.tenancy.adapter_catalog), and
from there on everything about it — its tokenizer and chat template, the vocabulary its token
ids are checked against, its context length, the engine its sequences join — is that model's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from engine.frontend.client import EngineClient
from gateway.http.request_limits import RequestLimits, ServerBounds

# How a server's health reads when its models' engines disagree: the worst one speaks.
_HEALTH_ORDER = ("dead", "stopping", "restarting", "ok")


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    engine: EngineClient
    tokenizer: Any
    bounds: ServerBounds

    @classmethod
    def of(cls, name: str, engine: EngineClient, limits: RequestLimits) -> ServedModel:
        facts = engine.facts
        return cls(
            name,
            engine,
            facts.tokenizer,
            ServerBounds(limits, facts.vocab_size, facts.max_model_len),
        )


class ServedModels:
    """The served base models by name, in the order they were configured."""

    def __init__(self, engines: Mapping[str, EngineClient], limits: RequestLimits) -> None:
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
