"""The tool-call formats models write when they may call tools or answer in text
(`tool_choice` "auto"), by vLLM's `--tool-call-parser` names: how a call looks, the grammar
that holds a call to its tool's schema once the model has started one, and reading calls and
text back out of an output, whole or partial.

- `hermes` (Hermes, Qwen2.5, and the generic prompt of gateway.openai.tools.calls):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call;
- `llama3_json` (Llama 3.1+): `{"name": "f", "parameters": {...}}`, the whole answer, calls
  separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`.

The grammar is an xgrammar structural tag: free text, in which the format's trigger starts a
tag that must name one of the tools and give arguments of its schema. So a call the model
starts always parses and validates; the text around it is the model's. Reading is tolerant
(whitespace, both argument keys): text that does not hold a whole call comes back as content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.openai.tools.calls import CallText, ToolPlan, parameters, value_end

_NAME = r'"(?:[^"\\]|\\.)*"'


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    prefix: str  # a call's text before its JSON object
    suffix: str  # after it
    arguments_key: str  # "arguments" or "parameters"
    trigger: str  # where a call starts
    head: re.Pattern[str]  # a call's start, after what came before, up to its arguments
    tail: re.Pattern[str]  # after one call's arguments: up to where the next may start
    whole_answer: bool = False  # calls only when the answer starts with them (llama3_json)

    def begin(self, name: str) -> str:
        return f'{self.prefix}{{"name": {json.dumps(name)}, "{self.arguments_key}": '

    @property
    def end(self) -> str:
        return "}" + self.suffix

    @property
    def example(self) -> str:
        """A call, as the generic prompt shows it."""
        return (
            f'{self.prefix}{{"name": <the function\'s name>, "{self.arguments_key}": '
            f"<an object of its parameters>}}{self.suffix}"
        )

    def structural_tag(self, plan: ToolPlan) -> dict[str, Any]:
        tags = [
            {
                "type": "tag",
                "begin": self.begin(tool.function.name),
                "content": {"type": "json_schema", "json_schema": parameters(tool)},
                "end": self.end,
            }
            for tool in plan.tools
        ]
        return {
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": [self.trigger],
                "tags": tags,
                "at_least_one": False,
                "stop_after_first": not plan.parallel,
            },
        }

    def render_call(self, name: str, arguments: Any) -> str:
        """A past call, as the model would have written it (generic templates)."""
        call = {"name": name, self.arguments_key: arguments}
        return self.prefix + json.dumps(call, ensure_ascii=False) + self.suffix

    def scan(self, text: str) -> tuple[str, list[CallText], int]:
        """The content before the first call, the calls so far, and how much of the text is
        settled content (a suffix that may still become a trigger is held back)."""
        start = self._first_call(text)
        if start is None:
            settled = len(text) - _partial_suffix(text, self.trigger)
            if self.whole_answer and not text.strip():
                settled = 0
            return text[:settled], [], settled
        calls: list[CallText] = []
        pos = start
        while True:
            head = self.head.match(text, pos)
            if head is None:
                break
            name = json.loads(head.group(1))
            begin = head.end()
            end = value_end(text, begin)
            if end is None:
                calls.append(CallText(name, text[begin:], False))
                break
            tail = self.tail.match(text, end)
            closed = tail is not None and tail.group(0).strip() != ""
            calls.append(CallText(name, text[begin:end], closed))
            if tail is None:
                break
            pos = tail.end()
        return text[:start], calls, start

    def parse(self, text: str) -> tuple[str | None, list[CallText]]:
        """A finished output's content and calls; a call that does not parse whole leaves the
        entire text as content (never an error)."""
        content, calls, start = self.scan(text)
        if not calls:
            return (text or None), []
        if not all(c.complete and _is_json(c.arguments) for c in calls):
            return text, []
        rest = text[start:]
        consumed = _calls_span(self, rest)
        trailing = rest[consumed:].strip() if consumed is not None else ""
        content = (content.strip() + ("\n" + trailing if trailing else "")).strip()
        return (content or None), calls

    def _first_call(self, text: str) -> int | None:
        if self.whole_answer:
            stripped = len(text) - len(text.lstrip())
            return stripped if text[stripped:].startswith(self.trigger) else None
        index = text.find(self.trigger)
        return None if index < 0 else index


def _calls_span(fmt: ToolFormat, text: str) -> int | None:
    pos = 0
    while True:
        head = fmt.head.match(text, pos)
        if head is None:
            return pos
        end = value_end(text, head.end())
        if end is None:
            return None
        tail = fmt.tail.match(text, end)
        if tail is None:
            return None
        pos = tail.end()


def _partial_suffix(text: str, trigger: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of the trigger."""
    for size in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-size:]):
            return size
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


FORMATS = {
    "hermes": ToolFormat(
        name="hermes",
        prefix="<tool_call>\n",
        suffix="\n</tool_call>",
        arguments_key="arguments",
        trigger="<tool_call>",
        head=re.compile(
            rf'\s*(?:<tool_call>)?\s*\{{\s*"name"\s*:\s*({_NAME})\s*,\s*"arguments"\s*:\s*'
        ),
        tail=re.compile(r"\s*\}\s*</tool_call>\s*"),
    ),
    "llama3_json": ToolFormat(
        name="llama3_json",
        prefix="",
        suffix="",
        arguments_key="parameters",
        trigger='{"name": ',
        head=re.compile(
            rf'\s*\{{\s*"name"\s*:\s*({_NAME})\s*,\s*"(?:parameters|arguments)"\s*:\s*'
        ),
        tail=re.compile(r"\s*\}\s*;?\s*"),
        whole_answer=True,
    ),
    "mistral": ToolFormat(
        name="mistral",
        prefix="[TOOL_CALLS][",
        suffix="]",
        arguments_key="arguments",
        trigger="[TOOL_CALLS]",
        head=re.compile(
            rf'\s*(?:\[TOOL_CALLS\]\s*\[|,)?\s*\{{\s*"name"\s*:\s*({_NAME})\s*,'
            r'\s*"arguments"\s*:\s*'
        ),
        tail=re.compile(r"\s*\}\s*(?:\]\s*)?"),
    ),
}
