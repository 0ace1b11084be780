"""S-LoRA's workload on one engine: thousands of adapters, requests by a power law over them.

    loragate-bench lora-scale --model DIR [--num-adapters 1000] [--ranks 8,16,32,64]
        [--num-requests 256] [--alpha 1] [--base-fraction 0.05] [--rate 0]
        [--max-input 512] [--max-output 256] [--adapters-dir DIR] [--dtype auto]
        [--max-loras N] [--max-cpu-loras N] [--max-lora-rank 64] [--max-num-seqs N]
        [--max-num-batched-tokens N] [--lora-memory 2GiB] [--skip-base] [--peft]
        [--verify-peft K] [--verify-max-output N] [--json FILE]

The catalog and trace are bench/lora_scale_trace.py's: N all-linear adapters of ranks drawn
from --ranks, owned by --tenants tenants round-robin; each request picks adapter k with
probability ~ (k + 1)^-alpha (5 % the base model), prompt of random token ids, lengths
uniform in [8, 512] in and [8, 256] out, Poisson arrivals at --rate (0: all at once).
Only the K adapters the trace touches get files (bfloat16, PEFT layout).

One engine (engine.frontend.offline.LLM, in process) runs, side by side, the same prompts and
lengths, greedy with ignore_eos: (a) the trace, each request on its adapter; (b) the same trace with
every adapted request on one rank-16 adapter; (c) every request on the base model. Before
each run every adapter is unloaded (the run starts with all of them on disk) and the prefix
cache is emptied. Requests join the engine between steps once the wall clock passes their
arrival. Reported: output tok/s and (a)/(b) (the goal: at least 0.8x at N=1000 on SmolLM2
in bfloat16 on a CPU with bf16), TTFT from the request's arrival to the step that gave its
first token, split by where its adapter was when it arrived (a device slot, the CPU cache,
disk), adapter loads into a slot and from disk per second, and the process's peak resident
memory during each run (VmHWM, reset before each run). `--peft` adds peft on (a)'s
requests in static batches in arrival order (each batch as long as its longest output;
only the requests' own tokens count), as bench/lora.py does. `--verify-peft K` checks (a)
token for token against peft's greedy output on K of its adapted requests drawn at random
(bench/lora_scale_verify.py), and so runs the engine in float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import resource
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.lora_scale_trace import (
    Trace,
    TraceSpec,
    adapter_file_bytes,
    adapter_name,
    ensure_adapter,
    make_trace,
    store_dir,
)
from bench.lora_scale_verify import Verification, rank_table, verify_peft
from bench.workloads import new_progress

GOAL = 0.8  # (a) / (b) output tok/s at N=1000 on SmolLM2, bfloat16
SINGLE_RANK = 16
WHERE = ("slot", "cpu", "disk", "base")


@dataclass(slots=True)
class RunResult:
    label: str
    wall_s: float = 0.0
    output_tokens: int = 0
    steps: int = 0
    loads: int = 0  # installs into a device slot
    disk_loads: int = 0
    evictions: int = 0  # adapters moved out of the pool (the JSON only)
    peak_rss_bytes: int | None = None
    errors: int = 0
    ttft: dict[str, list[float]] = field(default_factory=dict)  # where -> seconds
    unserved: int = 0  # requests that never got a token (errors)
    token_ids: list[list[int]] = field(default_factory=list)  # per request (not in the JSON)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def as_json(self) -> dict[str, Any]:
        names = [f.name for f in dataclasses.fields(self) if f.name not in ("ttft", "token_ids")]
        out = {name: getattr(self, name) for name in names}
        out["tok_s"] = self.tok_s
        out["ttft_s"] = {w: _quantiles(v) | {"n": len(v)} for w, v in self.ttft.items()}
        return out


# -- memory -----------------------------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0); False where not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '300M', '1048576' -> bytes (K/M/G/T are powers of 1024)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (say 2GiB, 512MiB, 1048576)")
    power = " kmgt".index(match[2].lower() or " ")
    return int(float(match[1]) * 1024**power)


# -- the engine -------------------------------------------------------------------------------


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine knobs given on the command line, as LLM keywords; the rest keep the
    engine's defaults. lora_memory only when given (older EngineConfigs lack it)."""
    from engine.config import EngineConfig

    kwargs: dict[str, Any] = {"dtype": args.dtype, "max_lora_rank": args.max_lora_rank}
    for name in (
        "max_loras",
        "max_cpu_loras",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
    ):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if args.threads is not None:
        kwargs["num_threads"] = args.threads
    if args.kv_cache_mib is not None:
        kwargs["kv_cache_memory"] = args.kv_cache_mib << 20
    if args.lora_memory is not None:
        kwargs["lora_memory"] = args.lora_memory
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    cpu_default = defaults.get("max_cpu_loras")
    if args.max_loras is not None and args.max_cpu_loras is None and isinstance(cpu_default, int):
        kwargs["max_cpu_loras"] = max(cpu_default, args.max_loras)  # must hold the slots'
    return kwargs


