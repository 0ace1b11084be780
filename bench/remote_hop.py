"""The remote hop: W1 through a gateway whose engine is a `loragate engine` on loopback (over the
WebSocket link, and one HTTP request per request as behind an inference gateway), against the
same gateway with its engine process beside it, in one run.

    loragate-bench remote-hop --model models/demo [--rounds 3] [--num-prompts 64]
        [--concurrency 16] [--output-len 64] [--engine-args "--no-engine-process"]

Each round starts one setup at a time (the order swapped every round), drives W1 with
`bench serve` (streamed /v1/completions, 128-token prompts, ignore_eos) and stops it:

  local   loragate serve --model M                     gateway ── pipe ── engine process
  remote  loragate engine --model M; loragate serve --models-config (urls: that engine)
                                                        gateway ── WebSocket ── engine
  picker  the same, with `routing: picker`              gateway ── a POST per request ── engine
          (what the gateway pays in front of an inference gateway; the inference gateway's own
          proxy and picker are the cluster's, not measured here)

The table gives each run, the medians and each against local. Every run has its own prompt seed,
so no run finds its prompts cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.serve import run_serve_bench
from bench.servers import LORAGATE_CLI, spawn, stop, wait_ready
from kernels import cpu_features

SIDES = ("local", "remote", "picker")


def run_side(side: str, args: argparse.Namespace, seed: int, console: Console) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"remote-hop-{side}-"))
    gateway_url = f"http://127.0.0.1:{args.port}"
    serve = [
        LORAGATE_CLI, "serve", "--port", str(args.port), "--no-auth",
        "--database-url", f"sqlite+aiosqlite:///{work}/db.sqlite",
        "--adapter-store", str(work / "adapters"), "--dtype", args.dtype,
    ]  # fmt: skip
    processes = []
    try:
        if side in ("remote", "picker"):
            engine_url = f"http://127.0.0.1:{args.port + 1}"
            engine = [
                LORAGATE_CLI, "engine", "--model", args.model, "--port", str(args.port + 1),
                "--adapter-store", str(work / "adapters"), "--dtype", args.dtype,
                *args.engine_args.split(),
            ]  # fmt: skip
            processes.append(spawn(engine, work / "engine.log"))
            wait_ready(engine_url, processes[-1], work / "engine.log", path="/health")
            models = work / "models.yaml"
            entry = {"name": "demo", "path": args.model, "urls": [engine_url]}
            if side == "picker":
                entry["routing"] = "picker"
            models.write_text(json.dumps({"models": [entry]}))  # JSON is YAML
            serve += ["--models-config", str(models)]
        else:
            serve += ["--model", args.model, "--served-model-name", "demo"]
        processes.append(spawn(serve, work / "serve.log"))
        wait_ready(gateway_url, processes[-1], work / "serve.log")
        return run_serve_bench(
            gateway_url,
            "demo",
            "w1",
            concurrency=args.concurrency,
            num_prompts=args.num_prompts,
            output_len=args.output_len,
            seed=seed,
            label=side,
            console=console,
        )
    finally:
        for process in reversed(processes):
            stop(process)


def report(runs: dict[str, list[dict[str, Any]]], console: Console) -> None:
    table = Table(title="W1 through a gateway: engine process beside it vs `loragate engine`")
    sides = [side for side in SIDES if runs.get(side)]
    for column in ("setup", "output tok/s (runs)", "median", "TTFT p50", "ITL p50", "failed"):
        table.add_column(column, justify="right")
    medians = {}
    for side in sides:
        rows = runs[side]
        medians[side] = statistics.median(r["output_tok_s"] for r in rows)
        table.add_row(
            side,
            " ".join(f"{r['output_tok_s']:,.0f}" for r in rows),
            f"{medians[side]:,.0f}",
            f"{statistics.median(r['ttft_p50_s'] for r in rows) * 1e3:.0f} ms",
            f"{statistics.median(r['itl_p50_s'] for r in rows) * 1e3:.1f} ms",
            str(sum(r["failed"] for r in rows)),
        )
    console.print(table)
    for side in sides:
        if side != "local" and "local" in medians:
            ratio = medians[side] / medians["local"]
            console.print(f"{side} / local output tok/s: {ratio:.3f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="loragate-bench remote-hop", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="models/demo")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--port", type=int, default=8030, help="the gateway's; the engine's is +1")
    p.add_argument("--engine-args", default="", help="more flags for `loragate engine`")
    p.add_argument("--sides", default=",".join(SIDES), help="which of local,remote,picker to run")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    sides = tuple(side for side in SIDES if side in args.sides.split(","))
    console = Console()
    console.print(f"CPU: {cpu_features.describe()}")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for round_index in range(args.rounds):
        order = sides if round_index % 2 == 0 else sides[::-1]
        for side in order:
            row = run_side(side, args, seed=100 + round_index, console=console)
            console.print(f"round {round_index + 1} {side}: {row['output_tok_s']:,.0f} tok/s")
            runs[side].append(row)
    report(runs, console)
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
