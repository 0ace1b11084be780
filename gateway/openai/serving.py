"""From a parsed OpenAI body to the engine's requests: the model resolved for the tenant, the
prompts tokenized (chat through its template, with tools), the sampling parameters and
grammar checked, admission, and the engine's first update (so that a refusal is an HTTP error
before anything is answered). Then gateway.openai.json_response or gateway.openai.sse answers.

Each prompt x n sample is one choice; the usage counts prompt, cached and completion tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, cast

from fastapi.responses import JSONResponse, Response

from engine.errors import ContextLengthExceeded, GuidedSpecError, RequestRefused
from engine.lora_types import LoRARequest
from engine.messages import EngineRequest
from engine.outputs import SequenceUpdate
from engine.request import GuidedSpec, SamplingParams
from gateway.http.errors import APIError, api_error
from gateway.http.request_limits import (
    EMPTY_PROMPT,
    INVALID_GRAMMAR,
    INVALID_VALUE,
)
from gateway.metrics import Metrics
from gateway.models.served import ServedModel, ServedModels
from gateway.openai.answer import Answer, Choice, Timer, Usage
from gateway.openai.json_response import collect, json_body
from gateway.openai.output_checks import OutputChecks
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, FieldError
from gateway.openai.sse import sse_chunks
from gateway.openai.streaming import Disconnected, MeteredStream, merge, unless_disconnected
from gateway.openai.tools.calls import ToolPlan, tool_plan
from gateway.openai.tools.parsers import FORMATS, ToolFormat
from gateway.openai.tools.prompt import render_messages, template_knows_tools
from gateway.openai.tools.stream import ToolCallStream
from gateway.tenancy.adapter_catalog import AdapterCatalog, AmbiguousAdapter
from gateway.tenancy.admission import Admission
from gateway.tenancy.auth import RequestTenant
from gateway.tenancy.metering import STATUS_ABORTED, Meter
from tenants.ledger import Ledger

logger = logging.getLogger(__name__)

# What nginx logs for a client that hung up before its answer; no client ever reads it.
CLIENT_CLOSED_REQUEST = 499


@dataclass(slots=True)
class Started:
    """A request admitted and at its engine: its answer (to collect, or to stream), its
    model, the engine's update stream (closing it aborts the request) and the limiter's
    headers for the response."""

    answer: Answer
    model: ServedModel
    updates: AsyncGenerator[tuple[int, SequenceUpdate]]
    headers: dict[str, str]


class OpenAIServing:
    def __init__(
        self,
        models: ServedModels,
        metrics: Metrics,
        admission: Admission,
        ledger: Ledger,
        catalog: AdapterCatalog | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        self.models = models
        self.admission = admission
        self.ledger = ledger
        self.metrics = metrics
        self.catalog = catalog  # None: LoRA is off
        self.checks = OutputChecks(metrics)
        # tool_choice "auto" reads calls in this format; None: auto is refused.
        self.tool_format = None if tool_call_parser is None else FORMATS[tool_call_parser]

    def models_for(self, tenant: RequestTenant) -> list[ServedModel]:
        """The base models this tenant may use."""
        allowed = tenant.allowed_models
        return [m for m in self.models if allowed is None or m.name in allowed]

    async def resolve_model(
        self, name: str, tenant: RequestTenant
    ) -> tuple[ServedModel, LoRARequest | None]:
        """The base model a `model` field names for this tenant, and the adapter on it (its
        own, else a public one; None: the base model itself). 404 otherwise, the same answer
        for another tenant's adapter as for a name that does not exist."""
        allowed = tenant.allowed_models  # a model outside it answers as one that does not exist
        model = self.models.get(name)
        if model is not None and (allowed is None or name in allowed):
            return model, None
        try:
            found = (
                None
                if self.catalog is None
                else await self.catalog.resolve(tenant.id, name, allowed)
            )
        except AmbiguousAdapter as exc:
            raise APIError(400, str(exc), param="model", code="ambiguous_model") from exc
        served = None if found is None else self.models.get(found.base_model)
        if found is None or served is None:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )
        return served, found.lora

    # -- routes -------------------------------------------------------------------------------

    async def completions(
        self,
        body: CompletionRequest,
        tenant: RequestTenant,
        disconnected: Disconnected | None = None,
    ) -> Response:
        model, lora = await self.resolve_model(body.model, tenant)
        prompts = self._completion_prompts(body.prompt)
        self._check_bounds(model, body, len(prompts))
        params = self._params(body, body.max_tokens, body.logprobs)
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
        started = await self._begin(
            body,
            model,
            token_ids,
            params,
            lora,
            tenant,
            chat=False,
            endpoint="completions",
            guided_param=body.guided_param,
        )
        return await self._render(body, started, disconnected)

    async def chat(
        self,
        body: ChatCompletionRequest,
        tenant: RequestTenant,
        disconnected: Disconnected | None = None,
    ) -> Response:
        return await self._render(body, await self.start_chat(body, tenant), disconnected)

    async def start_chat(
        self,
        body: ChatCompletionRequest,
        tenant: RequestTenant,
        endpoint: str = "chat",
        request_id: str | None = None,
    ) -> Started:
        """A chat request admitted and at its engine (the Responses API answers from it too):
        from here on it ends with exactly one usage row, `endpoint` naming the route and
        `request_id` (default: a new chat completion id) the request."""
        model, lora = await self.resolve_model(body.model, tenant)
        self._check_bounds(model, body, 1)
        try:
            plan = tool_plan(body, auto=self.tool_format is not None)
        except FieldError as exc:
            raise APIError(400, str(exc), param=exc.param, code=INVALID_VALUE) from exc
        native = template_knows_tools(getattr(model.tokenizer, "chat_template", None))
        fmt = self.tool_format or FORMATS["hermes"]
        messages, tools = render_messages(body.messages, plan, native, fmt)
        chars = sum(len(m["content"]) for m in messages) + len(json.dumps(tools or ""))
        model.bounds.check_prompt_chars(chars, "messages")
        params = self._params(body, body.requested_max_tokens, body.num_logprobs)
        guided_param = body.guided_param
        calls = None if plan is None or plan.mode == "none" else plan
        if calls is not None:
            for spec, param in calls.tool_specs():  # a bad schema is refused by its tool
                await _compile_grammar(model, spec, param)
            guided = (
                calls.output_spec()
                if calls.forced
                else GuidedSpec(structural_tag=fmt.structural_tag(calls))
            )
            params = dataclasses.replace(params, guided=guided)
            guided_param = "tools"
        try:
            encoded = await asyncio.to_thread(
                model.tokenizer.apply_chat_template,
                messages,
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )
        except Exception as exc:  # noqa: BLE001 - a template may reject a conversation
            raise APIError(
                400, f"chat template failed: {exc}", param="messages", code=INVALID_VALUE
            ) from exc
        prompt_ids = list(cast(list[int], encoded["input_ids"]))
        return await self._begin(
            body,
            model,
            [prompt_ids],
            params,
            lora,
            tenant,
            chat=True,
            endpoint=endpoint,
            request_id=request_id,
            guided_param=guided_param,
            tools=calls,
            tool_format=fmt,
        )

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _completion_prompts(prompt: Any) -> list[str | list[int]]:
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        return list(prompt)

    @staticmethod
    def _check_bounds(
        model: ServedModel, body: CompletionRequest | ChatCompletionRequest, num_prompts: int
    ) -> None:
        """The bounds that depend on this server and model: --max-n and the vocabulary."""
        model.bounds.check_choices(body.n, num_prompts)
        model.bounds.check_token_ids(body.stop_token_ids, "stop_token_ids")
        model.bounds.check_token_ids(body.logit_bias, "logit_bias")

    @staticmethod
    def _params(
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
    ) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as exc:
            param = exc.param if isinstance(exc, FieldError) else None
            raise APIError(400, str(exc), param=param, code=INVALID_VALUE) from exc

    async def _begin(
        self,
        body: Any,
        model: ServedModel,
        prompts: list[list[int]],
        params: SamplingParams,
        lora: LoRARequest | None,
        tenant: RequestTenant,
        chat: bool,
        endpoint: str,
        request_id: str | None = None,
        guided_param: str | None = None,
        tools: ToolPlan | None = None,
        tool_format: ToolFormat | None = None,
    ) -> Started:
        """Admit and start the engine's requests: an engine's refusal is an HTTP error here,
        before anything is answered."""
        timer = Timer(self.metrics)  # time to first token includes a grammar's compile
        if params.guided is not None:
            await _compile_grammar(model, params.guided, guided_param)
        request_id = request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        reserved = _reserved(model, prompts, params)
        ticket = await self.admission.admit(tenant, request_id, reserved)
        try:
            first, updates = await _start(
                model, guided_param, request_id, prompts, params, lora, tenant, chat
            )
        except BaseException:
            ticket.release(0)  # refused by the engine: nothing used
            raise
        # From here on the request has reached the engine: it ends with exactly one usage row.
        meter = Meter(
            self.ledger,
            ticket,
            self.metrics.tenants,
            tenant,
            request_id,
            model.name,
            # The adapter's own name: `sql@demo` is billed as `sql` (the row names demo).
            None if lora is None else body.model.partition("@")[0],
            lora,
            timer.start,
            endpoint=endpoint,
        )
        answer = Answer(
            request_id,
            body.model,
            chat,
            int(time.time()),
            params,
            body.stream and body.include_usage,
            [
                Choice(
                    i,
                    calls=None
                    if tools is None
                    else ToolCallStream(tools, None if tools.forced else tool_format),
                )
                for i in range(len(prompts) * params.n)
            ],
            Usage(),
            timer,
            meter,
            first,
            updates,
        )
        return Started(answer, model, updates, ticket.headers)

    async def _render(
        self, body: Any, started: Started, disconnected: Disconnected | None
    ) -> Response:
        """Answer in one JSON body, or in SSE chunks."""
        answer, tokenizer = started.answer, started.model.tokenizer
        if body.stream:
            return MeteredStream(
                sse_chunks(answer, self.checks, tokenizer),
                on_close=lambda: answer.end_nowait(STATUS_ABORTED),
                updates=started.updates,
                media_type="text/event-stream",
                headers=started.headers,
            )
        if not await unless_disconnected(collect(answer), disconnected):
            # Nobody is left to answer; the engine's requests are aborted, the row written.
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(
            await json_body(answer, self.checks, tokenizer), headers=started.headers
        )