def where_is(manager: Any, adapter_id: str) -> str:
    if adapter_id in manager.slot_of:
        return "slot"
    if adapter_id in manager.cpu_cache:
        return "cpu"
    return "disk"  # or a load already in flight


def forget_adapters(manager: Any) -> None:
    """Every adapter back on disk: no slot, no CPU copy."""
    for adapter_id in {*manager.slot_of, *manager.cpu_cache}:
        manager.unload(adapter_id)


def run_trace(
    llm: Any, trace: Trace, loras: list[Any], label: str, progress: Progress
) -> RunResult:
    """Feed the trace to the engine as the wall clock passes each arrival; step until done."""
    from engine.request import SamplingParams

    engine = llm.engine
    manager = engine.lora
    forget_adapters(manager)
    engine.kv.reset_prefix_cache()
    gc.collect()
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in trace.output_lens
    ]
    num = len(trace.prompts)
    where = [""] * num
    first_token: list[float | None] = [None] * num
    result = RunResult(label, token_ids=[[] for _ in range(num)])
    task = progress.add_task(label, total=num)
    loads0, disk_loads0 = manager.num_loads, manager.num_disk_loads
    evictions0 = getattr(manager, "num_evictions", 0)
    have_peak = reset_peak_rss()
    finished = added = 0
    t0 = time.perf_counter()
    while added < num or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while added < num and trace.arrivals[added] <= now:
            lora = loras[added]
            where[added] = "base" if lora is None else where_is(manager, lora.adapter_id)
            engine.add_request(str(added), trace.prompts[added], params[added], lora=lora)
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, trace.arrivals[added] - now))
            continue
        updates = engine.step()
        result.steps += 1
        now = time.perf_counter() - t0
        for update in updates:
            i = int(update.request_id)
            if update.new_token_ids and first_token[i] is None:
                first_token[i] = now
            result.output_tokens += len(update.new_token_ids)
            result.token_ids[i].extend(update.new_token_ids)
            if update.finished:
                finished += 1
                result.errors += update.error is not None
        progress.update(task, completed=finished)
    result.wall_s = time.perf_counter() - t0
    result.loads = manager.num_loads - loads0
    result.disk_loads = manager.num_disk_loads - disk_loads0
    result.evictions = getattr(manager, "num_evictions", 0) - evictions0
    result.peak_rss_bytes = peak_rss_bytes() if have_peak else None
    for i, first in enumerate(first_token):
        if first is None:
            result.unserved += 1
        else:
            result.ttft.setdefault(where[i], []).append(first - trace.arrivals[i])
    return result


def warm_up(llm: Any, loras: list[Any]) -> None:
    """Fault in prefill and decode, base and adapted, with one and several adapters, untimed."""
    from engine.request import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, lora in enumerate([None, None, *loras]):
        engine.add_request(f"warmup-{i}", [5 + i] * 16, params, lora=lora)
    while engine.has_unfinished_requests():
        engine.step()


# -- adapters ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Catalog:
    directory: Path
    paths: dict[int, Path]  # touched adapter index -> its folder
    single: Path  # the rank-16 adapter of run (b)
    written: int
    reused: int
    bytes_on_disk: int


def prepare_adapters(
    args: argparse.Namespace, trace: Trace, base: Any, progress: Progress
) -> Catalog:
    import torch

    directory = store_dir(args.adapters_dir, base)
    touched = trace.touched
    task = progress.add_task(f"adapter files ({len(touched)} + 1)", total=len(touched) + 1)
    paths: dict[int, Path] = {}
    written = size = 0
    for index in touched:
        rank = trace.catalog_ranks[index]
        path = directory / adapter_name(args.seed, f"a{index:05d}", rank)
        written += ensure_adapter(path, base, rank, (args.seed, index), torch.bfloat16)
        size += adapter_file_bytes(base, rank)
        paths[index] = path
        progress.advance(task)
    single = directory / adapter_name(args.seed, "single", SINGLE_RANK)
    written += ensure_adapter(single, base, SINGLE_RANK, (args.seed, -1), torch.bfloat16)
    size += adapter_file_bytes(base, SINGLE_RANK)
    progress.advance(task)
    return Catalog(directory, paths, single, written, len(touched) + 1 - written, size)


