"""Cold starts as a client sees them: `loragate serve` with a models file of models at zero,
request to first token in the scenarios that decide whether serverless feels instant.

    loragate-bench coldstart --gateway --model models/smollm2 [--rounds 5] [--dtype auto]
        [--spare-engines 1] [--settle 3] [--no-baseline] [--json FILE]

Each round starts a fresh gateway (`--no-auth`) whose models file lists the model under eight
names, each `min_replicas: 0`, plus one `min_replicas: 1, max_replicas: 2` for scale-up, and
times, with streamed `/v1/completions` (greedy, one short prompt, a few tokens):

  right after start  the first request, sent as soon as /health answers
  first              a model woken once the gateway has settled (its zygote and spare ready)
  2 s later          another model, two seconds after the first was answered
  4 at once (each)   four models, one request each, sent together: the slowest of the four
  burst of 8 (last)  eight requests to one cold model sent together: the last one's first token
  scale-up           from six long requests queueing on the always-on model (max_num_seqs 2)
                     to the second replica ready (its `loragate:engine_replicas` at 2)

Every round also runs with `--no-zygote` (every engine spawned, the baseline in the same run;
the two take turns). Reported per scenario: the median over rounds and the worst, the goals
(< 1 s; the burst's last within 1.5 s of `first`), the baseline's median and the ratio, and the
zygote's memory (RSS, PSS) from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
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

LAZY = [f"m{i}" for i in range(8)]  # models at zero, one per scenario's need
BUSY = "busy"  # min 1, max 2: scale-up
PROMPT = "The capital of France is"
SCENARIOS = (
    "right after start",
    "first",
    "2 s later",
    "4 at once (each)",
    "burst of 8 (last)",
    "scale-up",
)
GOAL_S = 1.0
BURST_MARGIN_S = 1.5


def models_file(args: argparse.Namespace, directory: Path) -> Path:
    engine = f"{{dtype: {args.dtype}, kv_cache_memory: 64MiB, max_model_len: 512}}"
    lines = ["models:"]
    for name in LAZY:
        lines.append(
            f"  - {{name: {name}, path: {args.model}, min_replicas: 0, idle_timeout: 600, "
            f"engine: {engine}}}"
        )
    busy = f"{{dtype: {args.dtype}, kv_cache_memory: 64MiB, max_model_len: 512, max_num_seqs: 2}}"
    lines.append(
        f"  - {{name: {BUSY}, path: {args.model}, min_replicas: 1, max_replicas: 2, "
        f"idle_timeout: 600, scale_up_waiting: 1, scale_up_window: 0.5, engine: {busy}}}"
    )
    path = directory / "models.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


async def first_token(
    client: httpx.AsyncClient, url: str, model: str, max_tokens: int = 4
) -> float:
    """Seconds from sending to the first streamed text."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    sent = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {resp.status_code} {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    first = time.perf_counter() - sent
    if first is None:
        raise RuntimeError(f"{model}: no token")
    return first


def replicas(url: str, model: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'loragate:engine_replicas{{model="{model}"}}'):
            return float(line.split()[-1])
    return 0.0


async def scale_up_seconds(client: httpx.AsyncClient, url: str) -> float:
    """From six long requests at the always-on model to its second replica ready."""
    sent = time.perf_counter()
    long = [asyncio.create_task(first_token(client, url, BUSY, max_tokens=400)) for _ in range(6)]
    try:
        while replicas(url, BUSY) < 2:
            if time.perf_counter() - sent > 120:
                raise RuntimeError("no second replica within 120 s")
            await asyncio.sleep(0.02)
        return time.perf_counter() - sent
    finally:
        await asyncio.gather(*long, return_exceptions=True)


async def one_round(url: str, settle: float) -> dict[str, float]:
    times: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        times["right after start"] = await first_token(client, url, LAZY[0])
        await asyncio.sleep(settle)  # the zygote's refill, the spare's
        times["first"] = await first_token(client, url, LAZY[1])
        await asyncio.sleep(2.0)
        times["2 s later"] = await first_token(client, url, LAZY[2])
        await asyncio.sleep(settle)
        four = await asyncio.gather(*(first_token(client, url, m) for m in LAZY[3:7]))
        times["4 at once (each)"] = max(four)
        await asyncio.sleep(settle)
        burst = await asyncio.gather(*(first_token(client, url, LAZY[7]) for _ in range(8)))
        times["burst of 8 (last)"] = max(burst)
        await asyncio.sleep(settle)
        times["scale-up"] = await scale_up_seconds(client, url)
    return times


