"""The /v1/chat/completions route and its endpoint over the shared core (gateway.openai.serving):
the messages through the model's chat template (with tools, their calls' grammar, when the
request has any), and the answer in chat's form (`ChatForm`): messages, role and content deltas,
tool calls, and log probabilities as `content` entries. The Responses API starts its chats here
too."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response

from engine.outputs import SequenceUpdate
from engine.request import GuidedSpec, SamplingParams
from gateway.http.errors import APIError
from gateway.http.request_limits import INVALID_VALUE
from gateway.models.served import ServedModel
from gateway.openai.answer import Answer, Choice, violation_body
from gateway.openai.json_response import Disconnected
from gateway.openai.protocol import ChatCompletionRequest, ChatMessage, FieldError
from gateway.openai.serving import (
    Generation,
    OpenAIServing,
    ServingDep,
    check_bounds,
    compile_grammar,
    hung_up,
    sampling_params,
)
from gateway.openai.tools.calls import ToolPlan, tool_plan
from gateway.openai.tools.parsers import FORMATS, ToolFormat
from gateway.openai.tools.prompt import Rendered, render_messages
from gateway.tenancy.auth import RequestTenant, TenantDep


class ChatForm:
    """Chat's answer: `chat.completion` with a message per choice, or `chat.completion.chunk`s
    of deltas after one that gives the assistant's role."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_param = "messages"

    def opening(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """Each choice's role, content "" (None while tool calls are forced)."""
        return [
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

    def chunk_choice(self, choice: Choice, update: SequenceUpdate) -> dict[str, Any] | None:
        if choice.calls is None:
            text = update.text_delta
            return {"index": choice.index, "delta": {"content": text} if text else {}}
        text, calls = choice.calls.deltas(choice.text, update.finished)
        delta: dict[str, Any] = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = calls
        if not delta and not update.finished:
            return None
        return {"index": choice.index, "delta": delta}

    def whole_choice(self, choice: Choice, tokenizer: Any) -> dict[str, Any]:
        logprobs = (
            self.logprobs(tokenizer, choice.token_ids, choice.logprobs) if choice.logprobs else None
        )
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

    def logprobs(
        self, tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]]
    ) -> dict[str, Any]:
        """Each token with its bytes and its top alternatives, as `content` entries."""
        decode = tokenizer.decode
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


CHAT = ChatForm()


class ChatServing:
    """One chat request's way through the core; built per request over the app's core."""

    def __init__(self, core: OpenAIServing) -> None:
        self.core = core

    async def create(
        self,
        body: ChatCompletionRequest,
        tenant: RequestTenant,
        disconnected: Disconnected | None = None,
    ) -> Response:
        return await self.core.respond(await self.start(body, tenant), disconnected)

    async def start(
        self,
        body: ChatCompletionRequest,
        tenant: RequestTenant,
        endpoint: str = "chat",
        request_id: str | None = None,
    ) -> Answer:
        """A chat request admitted and at its engine (the Responses API answers from it too):
        from here on it ends with exactly one usage row, `endpoint` naming the route and
        `request_id` (default: a new chat completion id) the request."""
        generation = await self.generation(body, tenant, endpoint, request_id)
        return await self.core.start(generation, tenant)

    async def generation(
        self,
        body: ChatCompletionRequest,
        tenant: RequestTenant,
        endpoint: str = "chat",
        request_id: str | None = None,
    ) -> Generation:
        """The body as the engine's prompt: bounds checked, the conversation (and its tools)
        through the model's chat template, tool calls' grammars compiled."""
        model, lora = await self.core.resolve_model(body.model, tenant)
        check_bounds(model, body, 1)
        plan = self._tool_plan(body)
        fmt = self.core.tool_format or FORMATS["hermes"]
        messages, tools = _render(body, plan, model, fmt)
        chars = sum(len(m["content"]) for m in messages) + len(json.dumps(tools or ""))
        model.bounds.check_prompt_chars(chars, "messages")
        params = sampling_params(body, body.requested_max_tokens, body.num_logprobs)
        calls = None if plan is None or plan.mode == "none" else plan
        if calls is not None:
            params = await _guided_by_tools(model, params, calls, fmt)
        prompt_ids = await _apply_template(model, messages, tools)
        return Generation(
            form=CHAT,
            model=model,
            lora=lora,
            named=body.model,
            request_id=request_id or f"chatcmpl-{uuid.uuid4().hex}",
            endpoint=endpoint,
            prompts=[prompt_ids],
            params=params,
            stream=body.stream,
            include_usage=body.include_usage,
            guided_param=body.guided_param if calls is None else "tools",
            tools=calls,
            tool_format=None if calls is None or calls.forced else fmt,
            routing_key=body.prompt_cache_key,
            priority=body.priority,
        )

    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan | None:
        """What the request's tools ask of the output; None for a request without tools."""
        if not body.tools and body.tool_choice is None:
            return None  # nothing to plan: gateway.openai.tools stays out of the way
        fmt = self.core.tool_format
        try:
            return tool_plan(body, None if fmt is None else fmt.name)
        except FieldError as exc:
            raise APIError(400, str(exc), param=exc.param, code=INVALID_VALUE) from exc


# The route's handler (gateway.openai.routes registers it under /v1).
async def chat_completions(
    body: ChatCompletionRequest, serving: ServingDep, tenant: TenantDep, request: Request
) -> Response:
    return await ChatServing(serving).create(body, tenant, hung_up(request))


def _render(
    body: ChatCompletionRequest, plan: ToolPlan | None, model: ServedModel, fmt: ToolFormat
) -> Rendered:
    """The conversation for the chat template; tools, past calls and their results through
    gateway.openai.tools.prompt, a conversation without any as it is."""
    if plan is None and not any(_mentions_tools(m) for m in body.messages):
        return [{"role": m.role, "content": m.text()} for m in body.messages], None
    template = getattr(model.tokenizer, "chat_template", None)
    return render_messages(body.messages, plan, fmt, template)


def _mentions_tools(message: ChatMessage) -> bool:
    return bool(message.tool_calls) or message.role == "tool"


async def _guided_by_tools(
    model: ServedModel, params: SamplingParams, calls: ToolPlan, fmt: ToolFormat
) -> SamplingParams:
    """The parameters with the calls' grammar: a forced call's output, else the format's
    structural tag. Each tool's schema compiles first, so that a bad one is refused by its
    tool."""
    for spec, param in calls.tool_specs():
        await compile_grammar(model, spec, param)
    guided = (
        calls.output_spec()
        if calls.forced
        else GuidedSpec(structural_tag=fmt.structural_tag(calls))
    )
    return dataclasses.replace(params, guided=guided)


async def _apply_template(
    model: ServedModel, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """The prompt's token ids, off the event loop; a template that refuses the conversation
    is a 400."""
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
    return list(cast(list[int], encoded["input_ids"]))
