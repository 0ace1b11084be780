"""The /v1/completions route and its endpoint over the shared core (gateway.openai.serving): a
prompt (or several, as text or token ids) tokenized off the event loop, and the answer in
completions' form (`CompletionForm`): `text_completion` choices and chunks, log probabilities as
parallel lists."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response

from engine.outputs import SequenceUpdate
from gateway.http.errors import APIError
from gateway.http.request_limits import EMPTY_PROMPT
from gateway.openai.answer import Choice, violation_body
from gateway.openai.json_response import Disconnected
from gateway.openai.protocol import CompletionRequest
from gateway.openai.serving import (
    Generation,
    OpenAIServing,
    ServingDep,
    check_bounds,
    hung_up,
    sampling_params,
)
from gateway.tenancy.auth import RequestTenant, TenantDep


class CompletionForm:
    """Completions' answer: `text_completion` choices of text, whole or in chunks."""

    object = "text_completion"
    chunk_object = "text_completion"
    prompt_param = "prompt"

    def opening(self, choices: list[Choice]) -> list[dict[str, Any]]:
        return []  # the first chunk is the first text

    def chunk_choice(self, choice: Choice, update: SequenceUpdate) -> dict[str, Any] | None:
        return {"index": choice.index, "text": update.text_delta}

    def whole_choice(self, choice: Choice, tokenizer: Any) -> dict[str, Any]:
        logprobs = (
            self.logprobs(tokenizer, choice.token_ids, choice.logprobs) if choice.logprobs else None
        )
        return {
            "index": choice.index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": choice.answered_reason,
        } | violation_body(choice)

    def logprobs(
        self, tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]]
    ) -> dict[str, Any]:
        """Parallel lists: tokens, their log probabilities, the top alternatives, offsets."""
        decode = tokenizer.decode
        tokens = [decode([t]) for t in token_ids]
        offsets, pos = [], 0
        for token in tokens:
            offsets.append(pos)
            pos += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e[t] for t, e in zip(token_ids, entries, strict=False)],
            "top_logprobs": [{decode([t]): lp for t, lp in e.items()} for e in entries],
            "text_offset": offsets,
        }


COMPLETION = CompletionForm()


class CompletionServing:
    """One completion request's way through the core; built per request over the app's core."""

    def __init__(self, core: OpenAIServing) -> None:
        self.core = core

    async def create(
        self,
        body: CompletionRequest,
        tenant: RequestTenant,
        disconnected: Disconnected | None = None,
    ) -> Response:
        generation = await self.generation(body, tenant)
        return await self.core.respond(await self.core.start(generation, tenant), disconnected)

    async def generation(self, body: CompletionRequest, tenant: RequestTenant) -> Generation:
        """The body as the engine's prompts: bounds checked, text tokenized."""
        model, lora = await self.core.resolve_model(body.model, tenant)
        prompts = _prompts(body.prompt)
        check_bounds(model, body, len(prompts))
        params = sampling_params(body, body.max_tokens, body.logprobs)
        for prompt in prompts:
            if isinstance(prompt, str):
                model.bounds.check_prompt_chars(len(prompt), "prompt")
            else:
                model.bounds.check_token_ids(prompt, "prompt")
        # Text is tokenized here, off the event loop, so that a long prompt delays neither
        # other clients nor the engine's steps.
        token_ids = (
            await asyncio.to_thread(_tokenize, model.tokenizer, prompts)
            if any(isinstance(p, str) for p in prompts)
            else cast(list[list[int]], prompts)
        )
        if not all(token_ids):
            raise APIError(400, "the prompt is empty", param="prompt", code=EMPTY_PROMPT)
        return Generation(
            form=COMPLETION,
            model=model,
            lora=lora,
            named=body.model,
            request_id=f"cmpl-{uuid.uuid4().hex}",
            endpoint="completions",
            prompts=token_ids,
            params=params,
            stream=body.stream,
            include_usage=body.include_usage,
            guided_param=body.guided_param,
            routing_key=body.prompt_cache_key,
            priority=body.priority,
        )


# The route's handler (gateway.openai.routes registers it under /v1).
async def completions(
    body: CompletionRequest, serving: ServingDep, tenant: TenantDep, request: Request
) -> Response:
    return await CompletionServing(serving).create(body, tenant, hung_up(request))


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return list(prompt)


def _tokenize(tokenizer: Any, prompts: list[str | list[int]]) -> list[list[int]]:
    return [
        list(tokenizer(p, add_special_tokens=True)["input_ids"]) if isinstance(p, str) else p
        for p in prompts
    ]
