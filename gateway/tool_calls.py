"""OpenAI tool calling: what a request's tools ask of the output, how they reach the prompt, and
the calls read back out of the text, whole or as it streams.

A forced call (`tool_choice` "required" or naming a function) is guided decoding: the output
must be, for a named function, its arguments (a document of its `parameters` schema), and for
"required" a JSON array of `{"name": ..., "parameters": ...}` objects, one per call (exactly
one when `parallel_tool_calls` is false), each `parameters` a document of its function's
schema. So every forced call parses and its arguments validate, on any model. The text is
compact JSON with keys in the schema's order, which is what lets `scan_calls` read the calls
out of a partial text while it streams.

Tools reach the prompt through the model's chat template when the template knows tools (its
source mentions `tools`: Qwen2.5, Llama 3.1+, Mistral, Hermes-style), else through a system
message of ours in the Hermes style (`<tools>` ... `</tools>`, calls as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`); past calls and tool results are
rendered in the same style.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.request import GuidedSpec
from gateway.protocol import ChatCompletionRequest, ChatMessage, FieldError, Tool

# The schema of a function that declares no parameters.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOLS_INSTRUCTIONS = (
    "You can call functions. Each one is described by a JSON object inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    'To call a function, write <tool_call>{{"name": <the function\'s name>, "arguments": '
    "<an object of its parameters>}}</tool_call>, one such block per call."
)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools ask of its output."""

    tools: tuple[Tool, ...]
    forced: str | None  # "named", "required", or None: text (tool_choice "none")
    name: str | None = None  # the named function
    parallel: bool = True

    def output_spec(self) -> GuidedSpec:
        """The grammar a forced call's output follows."""
        assert self.forced is not None
        strict = all(t.function.strict is not False for t in self.tools)
        if self.forced == "named":
            return GuidedSpec(json_schema=parameters(self._tool(self.name)), strict=strict)
        return GuidedSpec(json_schema=self._calls_schema(), strict=strict)

    def tool_specs(self) -> list[tuple[GuidedSpec, str]]:
        """Each function's own schema and the field it came from, compiled before the output's
        grammar so that a bad one is refused naming its tool."""
        return [
            (GuidedSpec(json_schema=parameters(tool)), f"tools[{i}].function.parameters")
            for i, tool in enumerate(self.tools)
            if self.forced == "required" or tool.function.name == self.name
        ]

    def _tool(self, name: str | None) -> Tool:
        return next(t for t in self.tools if t.function.name == name)

    def _calls_schema(self) -> dict[str, Any]:
        """An array of calls; each function's schema moved under $defs, its internal $refs
        rebased there."""
        defs: dict[str, Any] = {}
        branches = []
        for i, tool in enumerate(self.tools):
            defs[f"tool{i}"] = _rebased(parameters(tool), f"#/$defs/tool{i}")
            branches.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": tool.function.name},
                        "parameters": {"$ref": f"#/$defs/tool{i}"},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        calls: dict[str, Any] = {
            "type": "array",
            "items": branches[0] if len(branches) == 1 else {"anyOf": branches},
            "minItems": 1,
        }
        if not self.parallel:
            calls["maxItems"] = 1
        return calls | {"$defs": defs}


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan; None when it has no tools. Raises FieldError (HTTP 400)."""
    choice = body.tool_choice
    named = None if isinstance(choice, str) or choice is None else choice.function.name
    if not body.tools:
        if named is not None or choice == "required":
            raise FieldError("tool_choice", "tool_choice asks for a tool call, but no tools given")
        return None
    names = [t.function.name for t in body.tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise FieldError(f"tools[{i}].function.name", f"two tools are named {name!r}")
    if choice is None or choice == "auto":
        raise FieldError(
            "tool_choice",
            'tool_choice "auto" (the default with tools) needs a tool-call parser, which this '
            'server does not have yet: send "required", {"type": "function", "function": '
            '{"name": ...}}, or "none"',
        )
    if choice == "none":
        return ToolPlan(tuple(body.tools), None)
    if body.guided_param is not None:
        raise FieldError(
            body.guided_param,
            f"{body.guided_param} and a forced tool call both constrain the output; send one",
        )
    if named is not None and named not in names:
        raise FieldError("tool_choice", f"tool_choice names {named!r}, which is not in tools")
    return ToolPlan(
        tuple(body.tools),
        "named" if named is not None else "required",
        named,
        body.parallel_tool_calls,
    )


def parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


def _rebased(schema: Any, root: str) -> Any:
    """The schema with every internal $ref (`#...`) pointing under `root` instead of `#`."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        else:
            out[key] = _rebased(value, root)
    return out


