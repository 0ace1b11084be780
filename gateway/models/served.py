"""The base models one gateway serves: each one's name, engine, tokenizer and bounds.

A request's `model` names a base model (or an adapter of one: gateway.tenancy.adapter_catalog), and
from there on everything about it — its tokenizer and chat template, the vocabulary its token
ids are checked against, its context length, the engine its sequences join — is that model's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from engine.frontend.client import EngineClient
from gateway.http.errors import APIError
from gateway.http.request_limits import ABOVE_LIMIT, BAD_TOKEN, TOO_LONG, RequestLimits

MAX_CHOICES = 256  # prompts x n
# A prompt's characters per token of max_model_len, past which it is refused untokenized.
CHARS_PER_TOKEN = 32

# How a server's health reads when its models' engines disagree: the worst one speaks.
_HEALTH_ORDER = ("dead", "stopping", "restarting", "ok")


class ServerBounds:
    """RequestLimits resolved against a model: its vocabulary and context length."""

    def __init__(self, limits: RequestLimits, vocab_size: int, max_model_len: int) -> None:
        self.max_n = limits.max_n
        self.max_prompt_chars = limits.max_prompt_chars or CHARS_PER_TOKEN * max_model_len
        self.vocab_size = vocab_size

    def check_choices(self, n: int, num_prompts: int) -> None:
        if n > self.max_n:
            raise APIError(
                400, f"n must be at most {self.max_n} on this server", param="n", code=ABOVE_LIMIT
            )
        if num_prompts * n > MAX_CHOICES:
            raise APIError(
                400,
                f"{num_prompts} prompts x n={n} asks for more than {MAX_CHOICES} choices",
                param="n",
                code=ABOVE_LIMIT,
            )

    def check_token_ids(self, ids: Iterable[int] | None, param: str) -> None:
        out_of_vocab = max(ids or (), default=-1)
        if out_of_vocab >= self.vocab_size:
            raise APIError(
                400,
                f"token id {out_of_vocab} is outside the vocabulary [0, {self.vocab_size})",
                param=param,
                code=BAD_TOKEN,
            )

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {num_chars} characters; this server takes at most "
                f"{self.max_prompt_chars} (--max-prompt-chars)",
                param=param,
                code=TOO_LONG,
            )


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
