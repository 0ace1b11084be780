"""The Open Responses compliance run against any server: the seven request templates of the
Open Responses project's compliance suite (spec 2026-04-24), each answer validated against the
spec's ResponseResource and, streamed, every event against the spec's type for it, then the
template's own checks (output present, status completed, a function call where tools ask).

    loragate-bench open-responses --base-url http://127.0.0.1:8000 --model smollm2
        [--api-key KEY] [--json FILE]

The templates are restated here from the suite's descriptions (the suite itself is
TypeScript, run with bun, which this machine lacks): a basic response, a streamed one, a
system prompt, a function tool (plain and streamed), an image input, and a multi-turn
conversation. A text-only model refuses the image with a 400, as it should; the table says so.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from bench.open_responses_spec import response_violations, sse_violations

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a location",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {
                "type": "string",
                "description": "The city and state, e.g. San Francisco, CA",
            }
        },
        "required": ["location"],
    },
}
# A 1x1 PNG: what the image is does not matter, only that the server answers for it.
PIXEL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
    "z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


Check = Callable[[dict[str, Any], list[dict[str, Any]]], list[str]]


def has_output(response: dict[str, Any], _: list[dict[str, Any]]) -> list[str]:
    return [] if response.get("output") else ["the response has no output items"]


def completed(response: dict[str, Any], _: list[dict[str, Any]]) -> list[str]:
    status = response.get("status")
    return [] if status == "completed" else [f"status {status!r}, not 'completed'"]


def has_call(response: dict[str, Any], _: list[dict[str, Any]]) -> list[str]:
    kinds = [item.get("type") for item in response.get("output") or ()]
    return [] if "function_call" in kinds else [f"no function_call among {kinds}"]


def streamed_call(_: dict[str, Any], events: list[dict[str, Any]]) -> list[str]:
    def item_event(kind: str) -> bool:
        return any(
            e["type"] == kind and (e.get("item") or {}).get("type") == "function_call"
            for e in events
        )

    kinds = {e["type"] for e in events}
    missing = [
        name
        for name, present in (
            ("output_item.added with a function_call", item_event("response.output_item.added")),
            (
                "function_call_arguments.delta",
                "response.function_call_arguments.delta" in kinds,
            ),
            ("function_call_arguments.done", "response.function_call_arguments.done" in kinds),
            ("output_item.done with a function_call", item_event("response.output_item.done")),
        )
        if not present
    ]
    return [f"no {name} event" for name in missing]


@dataclass(frozen=True, slots=True)
class Template:
    id: str
    body: dict[str, Any]
    checks: tuple[Check, ...]
    stream: bool = False


TEMPLATES = (
    Template(
        "basic-response",
        {"input": [_user("Say hello in exactly 3 words.")]},
        (has_output, completed),
    ),
    Template(
        "streaming-response",
        {"input": [_user("Count from 1 to 5.")]},
        (completed,),
        stream=True,
    ),
    Template(
        "system-prompt",
        {
            "input": [
                {
                    "type": "message",
                    "role": "system",
                    "content": "You are a pirate. Always respond in pirate speak.",
                },
                _user("Say hello."),
            ]
        },
        (has_output, completed),
    ),
    Template(
        "tool-calling",
        {"input": [_user("What's the weather like in San Francisco?")], "tools": [WEATHER_TOOL]},
        (has_output, has_call),
    ),
    Template(
        "tool-calling-streaming",
        {"input": [_user("What's the weather like in San Francisco?")], "tools": [WEATHER_TOOL]},
        (streamed_call,),
        stream=True,
    ),
    Template(
        "image-input",
        {
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {
                            "type": "input_text",
                            "text": "What do you see in this image? Answer in one sentence.",
                        },
                        {"type": "input_image", "image_url": PIXEL},
                    ],
                }
            ]
        },
        (has_output, completed),
    ),
    Template(
        "multi-turn",
        {
            "input": [
                _user("My name is Alice."),
                {
                    "type": "message",
                    "role": "assistant",
                    "content": "Hello Alice! Nice to meet you. How can I help you today?",
                },
                _user("What is my name?"),
            ]
        },
        (has_output, completed),
    ),
)


@dataclass(slots=True)
class Outcome:
    id: str
    status: int = 0
    seconds: float = 0.0
    events: int | None = None
    errors: list[str] = field(default_factory=list)
    text: str = ""

    @property
    def passed(self) -> bool:
        return self.status == 200 and not self.errors


def run(client: httpx.Client, model: str, template: Template) -> Outcome:
    outcome = Outcome(template.id)
    body = {"model": model, **template.body, "stream": template.stream}
    start = time.perf_counter()
    answer = client.post("/v1/responses", json=body)
    outcome.seconds = time.perf_counter() - start
    outcome.status = answer.status_code
    if answer.status_code != 200:
        outcome.errors = [f"HTTP {answer.status_code}: {answer.text[:200]}"]
        return outcome
    events: list[dict[str, Any]] = []
    if template.stream:
        outcome.errors += sse_violations(answer.text)
        events = [
            json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")
        ]
        outcome.events = len(events)
        finals = [e["response"] for e in events if "response" in e]
        response = finals[-1] if finals else {}
    else:
        response = answer.json()
    outcome.errors += response_violations(response)
    for check in template.checks:
        outcome.errors += check(response, events)
    outcome.text = _output_text(response)
    return outcome


def _output_text(response: dict[str, Any]) -> str:
    parts = []
    for item in response.get("output") or ():
        if item.get("type") == "function_call":
            parts.append(f"{item.get('name')}({item.get('arguments')})")
        for part in item.get("content") or ():
            parts.append(part.get("text", ""))
    return " ".join(parts)


def report(outcomes: list[Outcome], console: Console) -> None:
    table = Table(title="Open Responses compliance (spec 2026-04-24)")
    for column in ("template", "result", "HTTP", "seconds", "events", "output / first error"):
        table.add_column(column)
    for o in outcomes:
        detail = o.errors[0] if o.errors else o.text
        table.add_row(
            o.id,
            "pass" if o.passed else "FAIL",
            str(o.status),
            f"{o.seconds:.2f}",
            "" if o.events is None else str(o.events),
            detail[:90],
        )
    console.print(table)
    passed = sum(o.passed for o in outcomes)
    console.print(f"{passed} of {len(outcomes)} templates pass")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="loragate-bench open-responses", description=__doc__.split("\n")[0]
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default="unused")
    p.add_argument("--json", type=Path, default=None, help="write the outcomes to this file")
    args = p.parse_args(argv)
    console = Console()
    headers = {"Authorization": f"Bearer {args.api_key}"}
    outcomes = []
    with httpx.Client(base_url=args.base_url, headers=headers, timeout=300) as client:
        for template in TEMPLATES:
            console.print(f"[dim]{template.id} ...[/dim]")
            outcomes.append(run(client, args.model, template))
    report(outcomes, console)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2))
        console.print(f"outcomes written to {args.json}")


if __name__ == "__main__":
    main()
