"""From a parsed OpenAI body to engine requests and back: one JSON body or SSE chunks.

Each prompt x n sample is one choice. Choices stream as the engine produces
them; the final usage counts prompt, cached and completion tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from fastapi.responses import JSONResponse, Response

from engine.async_engine import EngineClient
from engine.errors import ContextLengthExceeded, GuidedSpecError, RequestRefused
from engine.lora import LoRARequest
from engine.messages import EngineRequest
from engine.outputs import SequenceUpdate
from engine.request import GuidedSpec, SamplingParams
from gateway.adapter_catalog import AdapterCatalog
from gateway.admission import Admission
from gateway.auth import RequestTenant
from gateway.errors import APIError, api_error
from gateway.guided_validation import OutputValidator, Violation, checks
from gateway.metering import STATUS_ABORTED, STATUS_ERROR, STATUS_OK, Meter
from gateway.metrics import Metrics
from gateway.protocol import ChatCompletionRequest, CompletionRequest, FieldError
from gateway.request_limits import (
    EMPTY_PROMPT,
    INVALID_GRAMMAR,
    INVALID_VALUE,
    RequestLimits,
    ServerBounds,
)
from gateway.response_state import (
    Choice,
    Timer,
    Usage,
    status_of,
    usage_finish_reason,
    violation_body,
)
from gateway.streaming import Disconnected, MeteredStream, chain, merge, unless_disconnected
from gateway.tool_calls import ToolCallStream, ToolPlan, parameters, tool_plan
from gateway.tool_parsers import FORMATS, ToolFormat
from gateway.tool_prompt import render_messages, template_knows_tools
from tenants.ledger import Ledger

logger = logging.getLogger(__name__)

# What nginx logs for a client that hung up before its answer; no client ever reads it.
CLIENT_CLOSED_REQUEST = 499


class OpenAIServing:
    def __init__(
        self,
        engine: EngineClient,
        served_model_name: str,
        metrics: Metrics,
        admission: Admission,
        ledger: Ledger,
        catalog: AdapterCatalog | None = None,
        limits: RequestLimits | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.admission = admission
        self.ledger = ledger
        self.model_name = served_model_name
        self.tokenizer: Any = engine.tokenizer
        self.metrics = metrics
        self.catalog = catalog  # None: LoRA is off
        self.bounds = ServerBounds(
            limits or RequestLimits(), engine.vocab_size, engine.max_model_len
        )
        self.output_validator = OutputValidator()
        # tool_choice "auto" reads calls in this format; None: auto is refused.
        self.tool_format = None if tool_call_parser is None else FORMATS[tool_call_parser]

    async def resolve_model(self, name: str, tenant: RequestTenant) -> LoRARequest | None:
        """The adapter a `model` field names for this tenant (its own, else a public one); None
        for the base model. 404 otherwise, the same answer for another tenant's adapter as
        for a name that does not exist."""
        if name == self.model_name:
            return None
        lora = None if self.catalog is None else await self.catalog.resolve(tenant.id, name)
        if lora is None:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )
        return lora

    # -- routes -------------------------------------------------------------------------------

    async def completions(
        self,
        body: CompletionRequest,
        tenant: RequestTenant,
        disconnected: Disconnected | None = None,
    ) -> Response:
        lora = await self.resolve_model(body.model, tenant)
        prompts = self._completion_prompts(body.prompt)
        self._check_bounds(body, len(prompts))
        params = self._params(body, body.max_tokens, body.logprobs)
        for prompt in prompts:
            if isinstance(prompt, str):
                self.bounds.check_prompt_chars(len(prompt), "prompt")
            else:
                self.bounds.check_token_ids(prompt, "prompt")
        # Text is tokenized here, off the event loop, so that a long prompt delays neither
        # other clients nor the engine's steps.
        token_ids = (
            await asyncio.to_thread(self._tokenize, prompts)
            if any(isinstance(p, str) for p in prompts)
            else cast(list[list[int]], prompts)
        )
        if not all(token_ids):
            raise APIError(400, "the prompt is empty", param="prompt", code=EMPTY_PROMPT)
        return await self._respond(
            body,
            token_ids,
            params,
            lora,
            tenant,
            chat=False,
            disconnected=disconnected,
            guided_param=body.guided_param,
        )

    async def chat(
        self,
        body: ChatCompletionRequest,
        tenant: RequestTenant,
        disconnected: Disconnected | None = None,
    ) -> Response:
        lora = await self.resolve_model(body.model, tenant)
        self._check_bounds(body, 1)
        try:
            plan = tool_plan(body, auto=self.tool_format is not None)
        except FieldError as exc:
            raise APIError(400, str(exc), param=exc.param, code=INVALID_VALUE) from exc
        native = template_knows_tools(getattr(self.tokenizer, "chat_template", None))
        fmt = self.tool_format or FORMATS["hermes"]
        messages, tools = render_messages(body.messages, plan, native, fmt)
        chars = sum(len(m["content"]) for m in messages) + len(json.dumps(tools or ""))
        self.bounds.check_prompt_chars(chars, "messages")
        params = self._params(body, body.requested_max_tokens, body.num_logprobs)
        guided_param = body.guided_param
        calls = None if plan is None or plan.mode == "none" else plan
        if calls is not None:
            for spec, param in calls.tool_specs():  # a bad schema is refused by its tool
                await self._compile_grammar(spec, param)
            guided = (
                calls.output_spec()
                if calls.forced
                else GuidedSpec(structural_tag=fmt.structural_tag(calls))
            )
            params = dataclasses.replace(params, guided=guided)
            guided_param = "tools"
        try:
            encoded = await asyncio.to_thread(
                self.tokenizer.apply_chat_template,
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
        return await self._respond(
            body,
            [prompt_ids],
            params,
            lora,
            tenant,
            chat=True,
            disconnected=disconnected,
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

    def _tokenize(self, prompts: list[str | list[int]]) -> list[list[int]]:
        return [
            list(self.tokenizer(p, add_special_tokens=True)["input_ids"])
            if isinstance(p, str)
            else p
            for p in prompts
        ]

    def _check_bounds(self, body: Any, num_prompts: int) -> None:
        """The bounds that depend on this server: --max-n and the vocabulary."""
        self.bounds.check_choices(body.n, num_prompts)
        self.bounds.check_token_ids(body.stop_token_ids, "stop_token_ids")
        self.bounds.check_token_ids(body.logit_bias, "logit_bias")

    @staticmethod
    def _params(body: Any, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as exc:
            param = exc.param if isinstance(exc, FieldError) else None
            raise APIError(400, str(exc), param=param, code=INVALID_VALUE) from exc

    async def _compile_grammar(self, spec: GuidedSpec, param: str | None) -> None:
        """A spec that cannot compile (or not in time) answers 400 before anything is queued
        or streamed; the engine then finds the grammar in its cache."""
        try:
            await self.engine.compile_grammar(spec)
        except GuidedSpecError as exc:
            raise APIError(400, str(exc), param=param, code=INVALID_GRAMMAR) from exc

    async def _respond(
        self,
        body: Any,
        prompts: list[list[int]],
        params: SamplingParams,
        lora: LoRARequest | None,
        tenant: RequestTenant,
        chat: bool,
        disconnected: Disconnected | None = None,
        guided_param: str | None = None,
        tools: ToolPlan | None = None,
        tool_format: ToolFormat | None = None,
    ) -> Response:
        timer = Timer(self.metrics)  # time to first token includes a grammar's compile
        if params.guided is not None:
            await self._compile_grammar(params.guided, guided_param)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        ticket = await self.admission.admit(tenant, request_id, self._reserved(prompts, params))
        try:
            first, updates = await self._start(
                guided_param, request_id, prompts, params, lora, tenant, chat
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
            self.model_name,
            None if lora is None else body.model,
            lora,
            timer.start,
        )
        choices = [
            Choice(
                i,
                calls=None
                if tools is None
                else ToolCallStream(tools, None if tools.forced else tool_format),
            )
            for i in range(len(prompts) * params.n)
        ]
        usage = Usage()
        created = int(time.time())
        if body.stream:
            chunks = self._stream(
                body.model,
                request_id,
                created,
                chat,
                body.include_usage,
                first,
                updates,
                choices,
                usage,
                params,
                timer,
                meter,
            )
            return MeteredStream(
                chunks,
                on_close=lambda: meter.end_nowait(
                    usage.figures(choices), usage_finish_reason(choices), STATUS_ABORTED
                ),
                updates=updates,
                media_type="text/event-stream",
                headers=ticket.headers,
            )
        collect = self._collect(first, updates, choices, usage, params.n, timer, meter)
        if not await unless_disconnected(collect, disconnected):
            # Nobody is left to answer; the engine's requests are aborted, the row written.
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        for choice in choices:
            await self._check_output(params.guided, choice, request_id)
        timer.finish(choices, usage)
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": body.model,
                "choices": [self._final_choice(c, chat) for c in choices],
                "usage": usage.body(choices),
            },
            headers=ticket.headers,
        )

    async def _collect(
        self,
        first: tuple[int, SequenceUpdate] | None,
        updates: AsyncGenerator[tuple[int, SequenceUpdate]],
        choices: list[Choice],
        usage: Usage,
        n: int,
        timer: Timer,
        meter: Meter,
    ) -> None:
        """A whole response's updates, metered however they end."""
        status = STATUS_ERROR
        try:
            # Closed however the loop ends, so that a failed choice aborts its siblings.
            async with contextlib.aclosing(chain(first, updates)) as in_order:
                async for prompt_index, update in in_order:
                    timer.update(update)
                    meter.first_token()
                    self._apply(choices, usage, prompt_index, update, n)
            status = status_of(choices)
        except asyncio.CancelledError:
            meter.end_nowait(usage.figures(choices), usage_finish_reason(choices), STATUS_ABORTED)
            raise
        finally:
            await meter.end(usage.figures(choices), usage_finish_reason(choices), status)

    def _reserved(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """Tokens the limiter reserves: each prompt, and each sample's max_tokens (what remains
        of the context where none is given). The actual count replaces it at the end."""
        max_len = self.engine.max_model_len
        return sum(
            len(p) + params.n * (params.max_tokens or max(0, max_len - len(p))) for p in prompts
        )

    async def _start(
        self,
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
            self.engine.generate(
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
            raise api_error(exc, param) or exc from exc

    @staticmethod
    def _apply(
        choices: list[Choice], usage: Usage, prompt_index: int, update: SequenceUpdate, n: int
    ) -> Choice:
        choice = choices[prompt_index * n + update.index]
        usage.record(prompt_index, update)
        choice.token_ids.extend(update.new_token_ids)
        choice.text = update.text
        if update.new_logprobs:
            choice.logprobs.extend(update.new_logprobs)
        if update.finished:
            choice.finish_reason = update.finish_reason
            choice.stop_reason = update.stop_reason
            if update.error:
                raise APIError(500, update.error, type="internal_error")
        return choice

    def _final_choice(self, choice: Choice, chat: bool) -> dict[str, Any]:
        logprobs = (
            self._logprobs(choice.token_ids, choice.logprobs, chat) if choice.logprobs else None
        )
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": choice.text}
            reason = choice.answered_reason
            if reason == "tool_calls":
                assert choice.calls is not None
                content, calls = choice.calls.final(choice.text)
                message = {"role": "assistant", "content": content, "tool_calls": calls}
            return {
                "index": choice.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
            } | violation_body(choice)
        return {
            "index": choice.index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": choice.answered_reason,
        } | violation_body(choice)

    async def _check_output(self, spec: GuidedSpec | None, choice: Choice, request_id: str) -> None:
        """The safety net: a guided JSON document that ended where its grammar ends (not at
        max_tokens, nor at a stop string or token of the client's) is checked against its
        schema; one that fails is answered as `error`, counted and logged. Metering and the
        engine's finish reason are left as they are: the tokens were generated."""
        if choice.finish_reason != "stop" or choice.stop_reason is not None:
            return
        if choice.calls is not None and choice.calls.fmt is not None:
            violation = await self._check_calls(choice.calls, choice.text)
        elif checks(spec):
            assert spec is not None
            violation = await self.output_validator.check(spec, choice.text)
        else:
            return
        if violation is None:
            return
        choice.violation = violation
        self.metrics.guided_invalid_outputs.labels(keyword=violation.keyword).inc()
        logger.warning(
            "%s choice %d: guided output failed its schema: keyword %s at %r (schema %r)",
            request_id,
            choice.index,
            violation.keyword,
            violation.pointer,
            violation.schema_pointer,
        )

    async def _check_calls(self, stream: ToolCallStream, text: str) -> Violation | None:
        """Each call read out of free text (tool_choice "auto") against its tool's schema."""
        tools = {t.function.name: t for t in stream.plan.tools}
        for call in stream.final(text)[1] or ():
            function = call["function"]
            spec = GuidedSpec(json_schema=parameters(tools[function["name"]]))
            violation = await self.output_validator.check(spec, function["arguments"])
            if violation is not None:
                return violation
        return None

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]], chat: bool) -> Any:
        decode = self.tokenizer.decode
        if chat:
            content = []
            for token_id, entry in zip(token_ids, entries, strict=False):
                token: str = decode([token_id])
                top = sorted(entry.items(), key=lambda kv: -kv[1])
                content.append(
                    {
                        "token": token,
                        "logprob": entry[token_id],
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {
                                "token": decode([t]),
                                "logprob": lp,
                                "bytes": list(cast(str, decode([t])).encode()),
                            }
                            for t, lp in top
                        ],
                    }
                )
            return {"content": content}
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

    async def _stream(
        self,
        model: str,
        request_id: str,
        created: int,
        chat: bool,
        include_usage: bool,
        first: tuple[int, SequenceUpdate] | None,
        updates: AsyncIterator[tuple[int, SequenceUpdate]],
        choices: list[Choice],
        usage: Usage,
        params: SamplingParams,
        timer: Timer,
        meter: Meter,
    ) -> AsyncGenerator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice_list: list[dict[str, Any]], with_usage: Any = None) -> str:
            data: dict[str, Any] = {
                "id": request_id,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choice_list,
            }
            if include_usage:
                data["usage"] = with_usage
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        if chat:
            yield chunk(
                [
                    {
                        "index": c.index,
                        "delta": {
                            "role": "assistant",
                            "content": None if c.calls is not None and c.calls.fmt is None else "",
                        },
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for c in choices
                ]
            )
        status = STATUS_OK
        try:
            async with contextlib.aclosing(chain(first, updates)) as in_order:
                async for prompt_index, update in in_order:
                    timer.update(update)
                    meter.first_token()
                    choice = self._apply(choices, usage, prompt_index, update, params.n)
                    delta = choice.text[choice.num_sent_chars :]
                    choice.num_sent_chars = len(choice.text)
                    if not delta and not update.finished:
                        continue
                    logprobs = (
                        self._logprobs(update.new_token_ids, update.new_logprobs, chat)
                        if update.new_logprobs
                        else None
                    )
                    body: dict[str, Any] = {"index": choice.index}
                    if chat and choice.calls is not None:
                        text, calls = choice.calls.deltas(choice.text, update.finished)
                        body["delta"] = {"content": text} if text else {}
                        if calls:
                            body["delta"]["tool_calls"] = calls
                        if not body["delta"] and not update.finished:
                            continue
                    elif chat:
                        body["delta"] = {"content": delta} if delta else {}
                    else:
                        body["text"] = delta
                    body["logprobs"] = logprobs
                    if update.finished:
                        await self._check_output(params.guided, choice, request_id)
                    body["finish_reason"] = choice.answered_reason
                    body |= violation_body(choice)
                    yield chunk([body])
            status = status_of(choices)
        except Exception as exc:  # noqa: BLE001 - the stream has begun: report it in the stream
            status = STATUS_ERROR
            err = api_error(exc)
            if err is None:
                logger.exception("stream %s failed", request_id)
                err = APIError(500, f"internal server error ({request_id})", type="internal_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        timer.finish(choices, usage)
        # Durable before the stream's last bytes: the client that saw [DONE] is billed.
        await meter.end(usage.figures(choices), usage_finish_reason(choices), status)
        if include_usage:
            yield chunk([], usage.body(choices))
        yield "data: [DONE]\n\n"
