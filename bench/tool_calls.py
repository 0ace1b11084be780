"""Tool calling against any OpenAI-compatible server: do forced calls validate, what does a
forced call cost against plain guided JSON of the same schema, and how soon does the first
tool-call delta come.

    loragate-bench tools --base-url http://127.0.0.1:8000 --model smollm2
        [--api-key KEY] [--samples 24] [--repeats 8] [--json FILE]

1. Validity: `--samples` requests per mode (a named function, "required" with one call,
   "required" with parallel calls), temperature 1 with seeds 0..samples-1, max_tokens 160;
   each call's arguments are checked with jsonschema against its function's schema.
2. Cost: `--repeats` pairs, alternating, of a forced call of `get_weather` and a
   `response_format` json_schema request with the same schema and question, greedy, streamed:
   time to the first delta (a tool-call delta; a content delta), milliseconds per output token
   after it, and the whole request. Medians, and forced / plain as a ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
from rich.console import Console
from rich.table import Table

from bench.workloads import new_progress

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
ADD: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "The sum of two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
QUESTION = "What will the weather be in Lisbon for the next three days, and what is 17 + 25?"
MODES: dict[str, dict[str, Any]] = {
    "named function": {
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    },
    "required, one call": {"tool_choice": "required", "parallel_tool_calls": False},
    "required, parallel": {"tool_choice": "required", "parallel_tool_calls": True},
}


def validity(client: Any, model: str, samples: int, progress: Any) -> dict[str, dict[str, int]]:
    results = {}
    for mode, extra in MODES.items():
        counts = {"requests": 0, "tool_calls": 0, "valid calls": 0, "invalid calls": 0, "length": 0}
        task = progress.add_task(mode, total=samples)
        for seed in range(samples):
            choice = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": QUESTION}],
                tools=[WEATHER, ADD],
                temperature=1.0,
                seed=seed,
                max_tokens=160,
                **extra,
            ).choices[0]
            counts["requests"] += 1
            if choice.finish_reason == "tool_calls":
                counts["tool_calls"] += 1
                for call in choice.message.tool_calls:
                    try:
                        arguments = json.loads(call.function.arguments)
                        jsonschema.validate(arguments, SCHEMAS[call.function.name])
                        counts["valid calls"] += 1
                    except (ValueError, KeyError, jsonschema.ValidationError):
                        counts["invalid calls"] += 1
            elif choice.finish_reason == "length":
                counts["length"] += 1
            progress.advance(task)
        results[mode] = counts
    return results


def timed_stream(client: Any, **kwargs: Any) -> dict[str, float]:
    """Time to the first delta with text or a call, ms per output token after it, total."""
    start = time.perf_counter()
    first = None
    usage = None
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        if first is None and chunk.choices:
            delta = chunk.choices[0].delta
            if delta.tool_calls or delta.content:
                first = time.perf_counter()
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else 0
    first = first or end
    return {
        "first_delta_ms": 1e3 * (first - start),
        "ms_per_token": 1e3 * (end - first) / max(1, tokens - 1),
        "total_ms": 1e3 * (end - start),
        "tokens": tokens,
    }


def cost(client: Any, model: str, repeats: int, progress: Any) -> dict[str, dict[str, float]]:
    common = dict(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=96,
    )
    runs: dict[str, list[dict[str, float]]] = {"forced call": [], "guided JSON": []}
    task = progress.add_task("forced call vs guided JSON", total=repeats)
    for _ in range(repeats):
        runs["forced call"].append(
            timed_stream(client, tools=[WEATHER], **MODES["named function"], **common)
        )
        schema = {"name": "weather", "schema": SCHEMAS["get_weather"], "strict": True}
        runs["guided JSON"].append(
            timed_stream(
                client, response_format={"type": "json_schema", "json_schema": schema}, **common
            )
        )
        progress.advance(task)
    return {
        name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        for name, rows in runs.items()
    }


def report(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"forced tool calls, {result['model']}, temperature 1")
    for column in ("mode", "requests", "ended in calls", "valid calls", "invalid calls", "length"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for mode, c in result["validity"].items():
        table.add_row(
            mode,
            str(c["requests"]),
            str(c["tool_calls"]),
            str(c["valid calls"]),
            str(c["invalid calls"]),
            str(c["length"]),
        )
    console.print(table)
    table = Table(title="a forced call against guided JSON of the same schema (medians, greedy)")
    for column in ("run", "first delta ms", "ms / token", "total ms", "tokens"):
        table.add_column(column, justify="left" if column == "run" else "right")
    rows = result["cost"]
    for name, row in rows.items():
        table.add_row(
            name,
            f"{row['first_delta_ms']:.0f}",
            f"{row['ms_per_token']:.1f}",
            f"{row['total_ms']:.0f}",
            f"{row['tokens']:.0f}",
        )
    forced, plain = rows["forced call"], rows["guided JSON"]
    table.add_row(
        "forced / guided",
        f"{forced['first_delta_ms'] / plain['first_delta_ms']:.2f}x",
        f"{forced['ms_per_token'] / plain['ms_per_token']:.2f}x",
        f"{forced['total_ms'] / plain['total_ms']:.2f}x",
        "",
    )
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="loragate-bench tools", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default="unused")
    p.add_argument("--samples", type=int, default=24, help="requests per forced mode")
    p.add_argument("--repeats", type=int, default=8, help="pairs of the cost comparison")
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = p.parse_args(argv)
    from openai import OpenAI

    client = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key, max_retries=0)
    console = Console()
    with new_progress(console) as progress:
        result = {
            "model": args.model,
            "validity": validity(client, args.model, args.samples, progress),
            "cost": cost(client, args.model, args.repeats, progress),
        }
    report(result, console)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
        console.print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
