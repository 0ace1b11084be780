"""lora-scale's trace against vLLM-CPU: the same requests over HTTP to `loragate serve` and to
vLLM's OpenAI server, each serving the touched adapters as `--lora-modules`, one server up at
a time.

    loragate-bench lora-scale-vs-vllm --model models/smollm2 [--num-adapters 1000] [--alpha 1]
        [--num-requests 128] [--dtype auto] [--vllm-max-loras 16,64] [--max-loras 64]
        [--lora-memory 2GiB] [--adapters-dir DIR] [--vllm-venv /tmp/peers/vllm-venv]

The trace and the adapter files are lora-scale's (bench/lora_scale_trace.py; the same seed
gives the same requests and weights). Every request is a streamed `/v1/completions` of its
prompt's token ids, greedy with ignore_eos, sent at its arrival time (--rate 0: all at once);
its model is its adapter's name, or the base model's. vLLM runs once per `--vllm-max-loras`
setting (its slots; `--max-cpu-loras` holds every touched adapter), so the table shows its best
one; loragate runs at its own flags. Both read the adapters from disk on their first request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.lora_scale import Catalog, parse_size, prepare_adapters
from bench.lora_scale_trace import Trace, TraceSpec, make_trace
from bench.serve import RequestResult, one_request
from bench.servers import LORAGATE_CLI, spawn, stop, wait_ready
from bench.vs_vllm import PEERS
from bench.workloads import new_progress
from kernels import cpu_features

BASE_NAME = "base"
MAX_MODEL_LEN = 2048


@dataclass(slots=True)
class SideResult:
    side: str
    setting: str
    wall_s: float
    results: list[RequestResult]
    start_s: float  # server start until it answered /v1/models

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.results if r.ok)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.results)

    def ttft(self, q: float) -> float:
        values = [r.ttft for r in self.results if r.ok]
        return float(np.percentile(values, q)) if values else float("nan")

    def as_json(self) -> dict[str, Any]:
        errors = sorted({r.error for r in self.results if not r.ok})[:5]
        return {
            "side": self.side, "setting": self.setting, "wall_s": self.wall_s,
            "output_tokens": self.output_tokens, "tok_s": self.tok_s, "failed": self.failed,
            "ttft_p50_s": self.ttft(50), "ttft_p95_s": self.ttft(95), "start_s": self.start_s,
            "errors": errors,
        }  # fmt: skip


def module_names(trace: Trace, catalog: Catalog) -> list[str | None]:
    """Per request: the served name of its adapter (the adapter's folder), None for the base."""
    return [None if a is None else catalog.paths[a].name for a in trace.adapters]


def lora_module_args(catalog: Catalog) -> list[str]:
    return ["--lora-modules", *(f"{p.name}={p}" for p in catalog.paths.values())]


def loragate_command(args: argparse.Namespace, catalog: Catalog, workdir: Path) -> list[str]:
    command = [
        LORAGATE_CLI, "serve", "--model", args.model, "--served-model-name", BASE_NAME,
        "--port", str(args.port), "--no-auth", "--no-demo-tenant", "--dtype", args.dtype,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--database-url", f"sqlite+aiosqlite:///{workdir}/db.sqlite",
        "--adapter-store", str(workdir / "adapters"),
        "--enable-lora", "--max-lora-rank", str(args.max_lora_rank),
        "--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.max_cpu_loras),
    ]  # fmt: skip
    if args.lora_memory is not None:
        command += ["--lora-memory", str(args.lora_memory)]
    return command + lora_module_args(catalog)


def vllm_command(args: argparse.Namespace, catalog: Catalog, max_loras: int) -> list[str]:
    return [
        f"{args.vllm_venv}/bin/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(Path(args.model).resolve()), "--served-model-name", BASE_NAME,
        "--host", "127.0.0.1", "--port", str(args.port),
        "--max-model-len", str(MAX_MODEL_LEN), "--dtype", args.dtype,
        "--enable-lora", "--max-lora-rank", str(args.max_lora_rank),
        "--max-loras", str(max_loras), "--max-cpu-loras", str(max(max_loras, len(catalog.paths))),
        *args.vllm_args.split(), *lora_module_args(catalog),
    ]  # fmt: skip


async def replay(
    url: str, trace: Trace, models: list[str | None], progress: Progress, label: str
) -> tuple[list[RequestResult], float]:
    """Each request at its arrival; TTFT counts from the arrival."""
    task = progress.add_task(label, total=len(models))
    limits = httpx.Limits(max_connections=len(models), max_keepalive_connections=len(models))
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, trace.arrivals[i] - (time.perf_counter() - start)))
            result = await one_request(
                client, f"{url}/v1/completions", models[i] or BASE_NAME, trace.prompts[i],
                trace.output_lens[i],
            )  # fmt: skip
            progress.advance(task)
            return result

        results = await asyncio.gather(*(one(i) for i in range(len(models))))
        return list(results), time.perf_counter() - start