# -- the prompt ---------------------------------------------------------------------------------


def template_knows_tools(chat_template: Any) -> bool:
    return isinstance(chat_template, str) and "tools" in chat_template


def render_messages(
    messages: list[ChatMessage], plan: ToolPlan | None, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages for the chat template, and the tools to pass it (None: the tools, if any,
    are in a system message of ours). `native`: the template knows tools."""
    tools = None if plan is None else [_tool_json(t) for t in plan.tools]
    if native:
        return [_native_message(m, messages) for m in messages], tools
    rendered: list[dict[str, Any]] = []
    for message in messages:
        entry = _generic_message(message)
        if entry["role"] == "user" and message.role == "tool" and rendered:
            last = rendered[-1]
            if last.get("tool_results"):  # consecutive results: one message
                last["content"] += "\n" + entry["content"]
                continue
            entry["tool_results"] = True
        rendered.append(entry)
    for entry in rendered:
        entry.pop("tool_results", None)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        instructions = TOOLS_INSTRUCTIONS.format(tools=listing)
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
    """A call's arguments as the templates want them: the object, or the text if not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _native_message(message: ChatMessage, history: list[ChatMessage]) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.role == "tool":
        entry["tool_call_id"] = message.tool_call_id
        name = _called_name(history, message.tool_call_id)
        if name is not None:
            entry["name"] = name
    return entry


def _generic_message(message: ChatMessage) -> dict[str, Any]:
    text = message.text()
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    if message.tool_calls:
        blocks = [
            "<tool_call>"
            + json.dumps(
                {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                ensure_ascii=False,
            )
            + "</tool_call>"
            for call in message.tool_calls
        ]
        text = "\n".join(([text] if text else []) + blocks)
    return {"role": message.role, "content": text}


def _called_name(history: list[ChatMessage], call_id: str | None) -> str | None:
    for message in history:
        for call in message.tool_calls or ():
            if call.id == call_id:
                return call.function.name
    return None


# -- the calls in the output --------------------------------------------------------------------


@dataclass(slots=True)
class CallText:
    """One call as far as the text goes: its name, and its arguments' text so far."""

    name: str
    arguments: str
    complete: bool


_CALL_HEAD = re.compile(r'\{"name":("(?:[^"\\]|\\.)*")(,"parameters":)?')


def scan_calls(plan: ToolPlan, text: str, finished: bool) -> list[CallText]:
    """The calls in a forced call's (partial) output, in order."""
    if plan.forced == "named":
        assert plan.name is not None
        return [CallText(plan.name, text, finished)]
    calls: list[CallText] = []
    pos = 1 if text.startswith("[") else len(text)
    while pos < len(text):
        head = _CALL_HEAD.match(text, pos)
        if head is None:
            break
        name = json.loads(head.group(1))
        if head.group(2) is None:
            calls.append(CallText(name, "", False))
            break
        start = head.end()
        end = _value_end(text, start)
        if end is None:
            calls.append(CallText(name, text[start:], False))
            break
        calls.append(CallText(name, text[start:end], True))
        pos = end + 1  # the call's closing brace
        if text[pos : pos + 1] != ",":
            break
        pos += 1
    return calls


def _value_end(text: str, start: int) -> int | None:
    """The index after the compact JSON value at `start`; None if the text ends inside it."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            if depth == 0:
                return i  # the end of a scalar, at its container's close
            depth -= 1
            if depth == 0:
                return i + 1
        elif c == "," and depth == 0:
            return i
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallStream:
    """One choice's calls as OpenAI streams them: each call's index, id and name first, then
    its arguments in fragments as they are written."""

    plan: ToolPlan
    ids: list[str] = field(default_factory=list)
    sent_chars: list[int] = field(default_factory=list)

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        out = []
        for index, call in enumerate(scan_calls(self.plan, text, finished)):
            delta: dict[str, Any] = {"index": index}
            function: dict[str, Any] = {}
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_chars.append(0)
                delta |= {"id": self.ids[index], "type": "function"}
                function["name"] = call.name
            fragment = call.arguments[self.sent_chars[index] :]
            if fragment or "name" in function:
                function["arguments"] = fragment
                self.sent_chars[index] = len(call.arguments)
                out.append(delta | {"function": function})
        return out


def message_calls(plan: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """A finished forced call's `message.tool_calls`; None when the text holds no complete
    call (it was cut short)."""
    calls = scan_calls(plan, text, finished=True)
    if not calls or not all(c.complete for c in calls):
        return None
    return [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]
