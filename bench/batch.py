"""A batch beside interactive traffic, through the whole gateway: what each costs the other.

    loragate-bench batch [--model models/demo] [--lines 2000] [--prompt-words 24]
        [--output-len 16] [--rate 2] [--interactive-output-len 16] [--duration 20]
        [--max-num-seqs 64] [--batch-max-concurrency 64] [--port 8321] [--seed 0]
        [--rounds 1] [-- extra `loragate serve` flags]

Starts `loragate serve` on the model with a fresh SQLite database, a tenant and its key (the
CLI's `db upgrade`, `tenants create`, `keys create`), then, through the openai SDK:

1. interactive alone: streamed chat completions arriving at `--rate` per second (Poisson) for
   `--duration` seconds; time to first token (request sent to first content chunk);
2. batch alone: a `--lines`-line JSONL file of chat completions uploaded (`/v1/files`), a
   batch created (`/v1/batches`) and polled to `completed`; its output tokens per second
   (the output file's usage, over the time from create to completed);
3. together: the same batch again, and interactive arrivals at the same rate for as long as
   it runs; both measured as above.

`--rounds N` runs the three phases N times on the same server: the table pools them (every
TTFT in one sample, the batches' tokens over their seconds), its caption gives each round's
ratios. A p95 of a hundred requests swings by half between runs here; rounds interleave alone
and beside across the machine's drift.

Every request is greedy with distinct prompts (no prefix-cache hits across requests beyond
the chat template). Goals (issue 45): interactive TTFT p95 beside the batch at most 1.2x
alone; the batch's tok/s beside interactive traffic at least 0.9x alone. The batch's lines run
at `--batch-priority` (the server's), below interactive requests: engine/priority.py.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import json
import operator
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from openai import AsyncOpenAI
from rich.console import Console
from rich.table import Table

from bench.servers import LORAGATE_CLI, spawn, stop, wait_ready
from bench.workloads import new_progress
from kernels import cpu_features

TTFT_GOAL = 1.2  # interactive TTFT p95 beside the batch / alone, at most
THROUGHPUT_GOAL = 0.9  # the batch's tok/s beside interactive traffic / alone, at least
MODEL_NAME = "bench"
WORDS = [
    "river",
    "stone",
    "cloud",
    "lamp",
    "garden",
    "paper",
    "window",
    "silver",
    "orange",
    "market",
    "bridge",
    "candle",
    "forest",
    "winter",
    "letter",
    "harbor",
    "engine",
    "violin",
    "marble",
    "thunder",
    "pocket",
    "meadow",
    "ladder",
    "compass",
]


if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Pooled = TypeVar("Pooled", bound="DataclassInstance")


def _fieldwise_sum(a: Pooled, b: Pooled) -> Pooled:
    """Two measurements as one: each field of `a` plus the same field of `b` (samples
    concatenated, counts and seconds summed)."""
    sums: list[Any] = [getattr(a, f.name) + getattr(b, f.name) for f in fields(a)]
    return type(a)(*sums)


@dataclass(slots=True)
class Interactive:
    ttfts: list[float] = field(default_factory=list)
    num_failed: int = 0
    num_tokens: int = 0

    def percentiles(self) -> tuple[float, float, float] | None:
        """TTFT p50, p95 (the goal's) and p99 (the tail: a stall of the whole gateway)."""
        if not self.ttfts:
            return None
        p50, p95, p99 = np.percentile(self.ttfts, [50, 95, 99])
        return float(p50), float(p95), float(p99)

    def __add__(self, other: Interactive) -> Interactive:
        return _fieldwise_sum(self, other)


@dataclass(slots=True)
class BatchRun:
    seconds: float
    num_tokens: int
    completed: int
    failed: int

    @property
    def tok_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    def __add__(self, other: BatchRun) -> BatchRun:
        return _fieldwise_sum(self, other)


@dataclass(slots=True)
class Round:
    """One round's four measurements: interactive alone and beside, the batch alone and beside."""

    alone: Interactive
    beside: Interactive
    batch_alone: BatchRun
    batch_beside: BatchRun

    def __add__(self, other: Round) -> Round:
        """Both rounds as one: every request's TTFT in one sample, the batches' tokens over
        their seconds."""
        return _fieldwise_sum(self, other)

    @property
    def ratio_ttft(self) -> float | None:
        """TTFT p95 beside over alone."""
        alone, beside = self.alone.percentiles(), self.beside.percentiles()
        return None if alone is None or beside is None else beside[1] / alone[1]

    @property
    def ratio_tok(self) -> float | None:
        """The batch's tok/s beside over alone."""
        alone = self.batch_alone.tok_per_s
        return self.batch_beside.tok_per_s / alone if alone else None


def prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


async def one_chat(client: AsyncOpenAI, text: str, max_tokens: int, into: Interactive) -> None:
    start = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
        )
        first = True
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first:
                    into.ttfts.append(time.perf_counter() - start)
                    first = False
                into.num_tokens += 1
    except Exception:
        into.num_failed += 1


