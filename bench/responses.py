"""A conversation through the Responses API: per-turn time to first token, continuing from the
stored response (`previous_response_id`) against the client sending the whole history as
`input` each turn (`store: false`), and the bytes each stored turn takes.

    loragate-bench responses --model models/smollm2 [--turns 10] [--output-len 32]

One `loragate serve` (--no-auth, a SQLite database of its own), two conversations of the same
turns one after the other (each its own opening, so neither finds the other's prefix cached).
Both should find their history in the prefix cache (the tenant's salt): the cached tokens per
turn say whether they did; the TTFT columns, what the stored history saves over resending it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from bench.servers import LORAGATE_CLI, spawn, stop, wait_ready
from kernels import cpu_features

WORDS = [
    "river",
    "stone",
    "cloud",
    "lantern",
    "meadow",
    "harbor",
    "violet",
    "ember",
    "glacier",
    "orchard",
]


def user_turn(conversation: int, turn: int, words: int) -> str:
    text = " ".join(WORDS[(conversation * 7 + turn * 3 + i) % len(WORDS)] for i in range(words))
    return f"Conversation {conversation}, turn {turn}: {text}. Answer briefly."


def streamed(client: httpx.Client, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(seconds to the first text delta, the final response object)."""
    start = time.perf_counter()
    ttft, final = None, None
    with client.stream("POST", "/v1/responses", json=body | {"stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - start
            elif event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
    assert ttft is not None and final is not None, "the stream carried no text or no end"
    return ttft, final


def conversation(
    client: httpx.Client, args: argparse.Namespace, index: int, stored: bool
) -> list[dict[str, Any]]:
    rows, previous, history = [], None, []
    for turn in range(args.turns):
        text = user_turn(index, turn, args.input_words)
        body: dict[str, Any] = {
            "model": "demo",
            "max_output_tokens": args.output_len,
            "temperature": 0,
            "ignore_eos": True,
        }
        if stored:
            body |= {"input": text, "previous_response_id": previous}
        else:
            history.append({"role": "user", "content": text})
            body |= {"input": history, "store": False}
        ttft, final = streamed(client, body)
        usage = final["usage"]
        row = {
            "ttft_s": ttft,
            "input_tokens": usage["input_tokens"],
            "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
        }
        if stored:
            previous = final["id"]
            got = client.get(f"/v1/responses/{final['id']}").content
            items = client.get(f"/v1/responses/{final['id']}/input_items").content
            row["stored_bytes"] = len(got) + len(items)
        else:
            history.append(
                {"role": "assistant", "content": final["output"][0]["content"][0]["text"]}
            )
        rows.append(row)
    return rows


def report(runs: dict[str, list[dict[str, Any]]], console: Console) -> None:
    table = Table(title="A conversation through /v1/responses, per turn")
    for column in (
        "turn",
        "input tokens",
        "cached (previous_response_id)",
        "TTFT previous_response_id",
        "cached (whole history)",
        "TTFT whole history",
        "stored bytes",
    ):
        table.add_column(column, justify="right")
    stored, resent = runs["previous_response_id"], runs["whole history"]
    for turn, (a, b) in enumerate(zip(stored, resent, strict=True)):
        table.add_row(
            str(turn + 1),
            f"{a['input_tokens']:,}",
            f"{a['cached_tokens']:,}",
            f"{a['ttft_s'] * 1e3:.0f} ms",
            f"{b['cached_tokens']:,}",
            f"{b['ttft_s'] * 1e3:.0f} ms",
            f"{a['stored_bytes']:,}",
        )
    console.print(table)
    later = slice(1, None)  # the first turn has no history either way
    ratio = statistics.median(r["ttft_s"] for r in stored[later]) / statistics.median(
        r["ttft_s"] for r in resent[later]
    )
    console.print(f"TTFT after turn 1, previous_response_id / whole history: {ratio:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="loragate-bench responses", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--input-words", type=int, default=40)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--port", type=int, default=8040)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    console = Console()
    console.print(f"CPU: {cpu_features.describe()}")
    work = Path(tempfile.mkdtemp(prefix="responses-bench-"))
    url = f"http://127.0.0.1:{args.port}"
    serve = [
        LORAGATE_CLI, "serve", "--model", args.model, "--served-model-name", "demo",
        "--port", str(args.port), "--no-auth", "--dtype", args.dtype,
        "--database-url", f"sqlite+aiosqlite:///{work}/db.sqlite",
        "--adapter-store", str(work / "adapters"),
    ]  # fmt: skip
    process = spawn(serve, work / "serve.log")
    try:
        wait_ready(url, process, work / "serve.log")
        runs = {}
        with httpx.Client(base_url=url, timeout=600) as client:
            for index, (name, stored) in enumerate(
                (("previous_response_id", True), ("whole history", False))
            ):
                runs[name] = conversation(client, args, index, stored)
                console.print(f"{name}: {args.turns} turns")
        report(runs, console)
        if args.json is not None:
            args.json.write_text(json.dumps(runs, indent=2))
    finally:
        stop(process)


if __name__ == "__main__":
    main()