def lora_requests(
    catalog: Catalog, registry: Any, progress: Progress
) -> tuple[dict[int, Any], Any]:
    """LoRARequests for the touched adapters and the single one. Two are validated in full
    here (bfloat16 files in this layout must load); the rest are only hashed, and the engine's
    loader validates each as it loads it."""
    from adapters.peft import adapter_identity
    from engine.lora.types import LoRARequest

    task = progress.add_task("hash adapters", total=len(catalog.paths) + 1)
    single = registry.register(catalog.single.name, catalog.single)
    progress.advance(task)
    requests: dict[int, Any] = {}
    for n, (index, path) in enumerate(catalog.paths.items()):
        if n == 0:
            requests[index] = registry.register(path.name, path)
        else:
            requests[index] = LoRARequest(path.name, str(path.resolve()), adapter_identity(path))
        progress.advance(task)
    return requests, single


# -- peft -------------------------------------------------------------------------------------


def run_peft(
    args: argparse.Namespace, trace: Trace, catalog: Catalog, dtype: Any, progress: Progress
) -> RunResult:
    """peft's mixed-adapter generate on (a)'s requests: static batches of --peft-batch-size
    in arrival order, one adapter per row, each batch as long as its longest output."""
    import torch
    from peft import PeftModel

    from bench.hf_baseline import build_hf, hf_generate

    model, tokenizer = build_hf(args.model, torch.device("cpu"), progress, dtype)
    names = {index: f"a{index}" for index in catalog.paths}
    task = progress.add_task("peft: load adapters", total=len(names))
    peft_model: Any = None
    for index, path in catalog.paths.items():
        if peft_model is None:
            peft_model = PeftModel.from_pretrained(model, str(path), adapter_name=names[index])
        else:
            peft_model.load_adapter(str(path), adapter_name=names[index])
        progress.advance(task)
    peft_model.eval()
    rows = [names[a] if a is not None else "__base__" for a in trace.adapters]
    size = args.peft_batch_size
    result = RunResult("(d) peft mixed")
    task = progress.add_task(result.label, total=len(rows))
    gc.collect()
    have_peak = reset_peak_rss()
    t0 = time.perf_counter()
    for start in range(0, len(rows), size):
        batch = slice(start, start + size)
        lens = trace.output_lens[batch]
        hf_generate(
            peft_model, tokenizer, trace.prompts[batch], max(lens), adapter_names=rows[batch]
        )
        result.output_tokens += sum(lens)  # the requests' own tokens; the padding is waste
        result.steps += 1
        progress.advance(task, len(lens))
    result.wall_s = time.perf_counter() - t0
    result.peak_rss_bytes = peak_rss_bytes() if have_peak else None
    return result


# -- the report -------------------------------------------------------------------------------


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None}
    p50, p95 = np.percentile(values, [50, 95])
    return {"p50": float(p50), "p95": float(p95)}


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:,.0f}"


def runs_table(title: str, runs: list[RunResult]) -> Table:
    table = Table(title=title)
    columns = ("run", "requests", "out tokens", "wall s", "out tok/s", "vs (b)", "loads (disk)",
               "loads/s (disk)", "peak RSS MiB", "errors")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col == "run" else "right")
    single = next((r.tok_s for r in runs if r.label.startswith("(b)")), None)
    for run in runs:
        engine_run = bool(run.ttft) or run.unserved > 0
        table.add_row(
            run.label,
            str(sum(len(v) for v in run.ttft.values()) + run.unserved) if engine_run else "",
            f"{run.output_tokens:,}",
            f"{run.wall_s:.1f}",
            f"{run.tok_s:.1f}",
            f"{run.tok_s / single:.2f}x" if single else "",
            f"{run.loads} ({run.disk_loads})" if engine_run else "",
            f"{run.loads / run.wall_s:.1f} ({run.disk_loads / run.wall_s:.1f})"
            if engine_run
            else "",
            _mib(run.peak_rss_bytes),
            str(run.errors),
        )
    return table


def ttft_table(runs: list[RunResult]) -> Table:
    table = Table(title="TTFT by where the request's adapter was when it arrived")
    for col in ("run", "adapter at arrival", "requests", "TTFT p50 s", "TTFT p95 s"):
        table.add_column(col, justify="left" if col in ("run", "adapter at arrival") else "right")
    for run in runs:
        first = True
        for where in WHERE:
            values = run.ttft.get(where)
            if not values:
                continue
            q = _quantiles(values)
            table.add_row(
                run.label if first else "", where, str(len(values)),
                f"{q['p50']:.3f}", f"{q['p95']:.3f}",
            )  # fmt: skip
            first = False
    return table