def zygote_memory(server_pid: int) -> dict[str, int]:
    """RSS and PSS of the gateway's zygote (its forkserver child), bytes; {} without one."""
    tasks = Path(f"/proc/{server_pid}/task")
    for task in tasks.iterdir():
        for child in (task / "children").read_text().split():
            if "forkserver" in Path(f"/proc/{child}/cmdline").read_text(errors="replace"):
                sizes = {}
                for line in Path(f"/proc/{child}/smaps_rollup").read_text().splitlines():
                    name, _, value = line.partition(":")
                    if name in ("Rss", "Pss"):
                        sizes[name.lower()] = int(value.split()[0]) * 1024
                return sizes
    return {}


MODES = {"zygote": "--zygote", "spawn": "--no-zygote"}  # the baseline: every engine spawned


def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Rounds of every scenario, each round in each mode (taking turns, a fresh gateway each)."""
    modes = list(MODES) if args.baseline else ["zygote"]
    rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    memory: dict[str, int] = {}
    for i in range(args.rounds):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            work = Path(tempfile.mkdtemp(prefix="coldstart-gateway-"))
            url = f"http://127.0.0.1:{args.port}"
            command = [
                LORAGATE_CLI, "serve", "--models-config", str(models_file(args, work)),
                "--port", str(args.port), "--no-auth", "--no-demo-tenant",
                "--database-url", f"sqlite+aiosqlite:///{work}/db.sqlite",
                "--spare-engines", str(args.spare_engines), MODES[mode],
            ]  # fmt: skip
            log = work / "serve.log"
            proc = spawn(command, log)
            try:
                wait_ready(url, proc, log, "/health")
                times = asyncio.run(one_round(url, args.settle))
                if mode == "zygote":
                    memory = memory or zygote_memory(proc.pid)
            finally:
                stop(proc)
            rounds[mode].append(times)
            cells = ", ".join(f"{k} {v:.2f}" for k, v in times.items())
            console.print(f"  round {i + 1}/{args.rounds}, {mode}: {cells} s", highlight=False)
    return {"model": str(args.model), "rounds": rounds, "zygote_memory": memory}


def report(result: dict[str, Any], console: Console) -> None:
    rounds = result["rounds"]
    ours = rounds["zygote"]
    first = statistics.median(r["first"] for r in ours)
    table = Table(title=f"cold starts through the gateway, {result['model']}: {len(ours)} rounds")
    columns = ["scenario", "zygote median s", "worst s", "goal", "met"]
    if "spawn" in rounds:
        columns += ["spawned median s", "spawned / zygote"]
    for col in columns:
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for name in SCENARIOS:
        values = [r[name] for r in ours]
        med, worst = statistics.median(values), max(values)
        if name == "scale-up":
            goal, met = "", ""
        elif name == "burst of 8 (last)":
            goal = f"< first + {BURST_MARGIN_S:g}"
            met = "yes" if med < first + BURST_MARGIN_S else "no"
        else:
            goal, met = f"< {GOAL_S:g}", "yes" if med < GOAL_S else "no"
        row = [name, f"{med:.2f}", f"{worst:.2f}", goal, met]
        if "spawn" in rounds:
            base = statistics.median(r[name] for r in rounds["spawn"])
            row += [f"{base:.2f}", f"{base / med:.1f}x"]
        table.add_row(*row)
    console.print(table)
    memory = result["zygote_memory"]
    if memory:
        console.print(
            f"the zygote: {memory['rss'] / 2**20:.0f} MiB RSS, {memory['pss'] / 2**20:.0f} MiB PSS"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--gateway: through `loragate serve` with models at zero")
    g.add_argument("--spare-engines", type=int, default=1)
    g.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="leave out the rounds with every engine spawned (--no-zygote)",
    )
    g.add_argument("--settle", type=float, default=3.0, help="seconds between scenarios")
    g.add_argument("--port", type=int, default=18095)


def main(args: argparse.Namespace) -> None:
    console = Console(width=max(Console().width, 120))
    console.print(
        f"cold starts through the gateway: {args.model} under {len(LAZY)} names at zero, "
        f"--spare-engines {args.spare_engines}, against every engine spawned: "
        f"{'yes' if args.baseline else 'no'}; "
        f"{cpu_features.describe()}",
        highlight=False,
    )
    result = measure(args, console)
    report(result, console)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
