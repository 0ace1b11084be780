"""The Responses API's items: each input item checked and kept in the Responses shape with
an id (what `input_items` lists, what a later turn's `previous_response_id` replays, what a
conversation stores), and a conversation's items as chat messages, which is all the engine
runs. A malformed item is a FieldError naming it (`input[2].content[0].type`)."""

from __future__ import annotations

import re
import uuid
from typing import Any, Literal, get_args

from gateway.openai.protocol import FUNCTION_NAME_PATTERN, MAX_NAME_CHARS, FieldError
from gateway.openai.responses.compaction_item import compaction_item, summary_of

MAX_ID_CHARS = 64
MAX_ARGUMENT_CHARS = 1 << 20
Role = Literal["user", "system", "developer", "assistant"]
ROLES: tuple[str, ...] = get_args(Role)
TextPartType = Literal["input_text", "output_text", "text", "refusal"]
TEXT_PARTS: tuple[str, ...] = get_args(TextPartType)
UNSUPPORTED_PARTS = {
    "input_image": "image inputs",
    "input_file": "file inputs",
    "input_audio": "audio inputs",
}
FUNCTION_NAME = re.compile(FUNCTION_NAME_PATTERN)
# How a compaction's summary (gateway.openai.responses.compaction) reads to the model.
SUMMARY_HEADING = "A summary of the conversation before the turns that follow:\n"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def items_of(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as Responses items with ids. Raises FieldError."""
    if isinstance(given, str):
        return [_message("user", [{"type": "input_text", "text": given}])]
    return [input_item(item, f"input[{i}]") for i, item in enumerate(given)]


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses items (inputs and earlier outputs, oldest first) as chat messages: a
    function call joins the assistant message before it, its output is a tool message."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(
                part.get("text") or part.get("refusal") or "" for part in item["content"]
            )
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        elif kind == "compaction":  # checked when it came in (input_item)
            summary = summary_of(item["encrypted_content"])
            messages.append({"role": "system", "content": f"{SUMMARY_HEADING}{summary}"})
    return messages


def input_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    """One input item (at `where`, as errors name it) as stored, with an id. Raises
    FieldError. The Conversations API takes its items through here too."""
    kind = item.get("type", "message")  # an easy message has a role and no type
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise FieldError(f"{where}.role", f"role is one of {', '.join(ROLES)}")
        return _message(role, _parts(item.get("content"), role, f"{where}.content"))
    if kind == "compaction":
        content = _bounded_str(item.get("encrypted_content"), f"{where}.encrypted_content")
        try:
            summary_of(content)
        except ValueError as exc:
            raise FieldError(f"{where}.encrypted_content", str(exc)) from exc
        item_id = _bounded_str(item.get("id") or new_id("cmp"), f"{where}.id", MAX_ID_CHARS)
        return compaction_item(summary_of(content), item_id)
    if kind == "function_call":
        return {
            "type": "function_call",
            "id": _bounded_str(item.get("id") or new_id("fc"), f"{where}.id", MAX_ID_CHARS),
            "call_id": _bounded_str(item.get("call_id"), f"{where}.call_id", MAX_NAME_CHARS),
            "name": _function_name(item.get("name"), f"{where}.name"),
            "arguments": _bounded_str(item.get("arguments"), f"{where}.arguments"),
            "status": "completed",
        }
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):  # content parts: their text
            output = "".join(str(p.get("text", "")) for p in output if isinstance(p, dict))
        return {
            "type": "function_call_output",
            "id": _bounded_str(item.get("id") or new_id("fco"), f"{where}.id", MAX_ID_CHARS),
            "call_id": _bounded_str(item.get("call_id"), f"{where}.call_id", MAX_NAME_CHARS),
            "output": _bounded_str(output, f"{where}.output"),
            "status": "completed",
        }
    raise FieldError(f"{where}.type", f"input items of type {kind!r} are not supported")


def _message(role: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": new_id("msg"), "role": role, "content": parts}


def _parts(content: Any, role: str, where: str) -> list[dict[str, Any]]:
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [{"type": kind, "text": content}]
    if not isinstance(content, list):
        raise FieldError(where, "content is a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise FieldError(f"{where}[{j}]", "a content part is an object with a type")
        part_kind = part.get("type")
        if isinstance(part_kind, str) and part_kind in UNSUPPORTED_PARTS:
            raise FieldError(
                f"{where}[{j}].type",
                f"{UNSUPPORTED_PARTS[part_kind]} are not supported: the model reads text only",
            )
        texts = (part.get("text", ""), part.get("refusal", ""))
        if part_kind not in TEXT_PARTS or not all(isinstance(text, str) for text in texts):
            raise FieldError(f"{where}[{j}].type", f"a content part of type {part_kind!r}")
        parts.append({"type": kind, "text": part.get("text") or part.get("refusal") or ""})
    return parts


def _function_name(value: Any, where: str) -> str:
    """A function call's name as chat's tools take it: a later turn replays the call to the
    chat template, which would refuse any other."""
    name = _bounded_str(value, where, 64)
    if not FUNCTION_NAME.fullmatch(name):
        raise FieldError(where, "a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -")
    return name


def _bounded_str(value: Any, where: str, limit: int = MAX_ARGUMENT_CHARS) -> str:
    """A string field of an item: ids and names not empty; arguments and outputs may be."""
    may_be_empty = limit == MAX_ARGUMENT_CHARS
    if not isinstance(value, str) or not (value or may_be_empty):
        raise FieldError(where, f"{where.rsplit('.', 1)[-1]} is a non-empty string")
    if len(value) > limit:
        raise FieldError(where, f"{where.rsplit('.', 1)[-1]} is over {limit} characters")
    return value