def _tokenize(tokenizer: Any, prompts: list[str | list[int]]) -> list[list[int]]:
    return [
        list(tokenizer(p, add_special_tokens=True)["input_ids"]) if isinstance(p, str) else p
        for p in prompts
    ]


async def _compile_grammar(model: ServedModel, spec: GuidedSpec, param: str | None) -> None:
    """A spec that cannot compile (or not in time) answers 400 before anything is queued or
    streamed; the engine then finds the grammar in its cache."""
    try:
        await model.engine.compile_grammar(spec)
    except GuidedSpecError as exc:
        raise APIError(400, str(exc), param=param, code=INVALID_GRAMMAR) from exc


def _reserved(model: ServedModel, prompts: list[list[int]], params: SamplingParams) -> int:
    """Tokens the limiter reserves: each prompt, and each sample's max_tokens (what remains of
    the context where none is given). The actual count replaces it at the end."""
    max_len = model.engine.max_model_len
    return sum(len(p) + params.n * (params.max_tokens or max(0, max_len - len(p))) for p in prompts)


async def _start(
    model: ServedModel,
    guided_param: str | None,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    lora: LoRARequest | None,
    tenant: RequestTenant,
    chat: bool,
) -> tuple[tuple[int, SequenceUpdate] | None, AsyncGenerator[tuple[int, SequenceUpdate]]]:
    """Submit every prompt and wait for the first update, so that the engine's refusals
    (context length, a grammar) become HTTP errors before anything is answered."""
    streams = [
        # The salt, the fairness key and its weight are the tenant's, never the client's.
        model.engine.generate(
            EngineRequest(
                f"{request_id}-{i}",
                prompt,
                params,
                lora=lora,
                cache_salt=tenant.cache_salt,
                fairness_key=tenant.id,
                fairness_weight=tenant.weight,
            )
        )
        for i, prompt in enumerate(prompts)
    ]
    updates = merge(streams)
    try:
        return await anext(updates), updates
    except StopAsyncIteration:
        return None, updates
    except BaseException as exc:
        await updates.aclose()  # the other prompts' requests end too
        if not isinstance(exc, ValueError):
            raise
        if not isinstance(exc, RequestRefused):  # a malformed field the edge let through
            raise APIError(400, str(exc), code=INVALID_VALUE) from exc
        param = None
        if isinstance(exc, GuidedSpecError):
            param = guided_param
        elif isinstance(exc, ContextLengthExceeded):
            param = "messages" if chat else "prompt"
        error = api_error(exc, param)
        assert error is not None  # ENGINE_ERRORS has a row for every RequestRefused
        raise error from exc
