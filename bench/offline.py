"""Offline throughput: our engine vs Hugging Face `generate`, same model, same prompts, one process.

    python -m bench.offline --model DIR [--workload w1,w2,wv] [--num-prompts 64]
        [--batch-size 16] [--max-num-seqs 256] [--output-len 64] [--block-size 16] [--seed 0]
        [--json FILE] [--skip-hf] [--profile]

Workloads (prompts are random token ids from a seeded numpy RNG, special tokens excluded,
greedy decoding, exactly `output_len` new tokens per prompt on both sides):

    w1  `num_prompts` prompts of exactly 128 tokens
    w2  w1's prompts, each behind one shared 1024-token prefix (1152-token prompts);
        ours runs twice: prefix caching on (row "w2") and off (row "w2 no-cache")
    wv  prompt lengths uniform in [32, 256]

HF runs static, left-padded batches of `batch_size` prompts taken in order. Ours runs
continuous batching with its default max_num_seqs (every prompt at once, as vLLM's
offline mode does: paged KV makes that affordable); row "w1 seqs=16" repeats w1 at
HF's concurrency to separate the two effects. Model loading and one small warmup
generate per side are outside the timed regions. Both run in `--dtype` (float32 by
default; `auto` resolves as the server does, bfloat16 where the CPU has bf16 dot
products) on the same device (our engine's: CUDA if present, else CPU).

"KV alloc/used" is the KV cache's token slots held divided by the slots holding a
computed token, summed over forward passes (see `bench.hf_baseline.hf_kv_slots` for the exact rule).
1.00 is no waste; ours pays block rounding, HF pays left padding. Below 1.00 means
sharing: with prefix caching, 16 requests read one physical copy of the shared prefix.

"MFU" is model-FLOPs utilisation (bench.mfu): the model FLOPs of the tokens each side
computed (prefix-cache hits excluded; HF's padding excluded) per second, over the peak a
2048-cubed matmul reaches in the engine's dtype, measured in the same run.

`run_offline` is the reusable entry point (an `OfflineRun` says what to measure);
`bench.offline_report.results_table` renders its rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import (
    Progress,
)

from bench.hf_baseline import build_hf, hf_generate, run_hf
from bench.mfu import ModelFlops, matmul_peak, mfu
from bench.offline_ours import build_ours, cdiv, profile_ours, run_ours, warmup_ours
from bench.offline_report import print_header, results_table
from bench.workloads import (
    WORKLOAD_NAMES,
    Workload,
    allowed_token_ids,
    make_workloads,
    new_progress,
    parse_workloads,
)
from kernels import cpu_features


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i in decoder)
    return ids


def _match_rate(ours: list[list[int]], theirs: list[list[int]]) -> float:
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


def environment(model_dir: str, num_params: int | None, llm: Any | None) -> dict[str, Any]:
    affinity: int | None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        affinity = os.cpu_count()
    env: dict[str, Any] = {
        "model": str(model_dir),
        "model_name": Path(model_dir).resolve().name,
        "num_params": num_params,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_features.describe(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if llm is not None:
        runner = llm.engine.runner
        env["device"] = str(runner.device)
        env["dtype"] = str(runner.dtype).removeprefix("torch.")
        env["kv_bytes_per_token"] = runner.bytes_per_block / llm.engine.kv.block_size
        env["kv_pool_blocks"] = llm.engine.kv.pool.num_blocks
    return env


@dataclass(frozen=True, slots=True)
class OfflineRun:
    """What one run measures, and how (`run_offline`'s knobs; the CLI's flags)."""

    num_prompts: int = 64
    batch_size: int = 16  # HF's static batch; w1 is also run at it as our max_num_seqs
    max_num_seqs: int = 256  # our engine's concurrency (its default, as vLLM's offline)
    output_len: int = 64
    block_size: int = 16
    seed: int = 0
    skip_hf: bool = False
    repeat: int = 1  # time each measurement this many times, keep the fastest
    kv_cache_memory: int | None = None  # bytes; by default sized to the workloads
    profile: bool = False
    dtype: str = "float32"  # the engine's (`auto` as the server resolves it); HF runs in it


@dataclass(slots=True)
class _Contenders:
    """Our engine (prefix caching on), the same without it (for w2), the same at HF's
    concurrency (for w1), and HF."""

    ours: Any
    nocache: Any = None
    matched: Any = None
    hf_model: Any = None
    hf_tokenizer: Any = None


def run_offline(
    model_dir: str | Path,
    workloads: Sequence[str] = WORKLOAD_NAMES,
    run: OfflineRun = OfflineRun(),
    console: Console | None = None,
) -> list[dict[str, Any]]:
    """Run the workloads through our engine (and HF unless run.skip_hf); one row per result.

    Rows are flat dicts: workload, ours_*/hf_* metrics, ratio, greedy_match and the
    environment (model, threads, cores, KV bytes per token). A workload whose prompts do
    not fit the model's context gets a row with `skipped` set. Our KV pool holds every
    running sequence at its longest, plus one block each, and at least max_model_len tokens,
    unless run.kv_cache_memory says otherwise. Walls of every repeat are kept.
    """
    from transformers import AutoConfig, AutoTokenizer

    console = console or Console()
    model_dir = str(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = min(int(hf_config.vocab_size), len(tokenizer))
    max_len = int(hf_config.max_position_embeddings)
    torch.manual_seed(run.seed)
    special = sorted(_special_ids(tokenizer))
    all_wl = make_workloads(
        list(workloads), vocab, special, num_prompts=run.num_prompts, seed=run.seed
    )
    runnable = [w for w in all_wl if w.max_prompt_len + run.output_len <= max_len]
    longest = max((w.max_prompt_len + run.output_len for w in runnable), default=0)
    concurrency = min(run.max_num_seqs, run.num_prompts)
    num_kv_blocks = max(
        concurrency * (cdiv(longest, run.block_size) + 1), cdiv(max_len, run.block_size)
    )
    rng = np.random.default_rng([run.seed, 99])
    warm_prompts = rng.choice(
        allowed_token_ids(vocab, special), size=(min(run.batch_size, 4), 32)
    ).tolist()

    rows: list[dict[str, Any]] = []
    with new_progress(console) as progress:
        contenders = _build_contenders(model_dir, runnable, run, num_kv_blocks, progress)
        env = _measured_environment(model_dir, contenders, progress)
        print_header(console, env, run.batch_size, run.output_len, run.block_size, run.seed)
        _warm_up(contenders, warm_prompts, progress)

        model_flops = ModelFlops.from_config(hf_config)
        for wl in all_wl:
            base = {
                "workload": wl.name,
                "description": wl.description,
                "num_prompts": len(wl.prompts),
                "output_len": run.output_len,
                "batch_size": run.batch_size,
                "block_size": run.block_size,
                "seed": run.seed,
                **env,
            }
            if wl not in runnable:
                reason = (
                    f"prompts of {wl.max_prompt_len} + {run.output_len} tokens exceed "
                    f"max_position_embeddings={max_len}"
                )
                console.print(f"[yellow]skipping {wl.name}: {reason}")
                rows.append({**base, "skipped": reason})
                continue
            rows += _measure(wl, base, contenders, run, model_flops, progress)

        if run.profile and runnable:
            wl = runnable[0]
            task = progress.add_task(f"profile ours ({wl.name})", total=None)
            report = profile_ours(contenders.ours, wl.prompts[: run.batch_size], run.output_len)
            progress.update(task, total=1, completed=1)
            console.print(report, markup=False, highlight=False)
    return rows


def _measured_environment(
    model_dir: str, contenders: _Contenders, progress: Progress
) -> dict[str, Any]:
    """`environment` plus the parameter count and the matmul peak (the MFU denominator)."""
    llm = contenders.ours
    if contenders.hf_model is not None:
        num_params = sum(p.numel() for p in contenders.hf_model.parameters())
    else:
        num_params = sum(p.numel() for p in llm.engine.runner.model.parameters())
    env = environment(model_dir, num_params, llm)
    peak_task = progress.add_task("matmul peak", total=None)
    env["peak_flops"] = matmul_peak(llm.engine.runner.dtype)
    progress.update(peak_task, total=1, completed=1)
    return env


def _warm_up(contenders: _Contenders, warm_prompts: list[list[int]], progress: Progress) -> None:
    """One small untimed generate per contender, so no timed run pays first-call costs."""
    warm = progress.add_task("warmup", total=None)
    for engine in (contenders.ours, contenders.nocache, contenders.matched):
        if engine is not None:
            warmup_ours(engine, warm_prompts, 8)
    if contenders.hf_model is not None:
        hf_generate(contenders.hf_model, contenders.hf_tokenizer, warm_prompts, 8)
    progress.update(warm, total=1, completed=1)


def _build_contenders(
    model_dir: str,
    runnable: list[Workload],
    run: OfflineRun,
    num_kv_blocks: int,
    progress: Progress,
) -> _Contenders:
    build: dict[str, Any] = dict(
        block_size=run.block_size,
        num_kv_blocks=num_kv_blocks,
        kv_cache_memory=run.kv_cache_memory,
        progress=progress,
        dtype=run.dtype,
    )
    seqs = run.max_num_seqs
    contenders = _Contenders(
        build_ours(model_dir, prefix_caching=True, max_num_seqs=seqs, label="ours", **build)
    )
    if any(w.name == "w2" for w in runnable):
        contenders.nocache = build_ours(
            model_dir,
            prefix_caching=False,
            max_num_seqs=seqs,
            label="ours (no prefix cache)",
            **build,
        )
    if seqs != run.batch_size and any(w.name == "w1" for w in runnable):
        contenders.matched = build_ours(
            model_dir,
            prefix_caching=True,
            max_num_seqs=run.batch_size,
            label=f"ours (max_num_seqs={run.batch_size})",
            **build,
        )
    if not run.skip_hf:
        runner = contenders.ours.engine.runner
        contenders.hf_model, contenders.hf_tokenizer = build_hf(
            model_dir, runner.device, progress, runner.dtype
        )
    return contenders


def _measure(
    wl: Workload,
    base: dict[str, Any],
    contenders: _Contenders,
    run: OfflineRun,
    model_flops: ModelFlops,
    progress: Progress,
) -> list[dict[str, Any]]:
    """One workload's rows: ours against HF, and the extra row w1 and w2 have."""
    out_len, repeat = run.output_len, run.repeat
    ours = run_ours(contenders.ours, wl, out_len, progress, f"{wl.name} ours", repeat)
    extra = extra_name = None
    if wl.name == "w2" and contenders.nocache is not None:
        extra_name = "w2 no-cache"
        extra = run_ours(
            contenders.nocache, wl, out_len, progress, f"{wl.name} ours no-cache", repeat
        )
    if wl.name == "w1" and contenders.matched is not None:
        extra_name = f"w1 seqs={run.batch_size}"
        extra = run_ours(contenders.matched, wl, out_len, progress, f"{extra_name} ours", repeat)
    hf = None
    if contenders.hf_model is not None:
        hf = run_hf(
            contenders.hf_model, contenders.hf_tokenizer, wl, run.batch_size, out_len, progress,
            repeat,
        )  # fmt: skip
    lens = [len(p) for p in wl.prompts]
    for result in (ours, extra, hf):
        if result is not None:
            flops = model_flops.run(lens, out_len, result.get("cached_tokens", 0))
            result["mfu"] = mfu(flops, result["wall_s"], base["peak_flops"])
    rows = [_row(base, ours, hf)]
    if extra is not None:
        rows.append(_row({**base, "workload": extra_name}, extra, hf))
    return rows