def describe(
    args: argparse.Namespace, trace: Trace, catalog: Catalog, engine: Any, load_before: float
) -> list[str]:
    spec = trace.spec
    touched = trace.touched
    tenants = len({trace.tenant(a) for a in touched})
    adapted = [a for a in trace.adapters if a is not None]
    top = max(np.bincount(adapted).tolist()) if adapted else 0
    lora = engine.lora
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    arrivals = "all at once" if spec.rate <= 0 else f"Poisson at {spec.rate:g} req/s"
    budget = f", lora_memory {args.lora_memory:,} B" if args.lora_memory is not None else ""
    pool = getattr(lora, "pool_bytes", None)
    budget += f", LoRA pool {pool / 2**20:,.0f} MiB" if isinstance(pool, int) else ""
    return [
        f"model {args.model} ({dtype}), max_loras {lora.max_loras}, "
        f"max_cpu_loras {lora.max_cpu_loras}, max_lora_rank {lora.max_lora_rank}{budget}, "
        f"load average {load_before:.2f} before the runs",
        f"{spec.num_adapters} adapters in the catalog (ranks {'/'.join(map(str, spec.ranks))}, "
        f"all-linear, {spec.num_tenants} tenants round-robin), {len(touched)} touched "
        f"({tenants} tenants), files for the {len(touched)} (+1 single r{SINGLE_RANK}): "
        f"{catalog.bytes_on_disk / 2**30:.2f} GiB bfloat16 in {catalog.directory} "
        f"({catalog.written} written, {catalog.reused} reused)",
        f"{spec.num_requests} requests, alpha {spec.alpha:g}, {spec.base_fraction:.0%} base "
        f"({len(trace.adapters) - len(adapted)} drawn), the top adapter {top} requests; "
        f"in U[{spec.input_len[0]}, {spec.input_len[1]}], out U[{spec.output_len[0]}, "
        f"{spec.output_len[1]}] tokens, max_model_len {spec.max_model_len}; arrivals {arrivals}",
    ]


def describe_check(args: argparse.Namespace, check: Verification, forced: bool) -> str:
    dtype = "float32 (--dtype auto overridden)" if forced else "float32"
    cap = "" if check.max_output is None else f", at most {check.max_output} output tokens each"
    return (
        f"--verify-peft {check.asked}: the engine in {dtype}; {len(check.checks)} of the "
        f"{check.adapted} adapted requests (seed {args.seed}) checked against peft's greedy "
        f"output, one request at a time{cap}"
    )


def exact_dtype(args: argparse.Namespace) -> bool:
    """--verify-peft compares tokens exactly, which holds in float32 only: the engine runs in
    float32 then. True if --dtype auto was overridden to get it."""
    if args.verify_peft is None:
        if args.verify_max_output is not None:
            raise SystemExit("--verify-max-output goes with --verify-peft K")
        return False
    if args.verify_peft < 1 or (args.verify_max_output is not None and args.verify_max_output < 1):
        raise SystemExit("--verify-peft and --verify-max-output take positive counts")
    if args.dtype not in ("auto", "float32"):
        raise SystemExit(
            f"--verify-peft compares (a)'s tokens with peft's exactly, which needs float32: "
            f"drop --dtype {args.dtype} (or say --dtype float32)"
        )
    forced = args.dtype == "auto"
    args.dtype = "float32"
    return forced


# -- the command ------------------------------------------------------------------------------


