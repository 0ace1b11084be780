"""The Responses API's objects, made from what the chat path produced: output items (a
`message` with `output_text`, `function_call`s), usage in the Responses names, and the
`response` object itself, with every field the Open Responses spec requires (its shape
checked against the spec and the openai SDK's types in tests: tests/gateway/response_events)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gateway.openai.responses.items import new_id
from gateway.openai.responses.protocol import ResponsesRequest


@dataclass(slots=True)
class ResponseMeta:
    """What a response echoes of its request, fixed when it is created."""

    id: str
    request: ResponsesRequest
    created: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def created_at(self) -> int:
        return int(self.created.timestamp())

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        request = self.request
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens" if finish_reason == "length" else "other"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            # OpenAI's: set only once the response has completed.
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "background": request.background,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "model": request.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            **request.conversation_body(),  # only when it names one
            "reasoning": {"effort": None, "summary": None},
            "store": request.store,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": request.text_body(),
            "tool_choice": request.tool_choice or "auto",
            "tools": request.tools_body(),
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "presence_penalty": request.presence_penalty or 0.0,
            "frequency_penalty": request.frequency_penalty or 0.0,
            "top_logprobs": request.top_logprobs or 0,
            "max_tool_calls": request.max_tool_calls,
            "service_tier": "default",
            "safety_identifier": request.safety_identifier,
            "prompt_cache_key": request.prompt_cache_key,
            "truncation": request.truncation,
            "usage": usage,
            "user": request.user,
        }


def status_of(finish_reason: str | None) -> str:
    """A finished response's status from its chat choice's finish reason."""
    if finish_reason == "length":
        return "incomplete"
    if finish_reason == "error":
        return "failed"
    return "completed"


def usage_body(chat_usage: dict[str, Any]) -> dict[str, Any]:
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        # Tokens written to the cache are not counted (any prompt's full blocks are).
        "input_tokens_details": {
            "cached_tokens": details.get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def message_item(
    item_id: str,
    text: str,
    status: str = "completed",
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The assistant's text; `incomplete` when it was cut (max_output_tokens), its text
    kept; no content part yet while `in_progress`."""
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [] if status == "in_progress" else [text_part(text, logprobs)],
    }


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def item_status(finish_reason: str | None) -> str:
    """An output item's status when its response finished for `finish_reason`."""
    return "incomplete" if finish_reason == "length" else "completed"


def logprobs_body(chat_logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` as output_text's `logprobs` (the same entries: token,
    logprob, bytes, top_logprobs)."""
    return list((chat_logprobs or {}).get("content") or [])


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat completion's choice as output items: its text (if any, or if it holds no
    calls), then each call; cut at max_output_tokens, each says `incomplete`."""
    message = choice["message"]
    status = item_status(choice.get("finish_reason"))
    items = []
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    if text or not calls:
        logprobs = logprobs_body(choice.get("logprobs"))
        items.append(message_item(new_id("msg"), text, status, logprobs))
    for call in calls:
        function = call["function"]
        items.append(
            call_item(new_id("fc"), call["id"], function["name"], function["arguments"], status)
        )
    return items


def item_list(
    items: list[dict[str, Any]], order: str, limit: int, after: str | None
) -> dict[str, Any]:
    """`input_items` as OpenAI lists them: a page of items, newest first by default."""
    ordered = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [item.get("id") for item in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }
