"""Cold start: a model's engine started from nothing, to its first token, phase by phase.

    loragate-bench coldstart --model models/smollm2 [--rounds 5] [--dtype auto]
        [--adapter DIR] [--spare] [--zygote] [--json FILE]
    loragate-bench coldstart --gateway ...   (bench/coldstart_gateway.py: through the gateway)

Each round does what the gateway does for a model that scales to zero (min_replicas 0,
gateway/models/on_demand.py): spawn the engine process (engine/frontend/engine_process.py), wait
until it reports ready, send one request and wait for its first token, stop it. One untimed round
first puts the weights in the page cache, as they are on a machine that served the model before.
With `--adapter`, the first request names that adapter, not yet loaded: its load is part of the
first token. With `--spare`, each round is run twice: as above, then in a warm spare
(engine/frontend/warm_spare.py) the gateway started ahead, ready before the round begins, as in a
gateway that has run a while; the pool starts its next spare during the timed part, as the gateway's
does. With `--zygote`, each round is also run forked from a zygote (engine/frontend/zygote.py)
started before the rounds, as the gateway's is; the report adds the zygote's memory (RSS, and PSS:
its share of pages its children also map).

Phases, median over the rounds:
  process    spawn, the interpreter, the imports (torch, transformers, the engine); in a
             spare, the handover (its start arguments sent and read); from a zygote, the
             fork and the start arguments read
  tokenizer  the engine's tokenizer and config
  setup      device, dtype, the checkpoint's tensor names
  kernels    the C++ kernels loaded (built once per machine, then cached on disk)
  model      the module tree allocated
  weights    mapped from the weights cache (engine/checkpoints/weights_cache.py; the untimed
             round wrote it), or with --weights-cache-dir none, the safetensors read and
             copied in (and cast to the compute dtype)
  prepack    without the cache: the weights reordered for oneDNN's linear
  cache      the cache file written (a round whose file was missing or stale)
  kv         the KV pool allocated
  rest       the scheduler, the grammar cache, the log line
  gateway    what the gateway does before it calls the engine ready: the grammar cache, the
             pipe (it read the model's tokenizer when it started)
  first token  request sent to first token: the first step, and the adapter's load

The weights phase is compared with `cat` on the same files (reading them from the page cache
and nothing else), in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from adapters.peft import describe_base
from adapters.registry import RegisteredLoader, inspect_adapter
from bench import coldstart_gateway
from engine.checkpoints.weights_cache import weights_cache_at
from engine.config import EngineConfig
from engine.frontend.engine_process import EngineProcess, ProcessStart
from engine.frontend.warm_spare import SparePool, start_heap_bytes
from engine.frontend.zygote import Zygote
from engine.lora.types import LoRARequest
from engine.messages import EngineRequest
from engine.request import SamplingParams
from gateway.settings import parse_bytes

PHASES = (
    "process",
    "tokenizer",
    "setup",
    "kernels",
    "model",
    "weights",
    "prepack",
    "cache",
    "kv",
    "rest",
    "gateway",
    "first token",
)
PROMPT = [1, 504, 3458, 314, 260, 1458, 30]  # a few tokens: the first step, not a long prefill
SPARE_READY_TIMEOUT = 300.0  # seconds for a spare to import torch (the first one may build kernels)


def one_cold_start(
    config: EngineConfig,
    adapter: Path | None,
    spares: SparePool | None = None,
    zygote: Zygote | None = None,
) -> dict[str, float]:
    """Seconds per phase of one engine started from nothing (or in a spare of `spares`, or
    forked from `zygote`) to its first token."""
    loader = None
    lora = None
    if adapter is not None:
        loader = RegisteredLoader(describe_base(config.model), config.max_lora_rank)
        info = inspect_adapter(adapter, describe_base(config.model), config.max_lora_rank)
        lora = LoRARequest("cold", str(adapter), info.adapter_id)
    # The gateway read the tokenizer when it started (EngineFacts.read) and hands it over.
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    started = time.perf_counter()
    process = EngineProcess(
        config,
        start=ProcessStart(loader, (), spares, zygote),
        restart=None,
        tokenizer=tokenizer,
    )
    process.start()
    ready = time.perf_counter()
    phases = dict(process.load_seconds)
    phases["gateway"] = max(0.0, ready - started - sum(phases.values()))
    try:
        phases["first token"] = asyncio.run(_first_token(process, lora))
    finally:
        asyncio.run(process.shutdown(0))
    return phases


async def _first_token(process: EngineProcess, lora: LoRARequest | None) -> float:
    params = SamplingParams(temperature=0, max_tokens=1)
    sent = time.perf_counter()
    async for update in process.generate(EngineRequest("cold", PROMPT, params, lora=lora)):
        if update.new_token_ids:
            return time.perf_counter() - sent
    raise RuntimeError("the request ended without a token")


def cat_seconds(model: Path) -> tuple[float, int]:
    """Seconds `cat` takes to read the checkpoint's weights (best of three), and their bytes."""
    files = sorted(model.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
        best = min(best, time.perf_counter() - start)
    return best, size


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loragate-bench coldstart", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("models/smollm2"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes")
    p.add_argument("--adapter", type=Path, default=None, help="the first request's adapter")
    p.add_argument(
        "--spare", action="store_true", help="each round also in a warm spare engine process"
    )
    p.add_argument(
        "--spare-memory",
        default="auto",
        help="heap the spare faults in ahead: auto (as the gateway sizes it), a size, or 0",
    )
    p.add_argument("--zygote", action="store_true", help="each round also forked from a zygote")
    p.add_argument(
        "--weights-cache-dir",
        default="auto",
        help="the engine's weights cache: auto, a directory, or none (load the checkpoint)",
    )
    p.add_argument(
        "--gateway",
        action="store_true",
        help="through `loragate serve` with models at zero (bench/coldstart_gateway.py)",
    )
    p.add_argument("--json", type=Path, default=None)
    coldstart_gateway.add_arguments(p)
    return p