async def arrivals(
    client: AsyncOpenAI,
    args: argparse.Namespace,
    rng: random.Random,
    into: Interactive,
    until: asyncio.Event | float,
) -> None:
    """Poisson arrivals at args.rate until `until` (an event set, or a number of seconds)."""
    loop = asyncio.get_running_loop()
    at = start = loop.time()
    tasks: list[asyncio.Task[None]] = []
    while True:
        at += rng.expovariate(args.rate)
        if isinstance(until, asyncio.Event):
            if until.is_set():
                break
        elif at - start >= until:
            break
        await asyncio.sleep(max(0.0, at - loop.time()))
        text = prompt(rng, args.prompt_words)
        tasks.append(asyncio.create_task(one_chat(client, text, args.interactive_output_len, into)))
    await asyncio.gather(*tasks)


def batch_file(args: argparse.Namespace, rng: random.Random) -> bytes:
    lines = []
    for i in range(args.lines):
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": prompt(rng, args.prompt_words)}],
            "max_tokens": args.output_len,
            "temperature": 0,
        }
        line = {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions"}
        lines.append(json.dumps(line | {"body": body}))
    return ("\n".join(lines) + "\n").encode()


async def run_batch(client: AsyncOpenAI, data: bytes, progress_label: str, progress) -> BatchRun:  # type: ignore[no-untyped-def]
    uploaded = await client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    start = time.perf_counter()
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    bar = progress.add_task(
        progress_label, total=batch.request_counts.total if batch.request_counts else None
    )
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(0.2)
        batch = await client.batches.retrieve(batch.id)
        counts = batch.request_counts
        if counts is not None:
            progress.update(bar, completed=counts.completed + counts.failed, total=counts.total)
    seconds = time.perf_counter() - start
    if batch.status != "completed" or batch.output_file_id is None:
        raise SystemExit(f"the batch ended {batch.status}: {batch.errors}")
    output = (await client.files.content(batch.output_file_id)).text
    tokens = 0
    for line in output.splitlines():
        response = json.loads(line).get("response") or {}
        tokens += (response.get("body") or {}).get("usage", {}).get("completion_tokens", 0)
    counts = batch.request_counts
    assert counts is not None
    return BatchRun(seconds, tokens, counts.completed, counts.failed)


def start_server(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`loragate serve` on a fresh database with one tenant; returns it and the tenant's key."""
    db = f"sqlite+aiosqlite:///{workdir / 'bench.db'}"
    run = lambda *a: subprocess.run(  # noqa: E731
        [LORAGATE_CLI, *a, "--database-url", db], check=True, capture_output=True, text=True
    ).stdout.strip()
    run("db", "upgrade")
    run("tenants", "create", "bench")
    key = run("keys", "create", "bench").splitlines()[-1].split()[-1]
    command = [
        LORAGATE_CLI, "serve", "--model", args.model, "--served-model-name", MODEL_NAME,
        "--port", str(args.port), "--database-url", db, "--no-demo-tenant",
        "--adapter-store", str(workdir / "store"), "--usage-spool-dir", str(workdir / "spool"),
        "--max-num-seqs", str(args.max_num_seqs),
        "--batch-max-concurrency", str(args.batch_max_concurrency),
        *args.serve_args,
    ]  # fmt: skip
    log = workdir / "serve.log"
    proc = spawn(command, log)
    wait_ready(f"http://127.0.0.1:{args.port}", proc, log, path="/health")
    return proc, key


async def measure(args: argparse.Namespace, key: str, console: Console) -> Table:
    client = AsyncOpenAI(
        base_url=f"http://127.0.0.1:{args.port}/v1", api_key=key, max_retries=0, timeout=600
    )
    rng = random.Random(args.seed)
    rounds = []
    with new_progress(console) as progress:
        warm = Interactive()
        await arrivals(client, args, rng, warm, 3.0)  # the paths warmed, nothing timed
        for number in range(1, args.rounds + 1):
            label = f" ({number}/{args.rounds})" if args.rounds > 1 else ""
            rounds.append(await one_round(client, args, rng, progress, label))
    await client.close()
    return report(args, rounds)


async def one_round(  # type: ignore[no-untyped-def]
    client: AsyncOpenAI, args: argparse.Namespace, rng: random.Random, progress, label: str
) -> Round:
    bar = progress.add_task(f"interactive alone{label}", total=None)
    alone = Interactive()
    await arrivals(client, args, rng, alone, args.duration)
    progress.update(bar, total=1, completed=1)
    batch_alone = await run_batch(client, batch_file(args, rng), f"batch alone{label}", progress)
    beside = Interactive()
    done = asyncio.Event()
    traffic = asyncio.create_task(arrivals(client, args, rng, beside, done))
    try:
        batch_beside = await run_batch(
            client, batch_file(args, rng), f"batch + interactive{label}", progress
        )
    finally:
        done.set()
        await traffic
    return Round(alone, beside, batch_alone, batch_beside)


def report(args: argparse.Namespace, rounds: list[Round]) -> Table:
    """The rounds pooled in the table; each round's ratios in its caption."""
    all_rounds = functools.reduce(operator.add, rounds)
    alone, beside = all_rounds.alone, all_rounds.beside
    batch_alone, batch_beside = all_rounds.batch_alone, all_rounds.batch_beside
    ratio_ttft, ratio_tok = all_rounds.ratio_ttft, all_rounds.ratio_tok
    title = (
        f"a batch beside interactive traffic ({Path(args.model).name}; {args.lines} lines of "
        f"{args.output_len} tokens, interactive {args.rate:g}/s of "
        f"{args.interactive_output_len} tokens; max_num_seqs {args.max_num_seqs}; "
        f"{args.rounds} round{'s' if args.rounds > 1 else ''}; "
        f"{cpu_features.describe()})"
    )
    table = Table(title=title)
    for name in (
        "phase",
        "interactive",
        "TTFT p50 s",
        "TTFT p95 s",
        "TTFT p99 s",
        "failed",
        "batch s",
        "batch tok/s",
        "ratio",
    ):
        table.add_column(name, justify="left" if name == "phase" else "right")

    def ttft(run: Interactive) -> tuple[str, ...]:
        found = run.percentiles()
        return ("-",) * 3 if found is None else tuple(f"{p:.3f}" for p in found)

    table.add_row(
        "interactive alone", str(len(alone.ttfts)), *ttft(alone), str(alone.num_failed), "", "", ""
    )
    table.add_row(
        "batch alone",
        "",
        "",
        "",
        "",
        str(batch_alone.failed),
        f"{batch_alone.seconds:.1f}",
        f"{batch_alone.tok_per_s:.0f}",
        "",
    )
    table.add_row(
        "together", str(len(beside.ttfts)), *ttft(beside),
        str(beside.num_failed + batch_beside.failed),
        f"{batch_beside.seconds:.1f}", f"{batch_beside.tok_per_s:.0f}",
        f"TTFT p95 {ratio_ttft:.2f}x, batch {ratio_tok:.2f}x" if ratio_ttft and ratio_tok else "-",
    )  # fmt: skip
    table.caption = verdict(ratio_ttft, ratio_tok)
    if len(rounds) > 1:
        each = ", ".join(
            f"{r.ratio_ttft:.2f}x / {r.ratio_tok:.2f}x" if r.ratio_ttft and r.ratio_tok else "-"
            for r in rounds
        )
        table.caption += f"\neach round, TTFT p95 / batch tok/s beside over alone: {each}"
    return table


def verdict(ratio_ttft: float | None, ratio_tok: float | None) -> str:
    if ratio_ttft is None or ratio_tok is None:
        return "no ratio: a phase measured nothing"
    ttft_ok = "met" if ratio_ttft <= TTFT_GOAL else "MISSED"
    tok_ok = "met" if ratio_tok >= THROUGHPUT_GOAL else "MISSED"
    return (
        f"interactive TTFT p95 beside / alone {ratio_ttft:.2f}x (goal <= {TTFT_GOAL:g}x: "
        f"{ttft_ok}); batch tok/s beside / alone {ratio_tok:.2f}x (goal >= "
        f"{THROUGHPUT_GOAL:g}x: {tok_ok})"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loragate-bench batch",
        description="Interactive TTFT alone and beside a batch; the batch's tok/s alone and "
        "beside interactive traffic; through the gateway's Files and Batch APIs.",
    )
    p.add_argument("--model", default="models/demo", help="checkpoint directory")
    p.add_argument("--lines", type=int, default=2000, help="the batch's requests")
    p.add_argument("--prompt-words", type=int, default=24, help="words per prompt")
    p.add_argument("--output-len", type=int, default=16, help="a batch line's max_tokens")
    p.add_argument("--rate", type=float, default=2.0, help="interactive requests per second")
    p.add_argument("--interactive-output-len", type=int, default=16)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of interactive alone")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--batch-max-concurrency", type=int, default=64)
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="the three phases this many times on one server, pooled (these machines drift: "
        "rounds interleave alone and beside over the drift)",
    )
    p.add_argument("serve_args", nargs="*", help="after --: more `loragate serve` flags")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if not Path(args.model).is_dir():
        raise SystemExit(f"no model at {args.model}: build one with `loragate demo-model`")
    console = Console() if Console().is_terminal else Console(width=160)
    with tempfile.TemporaryDirectory(prefix="loragate-bench-batch-") as tmp:
        proc, key = start_server(args, Path(tmp))
        try:
            table = asyncio.run(measure(args, key, console))
        finally:
            stop(proc)
    console.print(table)


if __name__ == "__main__":
    main()
