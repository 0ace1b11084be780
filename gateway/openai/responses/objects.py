"""The Responses API's objects, made from what the chat path produced: output items (a
`message` with `output_text`, `function_call`s), usage in the Responses names, and the
`response` object itself (its shape checked against the openai SDK's types in tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gateway.openai.responses.protocol import ResponsesRequest, new_id


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
            "reasoning": {"effort": None, "summary": None},
            "store": request.store,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": request.text_body(),
            "tool_choice": request.tool_choice or "auto",
            "tools": request.tools or [],
            "top_p": 1.0 if request.top_p is None else request.top_p,
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


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [text_part(text)] if status == "completed" else [],
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


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


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat completion's assistant message as output items: its text (if any, or if it
    holds no calls), then each call."""
    items = []
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    if text or not calls:
        items.append(message_item(new_id("msg"), text))
    for call in calls:
        function = call["function"]
        items.append(call_item(new_id("fc"), call["id"], function["name"], function["arguments"]))
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
