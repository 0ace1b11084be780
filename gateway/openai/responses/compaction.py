"""`POST /v1/responses/compact`: a long conversation made short enough to go on with.

The conversation (a `previous_response_id` chain, then `input`) is cut before its last
`keep_turns` user turns. What comes before is summarised by the model itself, greedily, in at
most `summary_tokens` tokens (a list of the facts in it, each line once), into one
`compaction` item; every function call and its output from there is kept whole (an agent's
record of what its tools returned), and the last turns are kept as they are. The result
(OpenAI's `response.compaction` object) is the input of the next request: the compaction item
reads as a system message holding the summary.

The summary runs on the chat path as any request does (admitted, rate-limited, one usage row
with endpoint `responses_compact`); a conversation with nothing before its last turns runs
nothing and comes back as it was. The compaction item's `encrypted_content` is the summary,
encoded, not encrypted: it is text the client could have sent, and the server keeps nothing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from gateway.http.errors import APIError
from gateway.http.request_limits import INVALID_VALUE
from gateway.models.served import ServedModel
from gateway.openai.json_response import collect, json_body
from gateway.openai.protocol import MAX_NAME_CHARS, ChatCompletionRequest, FieldError, _Body
from gateway.openai.responses.compaction_item import compaction_item, summary_of
from gateway.openai.responses.items import MAX_ID_CHARS, items_of, new_id
from gateway.openai.responses.objects import text_part, usage_body
from gateway.openai.responses.protocol import Input
from gateway.openai.responses.serving import ResponsesServing
from gateway.tenancy.auth import RequestTenant

ENDPOINT = "responses_compact"  # the usage row's
# A list of facts rather than prose: small models keep names and numbers in a list and lose
# them in a story (SmolLM2-135M, tried both ways).
INSTRUCTIONS = "You extract facts from conversations so that an assistant can go on with them."
ASK = (
    "Conversation:\n{conversation}\n\nList the important facts from the conversation above "
    "(names, numbers, decisions, open questions), one per line, starting with the user's name "
    "if they gave it. At most {words} words."
)
SPEAKERS = {"user": "User", "assistant": "Assistant", "system": "System", "developer": "System"}


class CompactRequest(_Body):
    """The spec's CompactResponseMethodPublicBody (and the openai SDK's compact params)."""

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    input: Input | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    instructions: str | None = None
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)


@dataclass(frozen=True, slots=True)
class CompactPolicy:
    """How much a compaction keeps: the last `keep_turns` user turns whole, the rest in a
    summary of at most `summary_tokens` tokens."""

    keep_turns: int = 2
    summary_tokens: int = 256

    def __post_init__(self) -> None:
        if self.keep_turns < 0 or self.summary_tokens < 1:
            raise ValueError("keep_turns >= 0 and summary_tokens >= 1")


def split_turns(items: list[dict[str, Any]], keep_turns: int) -> tuple[list[Any], list[Any]]:
    """The items before the last `keep_turns` user turns, and those turns (from the user
    message that starts the first of them)."""
    starts = [i for i, item in enumerate(items) if _role(item) == "user"]
    if keep_turns == 0:
        return items, []
    if len(starts) <= keep_turns:
        return [], items
    cut = starts[-keep_turns]
    return items[:cut], items[cut:]


def transcript(items: list[dict[str, Any]]) -> list[str]:
    """The messages among `items` as lines for the summariser, oldest first (an earlier
    compaction's summary among them)."""
    lines = []
    for item in items:
        if item.get("type") == "compaction":
            lines.append(f"Summary of what came before: {summary_of(item['encrypted_content'])}")
            continue
        role = _role(item)
        if role is None:
            continue
        text = "".join(p.get("text") or p.get("refusal") or "" for p in item["content"])
        if text.strip():
            lines.append(f"{SPEAKERS.get(role, role)}: {text.strip()}")
    return lines


def fit_lines(model: ServedModel, lines: list[str], budget: int) -> list[str]:
    """The newest lines whose tokens fit `budget` (the oldest dropped first)."""
    kept: list[str] = []
    used = 0
    for line in reversed(lines):
        used += len(model.tokenizer.encode(line + "\n", add_special_tokens=False))
        if used > budget:
            break
        kept.append(line)
    return kept[::-1]


class Compactor:
    """Compacts conversations on the chat path of `responses` (a ResponsesServing)."""

    def __init__(self, responses: ResponsesServing, policy: CompactPolicy) -> None:
        self.responses = responses
        self.policy = policy

    async def compact(self, body: CompactRequest, tenant: RequestTenant) -> dict[str, Any]:
        items = await self._conversation(body, tenant)
        older, recent = split_turns(items, self.policy.keep_turns)
        calls = [i for i in older if i.get("type") in ("function_call", "function_call_output")]
        lines = transcript(older)
        compaction_id = new_id("cmp")
        usage = usage_body({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0})
        output = [_as_output(item) for item in items]
        if lines:
            summary, usage = await self._summarise(body, tenant, lines, compaction_id)
            output = [compaction_item(summary, compaction_id)]
            output += [_as_output(item) for item in calls + recent]
        return {
            "id": compaction_id,
            "object": "response.compaction",
            "created_at": int(time.time()),
            "output": output,
            "usage": usage,
        }

    async def _conversation(
        self, body: CompactRequest, tenant: RequestTenant
    ) -> list[dict[str, Any]]:
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = await self.responses.history(tenant, body.previous_response_id)
        try:
            given = [] if body.input is None else items_of(body.input)
            items = history + given
            transcript(items)  # a compaction item that does not decode: refused here
        except FieldError as exc:
            raise APIError(400, str(exc), param=exc.param, code=INVALID_VALUE) from exc
        except ValueError as exc:
            raise APIError(400, str(exc), param="input", code=INVALID_VALUE) from exc
        if not items:
            raise APIError(
                400,
                "nothing to compact: give input or a previous_response_id",
                param="input",
                code=INVALID_VALUE,
            )
        return items

    async def _summarise(
        self, body: CompactRequest, tenant: RequestTenant, lines: list[str], request_id: str
    ) -> tuple[str, dict[str, Any]]:
        serving = self.responses.serving
        model, _ = await serving.resolve_model(body.model, tenant)
        tokens = self.policy.summary_tokens
        # Room for the instructions and the template's own tokens besides the transcript.
        budget = model.engine.facts.max_model_len - tokens - 128
        kept = await asyncio.to_thread(fit_lines, model, lines, budget)
        system = INSTRUCTIONS
        if body.instructions:
            system += f"\nThe assistant's own instructions were: {body.instructions}"
        ask = ASK.format(conversation="\n".join(kept) or "(empty)", words=max(8, tokens * 3 // 4))
        chat = ChatCompletionRequest.model_validate(
            {
                "model": body.model,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": ask},
                ],
                "max_completion_tokens": tokens,
                "temperature": 0,
                "prompt_cache_key": body.prompt_cache_key,
            }
        )
        try:
            answer = await self.responses.chat.start(chat, tenant, ENDPOINT, request_id)
        except APIError as exc:
            if exc.param == "messages":  # the conversation: this API calls it input
                exc.param = "input"
            raise
        await collect(answer)
        result = await json_body(answer, serving.checks)
        text = result["choices"][0]["message"].get("content") or ""
        return distinct_lines(text), usage_body(result["usage"])


def distinct_lines(text: str) -> str:
    """The summary's lines, each once, in order: a small model repeats itself until its
    budget runs out, and a repeated fact costs every later turn its tokens."""
    seen: dict[str, None] = {}
    for line in text.splitlines():
        if line.strip():
            seen.setdefault(line.strip())
    return "\n".join(seen)


def _role(item: dict[str, Any]) -> str | None:
    return item.get("role") if item.get("type", "message") == "message" else None


def _as_output(item: dict[str, Any]) -> dict[str, Any]:
    """An item as the compacted output lists it: with its status, and an assistant's text
    parts whole (as input they may come without annotations)."""
    if item.get("type") == "compaction":
        return item
    if item.get("type", "message") == "message":
        parts = [
            text_part(part["text"], part.get("logprobs"))
            if part.get("type") == "output_text"
            else part
            for part in item["content"]
        ]
        item = {**item, "content": parts}
    return {"status": "completed", **item}
