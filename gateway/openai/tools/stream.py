"""One choice's output read as content and tool calls, as it streams and once it ends: under a
forced call the whole output is calls (gateway.openai.tools.calls reads them); under tool_choice
"auto", the model's format (gateway.openai.tools.parsers) finds them in free text."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.openai.tools.calls import ToolPlan, scan_calls
from gateway.openai.tools.parsers import ToolFormat


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallStream:
    """One choice's output read as content and calls. Streamed as OpenAI streams them: the
    content as it settles; each call's index, id and name first, then its arguments in
    fragments as they are written. `fmt` is the model's format under tool_choice "auto";
    None for a forced call, whose whole output is calls."""

    plan: ToolPlan
    fmt: ToolFormat | None = None
    ids: list[str] = field(default_factory=list)
    sent_chars: list[int] = field(default_factory=list)
    sent_content: int = 0
    _final: tuple[str, tuple[str | None, list[dict[str, Any]] | None]] | None = None

    def deltas(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool_calls deltas the text holds beyond what was sent."""
        if self.fmt is None:
            content, calls = "", scan_calls(self.plan, text, finished)
        else:
            content, calls, _ = self.fmt.scan(text)
            if finished and not calls:
                content = text  # a held-back partial trigger is content after all
        new_content = content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(content))
        out = []
        for index, call in enumerate(calls):
            delta: dict[str, Any] = {"index": index}
            function: dict[str, Any] = {}
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_chars.append(0)
                delta |= {"id": self.ids[index], "type": "function"}
                function["name"] = call.name
            more = call.arguments[self.sent_chars[index] :]
            if more or "name" in function:
                function["arguments"] = more
                self.sent_chars[index] = len(call.arguments)
                out.append(delta | {"function": function})
        return new_content, out

    def final(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A finished output's `message.content` and `message.tool_calls`; no calls when the
        text holds no whole call (cut short, or a call that does not parse)."""
        if self._final is None or self._final[0] != text:
            self._final = (text, self._read(text))
        return self._final[1]

    def _read(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        if self.fmt is None:
            calls = scan_calls(self.plan, text, finished=True)
            if not calls or not all(c.complete for c in calls):
                return text, None
            content = None
        else:
            content, calls = self.fmt.parse(text)
            if not calls:
                return text, None
        ids = self.ids + [new_call_id() for _ in calls[len(self.ids) :]]
        return content, [
            {
                "id": ids[i],
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for i, c in enumerate(calls)
        ]