def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(
        model=str(args.model),
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=512,
        enable_lora=args.adapter is not None,
        weights_cache_dir=args.weights_cache_dir,
    )
    console = Console(stderr=True)
    console.print(f"cold start of {args.model}: 1 untimed round, then {args.rounds}")
    result: dict[str, Any] = {"model": str(args.model), "weights_cache": args.weights_cache_dir}
    zygote = None
    if args.zygote:
        zygote = Zygote([config.model])
        zygote.start()
    pool = None
    if args.spare:
        heap_bytes = (
            start_heap_bytes(config)
            if args.spare_memory == "auto"
            else parse_bytes(args.spare_memory)
        )
        pool = SparePool(1, heap_bytes, [config], zygote=zygote)  # forked, with --zygote
        result["spare_heap_bytes"] = heap_bytes
    if pool is not None:
        pool.start()
    try:
        one_cold_start(config, args.adapter)  # the page cache holds the weights from here on
        if zygote is not None:
            one_cold_start(config, args.adapter, zygote=zygote)  # the zygote has imported
            result["zygote_memory"] = process_memory(zygote.pid or 0)
        rounds, spare_rounds, zygote_rounds = [], [], []
        for i in range(args.rounds):
            _spare_ready(pool)  # no spare starting beside the fresh round
            rounds.append(one_cold_start(config, args.adapter))
            line = f"  round {i + 1}/{args.rounds}: {sum(rounds[-1].values()):.2f} s"
            if pool is not None:
                _spare_ready(pool)
                result.setdefault("spare_rss_bytes", spare_rss(pool))
                spare_rounds.append(one_cold_start(config, args.adapter, pool))
                line += f", {sum(spare_rounds[-1].values()):.2f} s in a spare"
            if zygote is not None:
                zygote_rounds.append(one_cold_start(config, args.adapter, zygote=zygote))
                line += f", {sum(zygote_rounds[-1].values()):.2f} s from the zygote"
            console.print(line + " to the first token")
    finally:
        if pool is not None:
            pool.close()
        if zygote is not None:
            zygote.close()
    cat, size = cat_seconds(args.model)
    result |= {"rounds": rounds, "cat_seconds": cat, "weights_bytes": size}
    if pool is not None:
        result["spare_rounds"] = spare_rounds
    if zygote is not None:
        result["zygote_rounds"] = zygote_rounds
    return result


