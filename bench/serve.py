"""Online serving benchmark: a bounded asyncio load generator for any OpenAI-compatible server.

    python -m bench.serve --base-url http://127.0.0.1:8000 --model NAME --workload w1
        [--concurrency 16] [--num-prompts 64] [--output-len 64] [--adapters a,b,c,d]
        [--deadline 600] [--cpu 1] [--json FILE] [--model-dir DIR [--dtype bfloat16]]

Every request is a streamed /v1/completions call with an exact-length token-id
prompt, temperature 0, ignore_eos and max_tokens = output_len, so ours and
vLLM's servers do the same work. Workloads: w1 = 128-token prompts; w2 = w1
behind one shared 1024-token prefix; w3 = w1 round-robin over `--adapters`
(each adapter is a model name); wv = prompt lengths uniform in 32..256; wlong = long
outputs, where streaming itself costs: 16 streams of 32-token prompts x 2,000 tokens, all at
once (its defaults for --num-prompts, --concurrency and --output-len).

With `--model-dir` (the served model's HF directory) the row has MFU: the model FLOPs of
the tokens served (bench.mfu; prompt tokens the server reports as cached excluded) per
second of the run, over the peak a large matmul reaches in `--dtype` on this machine,
measured by this client before the run while the server idles.

The run is bounded twice: by the number of prompts and by a deadline, after
which outstanding requests are cancelled and reported as failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.mfu import ModelFlops, matmul_peak, mfu

WORKLOADS = ("w1", "w2", "w3", "wv", "wlong")
# --num-prompts, --concurrency, --output-len where the flag is not given.
DEFAULTS = {"num_prompts": 64, "concurrency": 16, "output_len": 64}
WORKLOAD_DEFAULTS = {"wlong": {"num_prompts": 16, "concurrency": 16, "output_len": 2000}}
LONG_PROMPT_LEN = 32  # with 2,000 output tokens, within a 2,048-token model (the demo's)


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server read from its prefix cache, if it says
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str = ""


def make_prompts(workload: str, num_prompts: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    low = 100  # clear of special tokens at the bottom of common vocabularies
    if workload == "wv":
        lengths = rng.integers(32, 257, size=num_prompts)
    elif workload == "wlong":
        lengths = np.full(num_prompts, LONG_PROMPT_LEN)
    else:
        lengths = np.full(num_prompts, 128)
    prompts = [rng.integers(low, vocab, size=int(n)).tolist() for n in lengths]
    if workload == "w2":
        prefix = rng.integers(low, vocab, size=1024).tolist()
        prompts = [prefix + p for p in prompts]
    return prompts


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    usage = data["usage"]
                    result.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
                if not data.get("choices") or not data["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens == output_len
        if not result.ok:
            result.error = f"got {result.output_tokens} tokens, wanted {output_len}"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(
    base_url: str,
    models: list[str],
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    deadline: float,
    progress: Progress | None = None,
    api_key: str | None = None,
) -> tuple[list[RequestResult], float]:
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    semaphore = asyncio.Semaphore(concurrency)
    task_id = progress.add_task("requests", total=len(prompts)) if progress else None
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(
        timeout=httpx.Timeout(deadline), limits=limits, headers=headers
    ) as client:

        async def bounded(i: int, prompt: list[int]) -> RequestResult:
            async with semaphore:
                result = await one_request(client, url, models[i % len(models)], prompt, output_len)
            if progress is not None and task_id is not None:
                progress.advance(task_id)
            return result

        start = time.perf_counter()
        tasks = [asyncio.create_task(bounded(i, p)) for i, p in enumerate(prompts)]
        done, pending = await asyncio.wait(tasks, timeout=deadline)
        for task in pending:
            task.cancel()
        elapsed = time.perf_counter() - start
    results = [t.result() for t in done if not t.cancelled()]
    results += [RequestResult(ok=False, prompt_tokens=0, error="deadline") for _ in pending]
    return results, elapsed


def summarize(results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = np.array([r.ttft for r in ok]) if ok else np.zeros(1)
    itls = np.array([x for r in ok for x in r.itls]) if ok else np.zeros(1)
    e2es = np.array([r.e2e for r in ok]) if ok else np.zeros(1)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "elapsed_s": elapsed,
        "output_tok_s": output_tokens / elapsed if elapsed else 0.0,
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p95_s": float(np.percentile(ttfts, 95)),
        "itl_p50_s": float(np.percentile(itls, 50)),
        "itl_p95_s": float(np.percentile(itls, 95)),
        "e2e_p50_s": float(np.percentile(e2es, 50)),
    }


def results_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="online serving: streamed /v1/completions")
    for col in (
        "server",
        "workload",
        "conc",
        "ok/failed",
        "output tok/s",
        "TTFT p50",
        "TTFT p95",
        "ITL p50",
        "ITL p95",
        "E2E p50",
        "MFU",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["label"],
            r["workload"],
            str(r["concurrency"]),
            f"{r['completed']}/{r['failed']}",
            f"{r['output_tok_s']:,.0f}",
            f"{r['ttft_p50_s'] * 1e3:.0f} ms",
            f"{r['ttft_p95_s'] * 1e3:.0f} ms",
            f"{r['itl_p50_s'] * 1e3:.1f} ms",
            f"{r['itl_p95_s'] * 1e3:.1f} ms",
            f"{r['e2e_p50_s']:.2f} s",
            f"{r['mfu']:.1%}" if "mfu" in r else "-",
        )
    return table


def run_serve_bench(
    base_url: str,
    model: str,
    workload: str,
    *,
    concurrency: int = 16,
    num_prompts: int = 64,
    output_len: int = 64,
    adapters: list[str] | None = None,
    vocab: int = 8000,
    seed: int = 0,
    deadline: float = 600.0,
    label: str = "server",
    warmup: int = 4,
    console: Console | None = None,
    api_key: str | None = None,
    model_dir: str | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Drive one workload against one server; returns the summary row. With `model_dir`
    (the served model's HF directory) the row has the run's MFU against a matmul peak in
    `dtype` measured here first, while the server is idle."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}")
    if workload == "w3" and not adapters:
        raise ValueError("w3 needs --adapters")
    console = console or Console()
    models = adapters if workload == "w3" and adapters else [model]
    prompts = make_prompts(workload, num_prompts, vocab, seed)
    columns = (
        TextColumn(f"{label} {workload}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    peak = matmul_peak(getattr(torch, dtype)) if model_dir is not None else 0.0
    with Progress(*columns, console=console, transient=True) as progress:
        # First requests pay one-time costs on either server; other prompts, so they
        # prime no prefix cache.
        if warmup:
            asyncio.run(
                run_load(
                    base_url,
                    models,
                    make_prompts(workload, warmup, vocab, seed + 1),
                    output_len,
                    concurrency,
                    deadline,
                    api_key=api_key,
                )
            )
        results, elapsed = asyncio.run(
            run_load(
                base_url, models, prompts, output_len, concurrency, deadline, progress, api_key
            )
        )
    row = {
        "label": label,
        "workload": workload,
        "concurrency": concurrency,
        "num_prompts": num_prompts,
        "output_len": output_len,
        **summarize(results, elapsed),
    }
    if model_dir is not None:
        from transformers import AutoConfig

        done = [r for r in results if r.ok]
        flops = ModelFlops.from_config(AutoConfig.from_pretrained(model_dir)).run(
            [r.prompt_tokens for r in done], output_len, sum(r.cached_tokens for r in done)
        )
        row |= {"peak_flops": peak, "dtype": dtype, "mfu": mfu(flops, elapsed, peak)}
    if row["failed"]:
        console.print(f"[red]{row['failed']} requests failed: {row['errors']}")
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="loragate-bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", choices=WORKLOADS, default="w1")
    p.add_argument("--concurrency", type=int, default=None, help="default 16")
    p.add_argument("--num-prompts", type=int, default=None, help="default 64 (wlong: 16)")
    p.add_argument("--output-len", type=int, default=None, help="default 64 (wlong: 2000)")
    p.add_argument("--adapters", default="", help="comma-separated adapter names (w3)")
    p.add_argument("--vocab-size", type=int, default=8000, help="prompt ids are drawn below it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=600.0, help="seconds before giving up")
    p.add_argument("--label", default="server")
    p.add_argument("--warmup", type=int, default=4, help="untimed requests sent first")
    p.add_argument("--cpu", type=int, default=None, help="pin this client to one core")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--model-dir",
        default=None,
        help="the served model's HF directory: adds MFU (model FLOPs/s over a matmul peak)",
    )
    p.add_argument("--dtype", default="float32", help="the peak's dtype: the server's")
    p.add_argument(
        "--api-key",
        default=os.environ.get("LORAGATE_API_KEY"),
        help="bearer key (default: $LORAGATE_API_KEY); a vLLM server ignores it",
    )
    args = p.parse_args(argv)
    for name, value in (DEFAULTS | WORKLOAD_DEFAULTS.get(args.workload, {})).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    console = Console(width=max(Console().width, 120))
    row = run_serve_bench(
        args.base_url,
        args.model,
        args.workload,
        concurrency=args.concurrency,
        num_prompts=args.num_prompts,
        output_len=args.output_len,
        adapters=[a for a in args.adapters.split(",") if a],
        vocab=args.vocab_size,
        seed=args.seed,
        deadline=args.deadline,
        label=args.label,
        console=console,
        api_key=args.api_key,
        model_dir=args.model_dir,
        dtype=args.dtype,
    )
    console.print(results_table([row]))
    if args.json is not None:
        args.json.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