def _ranks(text: str) -> tuple[int, ...]:
    ranks = tuple(int(r) for r in text.split(",") if r.strip())
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"ranks must be positive integers, got {text!r}")
    return ranks


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loragate-bench lora-scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True)
    p.add_argument("--num-adapters", type=int, default=1000)
    p.add_argument("--ranks", type=_ranks, default=(8, 16, 32, 64))
    p.add_argument("--tenants", type=int, default=100, help="tenants owning the adapters")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--alpha", type=float, default=1.0, help="power-law exponent of popularity")
    p.add_argument("--base-fraction", type=float, default=0.05)
    p.add_argument("--min-input", type=int, default=8)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--min-output", type=int, default=8)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--rate", type=float, default=0.0, help="requests/s, Poisson; 0: all at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adapters-dir", type=Path, default=None, help="the adapter store (reused)")
    p.add_argument("--skip-base", action="store_true", help="leave out run (c), base only")
    p.add_argument("--peft", action="store_true", help="add peft on (a) in static batches")
    p.add_argument("--peft-batch-size", type=int, default=16)
    p.add_argument(
        "--verify-peft",
        type=int,
        default=None,
        metavar="K",
        help="check (a)'s greedy tokens on K random adapted requests against peft (float32)",
    )
    p.add_argument(
        "--verify-max-output",
        type=int,
        default=None,
        metavar="N",
        help="compare only the first N output tokens of each checked request",
    )
    engine = p.add_argument_group("engine knobs, passed to LLM")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--max-loras", type=int, default=None)
    engine.add_argument("--max-cpu-loras", type=int, default=None)
    engine.add_argument("--max-lora-rank", type=int, default=64)
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--lora-memory", type=parse_size, default=None, help="e.g. 2GiB")
    engine.add_argument("--kv-cache-mib", type=int, default=None)
    engine.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if max(args.ranks) > args.max_lora_rank:
        raise SystemExit(f"--ranks go up to {max(args.ranks)}, above --max-lora-rank")
    forced = exact_dtype(args)
    if args.adapters_dir is None:
        args.adapters_dir = Path(tempfile.mkdtemp(prefix="loragate-bench-lora-scale-"))
    console = Console() if Console().is_terminal else Console(width=150)
    from adapters.peft import describe_base
    from adapters.registry import AdapterRegistry
    from engine.frontend.offline import LLM

    base = describe_base(args.model)
    registry = AdapterRegistry(base, max_lora_rank=args.max_lora_rank)
    with new_progress(console) as progress:
        task = progress.add_task("load engine", total=1)
        llm = LLM(args.model, lora_loader=registry.loader, **engine_kwargs(args))
        progress.update(task, completed=1)
        engine = llm.engine
        spec = TraceSpec(
            num_adapters=args.num_adapters,
            ranks=args.ranks,
            num_tenants=args.tenants,
            num_requests=args.num_requests,
            alpha=args.alpha,
            base_fraction=args.base_fraction,
            input_len=(min(args.min_input, args.max_input), args.max_input),
            output_len=(min(args.min_output, args.max_output), args.max_output),
            max_model_len=engine.max_model_len,
            rate=args.rate,
            seed=args.seed,
        )
        trace = make_trace(spec, engine.vocab_size, list(llm.tokenizer.all_special_ids))
        catalog = prepare_adapters(args, trace, base, progress)
        by_index, single = lora_requests(catalog, registry, progress)
        mixed = [None if a is None else by_index[a] for a in trace.adapters]
        one = [None if a is None else single for a in trace.adapters]
        load_before = os.getloadavg()[0]
        warm_up(llm, [single, *list(by_index.values())[:2]])
        runs = [
            run_trace(llm, trace, one, f"(b) one r{SINGLE_RANK}", progress),
            run_trace(llm, trace, mixed, "(a) mixed", progress),
        ]
        if not args.skip_base:
            runs.append(run_trace(llm, trace, [None] * len(mixed), "(c) base", progress))
        runs.sort(key=lambda r: r.label)
        if args.peft:
            runs.append(run_peft(args, trace, catalog, engine.runner.dtype, progress))
        check: Verification | None = None
        if args.verify_peft is not None:
            mixed_run = next(r for r in runs if r.label == "(a) mixed")
            check = verify_peft(
                args.model, trace, catalog.paths, mixed_run.token_ids, args.verify_peft,
                args.seed, args.verify_max_output, progress,
            )  # fmt: skip
    lines = describe(args, trace, catalog, engine, load_before)
    if check is not None:
        lines.append(describe_check(args, check, forced))
    for line in lines:
        console.print(line, highlight=False)
    console.print(runs_table("lora-scale: output throughput", runs))
    console.print(ttft_table([r for r in runs if r.ttft]))
    ratio = runs[0].tok_s / runs[1].tok_s if runs[1].tok_s else float("nan")
    verdict = "met" if ratio >= GOAL else "missed"
    bound = "; arrivals bound both runs' tok/s at --rate > 0" if args.rate > 0 else ""
    console.print(
        f"(a)/(b) output tok/s: {ratio:.2f}x (goal at least {GOAL}x at N=1000 on SmolLM2 in "
        f"bfloat16: {verdict} here, at N={args.num_adapters}{bound})",
        highlight=False,
    )
    if check is not None:
        if check.checks:
            console.print(rank_table(check))
        console.print(check.verdict(), highlight=False)
    if args.json:
        out = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "setup": lines,
            "touched": len(trace.touched),
            "adapter_bytes_on_disk": catalog.bytes_on_disk,
            "runs": {r.label: r.as_json() for r in runs},
            "ratio_a_b": ratio,
        }
        if check is not None:
            out["verify_peft"] = check.as_json()
        args.json.write_text(json.dumps(out, indent=2))
    assert engine.lora is not None
    engine.lora.shutdown()


if __name__ == "__main__":
    main()
