"""A whole response: every update collected (metered however that ends), each output checked,
then one OpenAI JSON body (`chat.completion` or `text_completion`)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from gateway.openai.answer import Answer, Choice, status_of, violation_body
from gateway.openai.logprobs import logprobs_body
from gateway.openai.output_checks import OutputChecks
from gateway.tenancy.metering import STATUS_ABORTED, STATUS_ERROR


async def collect(answer: Answer) -> None:
    """Every update of the answer's choices; the usage row is written however this ends."""
    status = STATUS_ERROR
    try:
        async with contextlib.aclosing(answer.in_order()) as in_order:
            async for prompt_index, update in in_order:
                answer.apply(prompt_index, update)
        status = status_of(answer.choices)
    except asyncio.CancelledError:
        answer.end_nowait(STATUS_ABORTED)
        raise
    finally:
        await answer.end(status)


async def json_body(answer: Answer, checks: OutputChecks, tokenizer: Any) -> dict[str, Any]:
    """The collected answer as OpenAI's body, each guided output checked first."""
    for choice in answer.choices:
        await checks.check(answer.params.guided, choice, answer.request_id)
    answer.timer.finish(answer.choices, answer.usage)
    return {
        "id": answer.request_id,
        "object": "chat.completion" if answer.chat else "text_completion",
        "created": answer.created,
        "model": answer.model,
        "choices": [_final_choice(c, answer.chat, tokenizer) for c in answer.choices],
        "usage": answer.usage.body(answer.choices),
    }


def _final_choice(choice: Choice, chat: bool, tokenizer: Any) -> dict[str, Any]:
    logprobs = (
        logprobs_body(tokenizer, choice.token_ids, choice.logprobs, chat)
        if choice.logprobs
        else None
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