def _row(base: dict[str, Any], ours: dict[str, Any], hf: dict[str, Any] | None) -> dict[str, Any]:
    row = dict(base)
    row.update({f"ours_{k}": v for k, v in ours.items() if k != "token_ids"})
    if hf is not None:
        row.update({f"hf_{k}": v for k, v in hf.items() if k != "token_ids"})
        row["ratio"] = ours["tok_s"] / hf["tok_s"]
        row["greedy_match"] = _match_rate(ours["token_ids"], hf["token_ids"])
    return row


# -- output ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.offline",
        description="Offline throughput of our engine vs Hugging Face generate.",
    )
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument(
        "--workload",
        default=",".join(WORKLOAD_NAMES),
        help="comma-separated: w1, w2, wv (default: all)",
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="HF static batch size")
    p.add_argument(
        "--max-num-seqs", type=int, default=256, help="our engine's concurrency (its default)"
    )
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", "float32", "bfloat16"],
        help="our engine's dtype (auto: as the server resolves it); HF runs in the same",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for both sides (default: torch's own choice)",
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="time each measurement N times, report the fastest"
    )
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=None,
        help="our KV pool in MiB (default: sized to the workloads)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the rows to this file")
    p.add_argument("--skip-hf", action="store_true", help="run only our engine")
    p.add_argument(
        "--profile",
        action="store_true",
        help="afterwards, cProfile our engine's steps on one batch of the first "
        "workload and print the top 15 cumulative entries",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        names = parse_workloads(args.workload)
    except ValueError as e:
        _parser().error(str(e))
    flags = ("num_prompts", "batch_size", "max_num_seqs", "output_len", "block_size", "repeat")
    for flag in (*flags, "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            _parser().error(f"--{flag.replace('_', '-')} must be positive")

    import transformers

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    console = Console()
    if not console.is_terminal:  # piped or captured: don't squeeze the table into 80 columns
        console = Console(width=150)
    run = OfflineRun(
        num_prompts=args.num_prompts,
        batch_size=args.batch_size,
        max_num_seqs=args.max_num_seqs,
        output_len=args.output_len,
        block_size=args.block_size,
        seed=args.seed,
        skip_hf=args.skip_hf,
        repeat=args.repeat,
        kv_cache_memory=None if args.kv_cache_mib is None else args.kv_cache_mib << 20,
        profile=args.profile,
        dtype=args.dtype,
    )
    rows = run_offline(args.model, names, run, console)
    console.print(results_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        console.print(f"rows written to {args.json}")


if __name__ == "__main__":
    main()