def _spare_ready(pool: SparePool | None) -> None:
    if pool is not None and not pool.wait_ready(SPARE_READY_TIMEOUT):
        raise RuntimeError("no spare engine process became ready")


def spare_rss(pool: SparePool) -> int:
    """Bytes a ready spare holds in memory (its resident set, from /proc)."""
    (pid, *_) = pool.ready_pids()
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def process_memory(pid: int) -> dict[str, int]:
    """A process's resident and proportional set sizes in bytes (/proc/PID/smaps_rollup)."""
    sizes = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("Rss", "Pss"):
            sizes[name.lower()] = int(value.split()[0]) * 1024
    return sizes


def report(result: dict[str, Any], console: Console) -> None:
    several = "spare_rounds" in result or "zygote_rounds" in result
    columns = {"fresh" if several else "seconds": result["rounds"]}
    if "spare_rounds" in result:
        columns["in a spare"] = result["spare_rounds"]
    if "zygote_rounds" in result:
        columns["from the zygote"] = result["zygote_rounds"]
    medians = {
        name: {p: statistics.median(r.get(p, 0.0) for r in rounds) for p in PHASES}
        for name, rounds in columns.items()
    }
    totals = {
        name: statistics.median(sum(r.values()) for r in rounds) for name, rounds in columns.items()
    }
    table = Table(title=f"cold start, {result['model']}: median of {len(result['rounds'])} rounds")
    table.add_column("phase")
    for name in columns:
        table.add_column(name, justify="right")
        table.add_column("share", justify="right")
    for phase in PHASES:
        cells = []
        for name in columns:
            cells += [f"{medians[name][phase]:.3f}", f"{medians[name][phase] / totals[name]:.0%}"]
        table.add_row(phase, *cells)
    totals_cells = [cell for name in columns for cell in (f"{totals[name]:.3f}", "100%")]
    table.add_row("to the first token", *totals_cells, style="bold")
    console.print(table)
    size, cat = result["weights_bytes"], result["cat_seconds"]
    cache = result.get("weights_cache", "auto")
    source = (
        "read from the checkpoint"
        if weights_cache_at(cache) is None
        else f"mapped from the weights cache ({cache})"
    )
    console.print(
        f"weights {source}; cat reads the {size / 2**20:.0f} MiB of the checkpoint at "
        f"{size / cat / 2**30:.2f} GiB/s"
    )
    for name in columns:
        weights = medians[name]["weights"]
        console.print(
            f"weights, {name}: {weights:.3f} s = {size / weights / 2**30:.2f} GiB/s, "
            f"{cat / weights:.0%} of cat's speed"
        )
    if "spare_rounds" in result:
        fresh, spare = totals["fresh"], totals["in a spare"]
        console.print(
            f"in a warm spare: {spare:.3f} s to the first token against {fresh:.3f} s "
            f"({fresh / spare:.1f}x faster); a ready spare holds "
            f"{result['spare_rss_bytes'] / 2**20:.0f} MiB (RSS), "
            f"{result['spare_heap_bytes'] / 2**20:.0f} MiB of it heap faulted in ahead"
        )
    if "zygote_rounds" in result:
        fresh, forked = totals["fresh"], totals["from the zygote"]
        memory = result["zygote_memory"]
        console.print(
            f"from the zygote: {forked:.3f} s to the first token against {fresh:.3f} s "
            f"({fresh / forked:.1f}x faster), the fork and its arguments "
            f"{medians['from the zygote']['process'] * 1e3:.0f} ms; the zygote holds "
            f"{memory['rss'] / 2**20:.0f} MiB (RSS), {memory['pss'] / 2**20:.0f} MiB (PSS)"
        )


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.gateway:
        coldstart_gateway.main(args)
        return
    result = measure(args)
    report(result, Console())
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
