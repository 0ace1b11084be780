"""What a failed step costs: W1 batches run clean and with one request whose steps raise.

In one engine, for each batch size: the batch's prompts run together, once clean and once
with a fault injected into the forward pass of every step that holds one chosen request once
it has `--fail-at` output tokens. The engine pins the failure on that request by re-running
the step in halves, fails it, and the others go on. The table prints both wall times, the
extra forward passes the diagnosis took, and whether every other output equals the clean
run's. Best of `--repeat` runs each; the machine is noisy, compare within one run.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.workloads import make_workloads, new_progress
from engine import LLM, SamplingParams
from engine.kv_cache.manager import KVCacheManager
from engine.scheduler import SchedulerOutput


class InjectedFault(RuntimeError):
    pass


def _run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, fail_at: int | None
) -> dict[str, Any]:
    """One batch, cold prefix cache; with `fail_at`, the first prompt's steps raise from its
    `fail_at`-th output token on."""
    engine = llm.engine
    engine.kv.reset_prefix_cache()
    runner = engine.runner
    execute = runner.execute
    target = str(llm._next_id)  # the id LLM.generate gives the first prompt
    num_passes = 0

    def counted(
        sched: SchedulerOutput, kv: KVCacheManager, give_way: Callable[[], bool] | None = None
    ) -> Any:
        nonlocal num_passes
        num_passes += 1
        if fail_at is not None and any(
            r.request_id == target and r.num_output_tokens >= fail_at for r, _ in sched.scheduled
        ):
            raise InjectedFault("injected")
        return execute(sched, kv, give_way)

    runner.execute = counted  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    finally:
        runner.execute = execute  # type: ignore[method-assign]
    return {
        "wall_s": wall,
        "passes": num_passes,
        "outputs": [o.outputs[0].token_ids for o in outs],
        "finish": [o.outputs[0].finish_reason for o in outs],
    }


def run_containment_bench(
    model: str, batches: list[int], output_len: int, fail_at: int, repeat: int, console: Console
) -> list[dict[str, Any]]:
    llm = LLM(model, max_model_len=128 + output_len + 1, kv_cache_memory=1 << 30)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    rows = []
    with new_progress(console) as progress:
        task = progress.add_task("clean and poisoned batches", total=2 * repeat * len(batches))
        for batch in batches:
            (w1,) = make_workloads(["w1"], llm.engine.vocab_size, num_prompts=batch)
            best: dict[str, dict[str, Any]] = {}
            for _ in range(repeat):
                for name, fault in (("clean", None), ("poisoned", fail_at)):
                    result = _run(llm, w1.prompts, params, fault)
                    if name not in best or result["wall_s"] < best[name]["wall_s"]:
                        best[name] = result
                    progress.advance(task)
            clean, poisoned = best["clean"], best["poisoned"]
            rows.append(
                {
                    "batch": batch,
                    "clean_s": clean["wall_s"],
                    "poisoned_s": poisoned["wall_s"],
                    # The poisoned request stops early: its missing decode steps are not
                    # extra. Count passes beyond the clean run's.
                    "extra_passes": poisoned["passes"] - clean["passes"],
                    "failed": poisoned["finish"][0] == "error",
                    "others_equal": poisoned["outputs"][1:] == clean["outputs"][1:],
                }
            )
    return rows


def table(rows: list[dict[str, Any]], model: str, output_len: int, fail_at: int) -> Table:
    t = Table(
        title=f"one failing request per batch ({Path(model).name}, W1 prompts, "
        f"{output_len} output tokens, failing from its token {fail_at})"
    )
    for name in ("batch", "clean s", "poisoned s", "ratio", "extra passes", "failed alone"):
        t.add_column(name, justify="right")
    for row in rows:
        t.add_row(
            str(row["batch"]),
            f"{row['clean_s']:.2f}",
            f"{row['poisoned_s']:.2f}",
            f"{row['poisoned_s'] / row['clean_s']:.2f}x",
            str(row["extra_passes"]),
            "yes" if row["failed"] and row["others_equal"] else "NO",
        )
    return t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="loragate-bench containment",
        description="W1 batches clean and with one request whose steps raise.",
    )
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--batches", default="16,64", help="batch sizes, separated by commas")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--fail-at", type=int, default=8, help="the failing request's token")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    # The engine logs each failure it pins, with its traceback: expected here. Put back after,
    # for a caller in the same process (the bench tests).
    engine_logger = logging.getLogger("engine")
    level = engine_logger.level
    engine_logger.setLevel(logging.CRITICAL)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    console = Console() if Console().is_terminal else Console(width=150)
    try:
        rows = run_containment_bench(
            args.model, batches, args.output_len, args.fail_at, args.repeat, console
        )
    finally:
        engine_logger.setLevel(level)
    console.print(table(rows, args.model, args.output_len, args.fail_at))
