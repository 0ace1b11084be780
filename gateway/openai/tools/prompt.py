"""Tools in the prompt: the request's tools, past calls and tool results, rendered through the
model's chat template when it knows tools (its source mentions `tools`: Qwen2.5, Llama 3.1+,
Mistral, Hermes-style templates), else in a system message of ours that shows the server's
call format (`--tool-call-parser`, Hermes's by default), past calls written in that format
and tool results as user turns in `<tool_response>` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from gateway.openai.protocol import ChatMessage, Tool
from gateway.openai.tools.calls import ToolPlan, parameters
from gateway.openai.tools.parsers import ToolFormat

INSTRUCTIONS = (
    "You can call functions. Each one is described by a JSON object inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, write {example}; write one call per function call you make."
)


# The messages for the chat template, and the tools to pass it (None: none, or in a system
# message of ours).
Rendered = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]


def template_knows_tools(chat_template: Any) -> bool:
    return isinstance(chat_template, str) and "tools" in chat_template


def render_messages(
    messages: list[ChatMessage], plan: ToolPlan | None, fmt: ToolFormat, chat_template: Any
) -> Rendered:
    """The conversation and its tools for `chat_template` (the model's, None where it has
    none): through the template where it knows tools, else with ours. `fmt`: the server's call
    format, which past calls are written in."""
    if template_knows_tools(chat_template):
        return native_messages(messages, plan, fmt)
    return generic_messages(messages, plan, fmt)


def native_messages(
    messages: list[ChatMessage], plan: ToolPlan | None, fmt: ToolFormat
) -> Rendered:
    """For a template that knows tools: the tools passed to it, calls and results as messages
    of its own."""
    tools = None if plan is None else [_tool_json(t) for t in plan.tools]
    # Mistral's templates refuse call ids that are not 9 letters or digits.
    ids = _mistral_id if fmt.name == "mistral" else str
    return [_native_message(m, messages, ids) for m in messages], tools


def generic_messages(
    messages: list[ChatMessage], plan: ToolPlan | None, fmt: ToolFormat
) -> Rendered:
    """For a template that does not know tools: the tools in a system message of ours that
    shows `fmt`, past calls written in it, results as user turns."""
    tools = None if plan is None else [_tool_json(t) for t in plan.tools]
    rendered: list[dict[str, Any]] = []
    for message in messages:
        entry = _generic_message(message, fmt)
        if message.role == "tool" and rendered and rendered[-1].pop("results", False):
            rendered[-1]["content"] += "\n" + entry["content"]  # consecutive results: one turn
            rendered[-1]["results"] = True
            continue
        if message.role == "tool":
            entry["results"] = True
        rendered.append(entry)
    for entry in rendered:
        entry.pop("results", None)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        instructions = INSTRUCTIONS.format(tools=listing, example=fmt.example)
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{instructions}".lstrip()
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
    return rendered, None


def _tool_json(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    function["parameters"] = parameters(tool)
    return {"type": "function", "function": function}


def _arguments(text: str) -> Any:
    """A call's arguments as templates want them: the object, or the text if it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _mistral_id(call_id: str | None) -> str:
    return "".join(c for c in call_id or "" if c.isalnum())[-9:].rjust(9, "0")


def _native_message(
    message: ChatMessage, history: list[ChatMessage], ids: Callable[[Any], str]
) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        entry["tool_calls"] = [
            {
                "id": ids(call.id),
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.role == "tool":
        entry["tool_call_id"] = ids(message.tool_call_id)
        name = _called_name(history, message.tool_call_id)
        if name is not None:
            entry["name"] = name
    return entry


def _generic_message(message: ChatMessage, fmt: ToolFormat) -> dict[str, Any]:
    text = message.text()
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    if message.tool_calls:
        calls = [
            fmt.render_call(call.function.name, _arguments(call.function.arguments))
            for call in message.tool_calls
        ]
        text = "\n".join(([text] if text else []) + calls)
    return {"role": message.role, "content": text}


def _called_name(history: list[ChatMessage], call_id: str | None) -> str | None:
    for message in history:
        for call in message.tool_calls or ():
            if call.id == call_id:
                return call.function.name
    return None