def run_side(
    side: str,
    setting: str,
    command: list[str],
    args: argparse.Namespace,
    trace: Trace,
    models: list[str | None],
    logs: Path,
    progress: Progress,
    env: dict[str, str] | None = None,
) -> SideResult:
    url = f"http://127.0.0.1:{args.port}"
    log = logs / f"{side}-{setting.replace(' ', '_')}.log"
    task = progress.add_task(f"start {side} {setting}", total=1)
    t0 = time.perf_counter()
    proc = spawn(command, log, env)
    try:
        wait_ready(url, proc, log)
        started = time.perf_counter() - t0
        progress.update(task, completed=1)
        results, wall = asyncio.run(replay(url, trace, models, progress, f"{side} {setting}"))
    finally:
        stop(proc)
    result = SideResult(side, setting, wall, results, started)
    progress.console.print(
        f"{side} {setting}: {result.tok_s:.1f} out tok/s, TTFT p50 {result.ttft(50):.2f} s, "
        f"{result.failed} failed",
        highlight=False,
    )
    return result


def table(runs: list[SideResult]) -> Table:
    t = Table(title="lora-scale over HTTP: loragate and vLLM-CPU on the same trace")
    for col in ("server", "setting", "out tok/s", "vs vLLM's best", "TTFT p50 s", "TTFT p95 s",
                "failed", "server start s"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("server", "setting") else "right")
    vllm = [r.tok_s for r in runs if r.side == "vllm" and r.failed == 0]
    best = max(vllm) if vllm else None
    for r in runs:
        t.add_row(
            r.side, r.setting, f"{r.tok_s:.1f}", f"{r.tok_s / best:.2f}x" if best else "",
            f"{r.ttft(50):.2f}", f"{r.ttft(95):.2f}", str(r.failed), f"{r.start_s:.0f}",
        )  # fmt: skip
    return t


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loragate-bench lora-scale-vs-vllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True)
    p.add_argument("--num-adapters", type=int, default=1000)
    p.add_argument("--ranks", default="8,16,32,64")
    p.add_argument("--tenants", type=int, default=100)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--base-fraction", type=float, default=0.05)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--rate", type=float, default=0.0, help="requests/s, Poisson; 0: all at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adapters-dir", type=Path, default=None, help="the adapter store (reused)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--max-loras", type=int, default=64, help="loragate's")
    p.add_argument("--max-cpu-loras", type=int, default=64, help="loragate's")
    p.add_argument("--lora-memory", default="2GiB", help="loragate's pool")
    p.add_argument("--vllm-max-loras", default="16,64", help="vLLM slot counts to try")
    p.add_argument("--skip-vllm", action="store_true", help="loragate alone (no vLLM here)")
    p.add_argument("--vllm-args", default="", help="more vLLM flags, e.g. '--enforce-eager'")
    p.add_argument("--port", type=int, default=18090)
    p.add_argument("--vllm-venv", default="/tmp/peers/vllm-venv")
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    parse_size(args.lora_memory)  # refuse a bad size before anything starts
    vllm_settings = [int(x) for x in args.vllm_max_loras.split(",") if x.strip()]
    if not args.skip_vllm and not Path(args.vllm_venv, "bin", "python").exists():
        raise SystemExit(f"no vLLM at {args.vllm_venv}: run {PEERS / 'setup_vllm.sh'} first")
    if args.adapters_dir is None:
        args.adapters_dir = Path(tempfile.mkdtemp(prefix="loragate-bench-lora-scale-"))
    console = Console(width=max(Console().width, 130))
    from transformers import AutoConfig, AutoTokenizer

    from adapters.peft import describe_base

    base = describe_base(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ranks = tuple(int(r) for r in args.ranks.split(","))
    spec = TraceSpec(
        num_adapters=args.num_adapters, ranks=ranks, num_tenants=args.tenants,
        num_requests=args.num_requests, alpha=args.alpha, base_fraction=args.base_fraction,
        input_len=(8, args.max_input), output_len=(8, args.max_output),
        max_model_len=MAX_MODEL_LEN, rate=args.rate, seed=args.seed,
    )  # fmt: skip
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    trace = make_trace(spec, vocab, list(tokenizer.all_special_ids))
    logs = Path(tempfile.mkdtemp(prefix="lora-scale-vs-vllm-"))
    console.print(f"{args.model}, --dtype {args.dtype}, {args.num_requests} requests over "
                  f"{len(trace.touched)} of {args.num_adapters} adapters (alpha {args.alpha:g}); "
                  f"logs {logs}; {cpu_features.describe()}", highlight=False)  # fmt: skip
    runs: list[SideResult] = []
    with new_progress(console) as progress:
        catalog = prepare_adapters(args, trace, base, progress)
        models = module_names(trace, catalog)
        workdir = Path(tempfile.mkdtemp(prefix="lora-scale-vs-vllm-db-"))
        ours = f"max_loras {args.max_loras}, lora_memory {args.lora_memory}"
        runs.append(run_side("loragate", ours, loragate_command(args, catalog, workdir), args,
                             trace, models, logs, progress))  # fmt: skip
        if not args.skip_vllm:
            env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                                "VLLM_CPU_KVCACHE_SPACE": "2"}  # fmt: skip
            for max_loras in vllm_settings:
                setting = f"max_loras {max_loras} {args.vllm_args}".strip()
                runs.append(run_side("vllm", setting,
                                     vllm_command(args, catalog, max_loras), args, trace, models,
                                     logs, progress, env))  # fmt: skip
    console.print(table(runs))  # each run's line was printed as it ended (run_side)
    for r in runs:
        if r.failed:
            console.print(f"{r.side} {r.setting}: {r.failed} failed, e.g. {r.as_json()['errors']}")
    if args.json is not None:
        args.json.write_text(json.dumps([r.as_json() for r in runs], indent=2) + "\n")


if __name__ == "__main__":
    main()
