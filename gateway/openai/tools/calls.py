"""OpenAI tool calling: what a request's tools ask of the output, and the calls read back out
of the text, whole or as it streams.

A forced call (`tool_choice` "required" or naming a function) is guided decoding: the output
must be, for a named function, its arguments (a document of its `parameters` schema), and for
"required" a JSON array of `{"name": ..., "parameters": ...}` objects, one per call (exactly
one when `parallel_tool_calls` is false), each `parameters` a document of its function's
schema. So every forced call parses and its arguments validate, on any model. The text is
compact JSON with keys in the schema's order, which is what lets `scan_calls` read the calls
out of a partial text while it streams.

Under tool_choice "auto" the output is free text in the model's own call format
(gateway.openai.tools.parsers); gateway.openai.tools.prompt puts the tools into the prompt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.request import GuidedSpec
from gateway.openai.protocol import ChatCompletionRequest, FieldError, Tool

# The schema of a function that declares no parameters.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools ask of its output."""

    tools: tuple[Tool, ...]
    mode: str  # "none" (text), "auto" (text or calls), "named" or "required" (forced)
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("named", "required")

    def output_spec(self) -> GuidedSpec:
        """The grammar a forced call's output follows."""
        assert self.forced
        strict = all(t.function.strict is not False for t in self.tools)
        if self.mode == "named":
            return GuidedSpec(json_schema=parameters(self._tool(self.name)), strict=strict)
        return GuidedSpec(json_schema=self._calls_schema(), strict=strict)

    def tool_specs(self) -> list[tuple[GuidedSpec, str]]:
        """Each function's own schema and the field it came from, compiled before the output's
        grammar so that a bad one is refused naming its tool."""
        return [
            (GuidedSpec(json_schema=parameters(tool)), f"tools[{i}].function.parameters")
            for i, tool in enumerate(self.tools)
            if self.mode != "named" or tool.function.name == self.name
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


def tool_plan(body: ChatCompletionRequest, auto_parser: str | None) -> ToolPlan | None:
    """The request's tool plan; None when it has no tools. `auto_parser`: the format in which
    the server reads calls out of free text (--enable-auto-tool-choice --tool-call-parser);
    None: tool_choice "auto" is refused. Raises FieldError (HTTP 400)."""
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
    if choice == "none":
        return ToolPlan(tuple(body.tools), "none")
    if choice in (None, "auto") and auto_parser is None:
        raise FieldError(
            "tool_choice",
            'tool_choice "auto" (the default with tools) needs the server started with '
            '--enable-auto-tool-choice and a --tool-call-parser; or send "required", '
            '{"type": "function", "function": {"name": ...}}, or "none"',
        )
    if body.guided_param is not None:
        raise FieldError(
            body.guided_param,
            f"{body.guided_param} and tool calls both constrain the output; send one",
        )
    if choice in (None, "auto"):
        return ToolPlan(tuple(body.tools), "auto", parallel=body.parallel_tool_calls)
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
    if plan.mode == "named":
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
        end = value_end(text, start)
        if end is None:
            calls.append(CallText(name, text[start:], False))
            break
        calls.append(CallText(name, text[start:end], True))
        pos = end + 1  # the call's closing brace
        if text[pos : pos + 1] != ",":
            break
        pos += 1
    return calls


def value_end(text: str, start: int) -> int | None:
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
