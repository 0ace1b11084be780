"""What travels between a gateway and a `loragate engine`, as JSON.

One WebSocket per gateway and engine carries what the engine process's pipe carries, in the
same shape (engine.messages), so that a remote engine is one more `EngineClient`:

    gateway ── {"request": ...} | {"abort": id} | {"unload": adapter_id} ──▶ engine
            ◀── {"step": {"updates": [...], "finished": [...]}} | {"refused": ...} ──

and a grammar compile asked and answered, as on the pipe (CompileGrammar, GrammarCompiled):

    gateway ── {"compile": [ticket, spec]} ──▶ engine ── {"compiled": [[ticket, error]]} ──▶

JSON, not pickle: the engine must not run what a peer sends it. A request names its adapter by
content hash only; the engine finds the files in its own copy of the adapter store, so no
peer chooses a path on the engine's disk.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from adapters.store import AdapterStorage
from engine.errors import (
    ContextLengthExceeded,
    EngineDead,
    EngineOverloaded,
    GuidedSpecError,
    RequestRefused,
    StepFailed,
)
from engine.lora.types import LoRARequest
from engine.messages import EngineRequest, EngineStats
from engine.outputs import SequenceUpdate
from engine.request import GuidedSpec, SamplingParams

# The errors a refusal may carry, by name; anything else arrives as a StepFailed.
_ERRORS: dict[str, type[Exception]] = {
    kind.__name__: kind
    for kind in (
        RequestRefused,
        ContextLengthExceeded,
        GuidedSpecError,
        EngineOverloaded,
        EngineDead,
        StepFailed,
    )
}


class WireError(ValueError):
    """A message that does not decode: the peer is not a loragate of this version."""


# -- requests ------------------------------------------------------------------------------


def encode_request(request: EngineRequest) -> dict[str, Any]:
    params = dataclasses.asdict(request.params)
    if request.params.logit_bias is not None:  # JSON keys are strings; keep them as pairs
        params["logit_bias"] = list(request.params.logit_bias.items())
    return {
        "request_id": request.request_id,
        "prompt": request.prompt if isinstance(request.prompt, str) else list(request.prompt),
        "params": params,
        "lora": None if request.lora is None else [request.lora.name, request.lora.adapter_id],
        "cache_salt": request.cache_salt,
        "fairness_key": request.fairness_key,
        "fairness_weight": request.fairness_weight,
        "routing_key": request.routing_key,
        "priority": request.priority,
    }


def decode_request(data: dict[str, Any], store: AdapterStorage | None) -> EngineRequest:
    """An EngineRequest from the wire; its adapter's path is the engine's own store's.
    Raises RequestRefused for a request that does not decode."""
    try:
        params = dict(data["params"])
        if params.get("guided") is not None:
            params["guided"] = decode_spec(params["guided"])
        if params.get("logit_bias") is not None:
            params["logit_bias"] = {int(t): float(b) for t, b in params["logit_bias"]}
        lora = None
        if data.get("lora") is not None:
            name, adapter_id = data["lora"]
            if store is None:
                raise RequestRefused("this engine serves no adapters (--enable-lora)")
            lora = LoRARequest(str(name), str(store.path(adapter_id)), str(adapter_id))
        prompt = data["prompt"]
        return EngineRequest(
            request_id=str(data["request_id"]),
            prompt=prompt if isinstance(prompt, str) else [int(t) for t in prompt],
            params=SamplingParams(**params),
            lora=lora,
            cache_salt=data.get("cache_salt"),
            fairness_key=data.get("fairness_key"),
            fairness_weight=float(data.get("fairness_weight", 1.0)),
            routing_key=data.get("routing_key"),
            priority=int(data.get("priority", 0)),
        )
    except RequestRefused:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise RequestRefused(f"a request that does not decode: {exc}") from exc


def encode_spec(spec: GuidedSpec) -> dict[str, Any]:
    """A guided spec, as a request's params carry it and a grammar compile asks it."""
    return dataclasses.asdict(spec)


def decode_spec(data: dict[str, Any]) -> GuidedSpec:
    """Raises ValueError or TypeError for one that does not decode."""
    return GuidedSpec(**data)


# -- results -------------------------------------------------------------------------------

_UPDATE_FIELDS = [f.name for f in dataclasses.fields(SequenceUpdate)]


def encode_update(update: SequenceUpdate) -> list[Any]:
    """An update as a list in field order: a step of 64 sequences is one short message."""
    values = [getattr(update, name) for name in _UPDATE_FIELDS]
    if update.new_logprobs is not None:
        values[_UPDATE_FIELDS.index("new_logprobs")] = [
            list(step.items()) for step in update.new_logprobs
        ]
    return values


def decode_update(values: list[Any]) -> SequenceUpdate:
    update = SequenceUpdate(*values)
    pairs: list[list[list[float]]] | None = values[_UPDATE_FIELDS.index("new_logprobs")]
    if pairs is not None:
        update.new_logprobs = [{int(t): float(p) for t, p in step} for step in pairs]
    return update


def encode_error(error: BaseException) -> list[str]:
    kind = type(error).__name__
    return [kind if kind in _ERRORS else StepFailed.__name__, str(error)]


def decode_error(values: list[str]) -> Exception:
    kind, message = values
    return _ERRORS.get(kind, StepFailed)(message)


def encode_stats(stats: EngineStats) -> dict[str, Any]:
    return dataclasses.asdict(stats)


def decode_stats(data: dict[str, Any]) -> EngineStats:
    try:
        stats = EngineStats(**data)
    except TypeError as exc:
        raise WireError(f"engine stats that do not decode: {exc}") from exc
    if stats.spec_decode is not None:
        drafts, draft_tokens, accepted = stats.spec_decode  # a JSON list on the wire
        stats.spec_decode = (drafts, draft_tokens, accepted)
    return stats
