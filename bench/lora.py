"""Multi-LoRA throughput: W3 (W1 round-robin over adapters) vs base-only W1, and vs peft.

    python -m bench.lora --model DIR [--num-adapters 4] [--rank 8] [--num-prompts 64]
        [--output-len 64] [--repeat 2] [--batch-size 16] [--skip-peft]
        [--cold-load-model DIR] [--adapters-dir DIR] [--json FILE]

One process, one run, ratios: our engine runs base-only W1 and W3 on the same
prompts (every prompt at once, continuous batching, `max_loras` = the number of
adapters); peft runs W3 in static left-padded batches of `batch_size` with one
adapter per row (`generate(adapter_names=...)`). The adapters are real PEFT
adapters built by peft (`adapters.demo`), all-linear, at `--rank`.

Cold load: the time from an adapter's files on disk to its weights in a device
slot (read, validate, hash-check, copy), at ranks 8 and 16, on
`--cold-load-model` (SmolLM2-135M in docs/performance.md); median of 9 adapters each, one engine,
after an untimed first load.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.hf_baseline import build_hf, run_hf
from bench.workloads import Workload, best_of, make_workloads, new_progress


def build_adapters(model_dir: str, out_dir: Path, count: int, rank: int) -> list[Path]:
    from adapters.demo import build_demo_adapter

    return [
        build_demo_adapter(model_dir, out_dir / f"r{rank}-{i}", rank=rank, targets="all", seed=i)
        for i in range(count)
    ]


def run_ours(
    llm: Any,
    prompts: list[list[int]],
    loras: list[Any],
    output_len: int,
    label: str,
    progress: Progress,
    repeat: int,
) -> dict[str, Any]:
    from engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    def once(lbl: str) -> dict[str, Any]:
        task = progress.add_task(lbl, total=len(prompts))
        steps = 0

        def on_step(num_finished: int) -> None:
            nonlocal steps
            steps += 1
            progress.update(task, completed=num_finished)

        llm.engine.kv.reset_prefix_cache()
        gc.collect()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras, on_step=on_step)
        wall = time.perf_counter() - t0
        num_out = sum(len(o.outputs[0].token_ids) for o in outs)
        return {
            "wall_s": wall,
            "tok_s": num_out / wall,
            "ms_per_step": 1e3 * wall / steps,
            "token_ids": [o.outputs[0].token_ids for o in outs],
        }

    return best_of(once, label, repeat)


def run_peft(
    model_dir: str,
    adapter_dirs: list[Path],
    workload: Workload,
    names: list[str],
    output_len: int,
    batch_size: int,
    progress: Progress,
    repeat: int,
) -> dict[str, Any]:
    """peft's mixed-adapter generate: static batches, one adapter per row, round-robin."""
    import torch
    from peft import PeftModel

    base, tokenizer = build_hf(model_dir, torch.device("cpu"), progress)
    model = PeftModel.from_pretrained(base, str(adapter_dirs[0]), adapter_name=names[0])
    for name, path in zip(names[1:], adapter_dirs[1:], strict=True):
        model.load_adapter(str(path), adapter_name=name)
    model.eval()
    row_names = [names[i % len(names)] for i in range(len(workload.prompts))]
    return run_hf(
        model,
        tokenizer,
        workload,
        batch_size,
        output_len,
        progress,
        repeat,
        label="w3 peft",
        batch_kwargs=lambda rows: {"adapter_names": row_names[rows]},
    )


def cold_load_ms(model_dir: str, work_dir: Path, ranks: tuple[int, ...], count: int = 9) -> dict:
    """Per rank, the median ms from PEFT files on disk to weights in a device slot:
    read, validate, hash-check, pack, install. One engine; one untimed load first."""
    from adapters.demo import build_demo_adapter, clone_adapter
    from adapters.peft import describe_base
    from adapters.registry import AdapterRegistry
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    registry = AdapterRegistry(describe_base(model_dir), max_lora_rank=max(ranks))
    config = EngineConfig(
        model=model_dir,
        max_model_len=1024,
        num_kv_blocks=64,
        max_loras=count + 1,
        max_cpu_loras=count + 1,
        max_lora_rank=max(ranks),
    )
    engine = LLMEngine(config, lora_loader=registry.load)
    lora_manager = engine.lora
    assert lora_manager is not None
    result = {}
    for rank in ranks:
        first = build_demo_adapter(
            model_dir, work_dir / f"cold-r{rank}", rank=rank, targets="all", seed=0
        )
        lora_manager.load_now(registry.register(first.name, first))  # warm-up, untimed
        times = []
        for i in range(count):
            path = work_dir / f"cold-r{rank}-{i}"
            clone_adapter(first, path, seed=100 + i)
            lora = registry.register(path.name, path)
            t0 = time.perf_counter()
            lora_manager.load_now(lora)
            times.append(1e3 * (time.perf_counter() - t0))
        for name in registry.names():  # free the slots for the next rank
            lora_manager.unload(registry.unregister(name).adapter_id)
        result[rank] = statistics.median(times)
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loragate-bench lora",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="peft static batch size")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument("--cold-load-model", default=None, help="model for the cold-load timing")
    p.add_argument("--adapters-dir", type=Path, default=None, help="keep the built adapters here")
    p.add_argument("--json", type=Path, default=None)
    return p


def measure_throughput(
    args: argparse.Namespace, adapter_dirs: list[Path], progress: Progress
) -> dict[str, dict[str, Any]]:
    """The throughput rows: ours on base-only W1 and on W3, then peft on W3 (unless
    --skip-peft). Our engine lives only in here, so its KV cache is gone once this returns."""
    from adapters.peft import describe_base
    from adapters.registry import AdapterRegistry
    from engine.frontend.offline import LLM

    registry = AdapterRegistry(describe_base(args.model), max_lora_rank=max(16, args.rank))
    names = [d.name for d in adapter_dirs]
    loras = [registry.register(n, d) for n, d in zip(names, adapter_dirs, strict=True)]
    llm = LLM(
        args.model,
        lora_loader=registry.load,
        max_loras=args.num_adapters,
        max_lora_rank=max(16, args.rank),
        dtype="float32",
    )
    vocab = llm.engine.vocab_size
    special = list(llm.tokenizer.all_special_ids)
    (w1,) = make_workloads(["w1"], vocab, special, num_prompts=args.num_prompts, seed=args.seed)
    prompts = w1.prompts
    w3_loras = [loras[i % len(loras)] for i in range(len(prompts))]
    # Warm up both paths (and load every adapter) outside the timed runs.
    warm = make_workloads(["w1"], vocab, special, num_prompts=8, seed=args.seed + 1)
    run_ours(llm, warm[0].prompts, [None] * 8, 8, "warmup", progress, 1)
    warm_loras = [loras[i % len(loras)] for i in range(8)]  # --num-prompts may be under 8
    run_ours(llm, warm[0].prompts, warm_loras, 8, "warmup", progress, 1)

    rows: dict[str, dict[str, Any]] = {}
    rows["w1 base"] = run_ours(
        llm, prompts, [None] * len(prompts), args.output_len, "w1 base", progress, args.repeat
    )
    rows["w3"] = run_ours(llm, prompts, w3_loras, args.output_len, "w3", progress, args.repeat)
    if not args.skip_peft:
        rows["w3 peft"] = run_peft(
            args.model,
            adapter_dirs,
            w1,
            names,
            args.output_len,
            args.batch_size,
            progress,
            args.repeat,
        )
    return rows


def results_table(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> Table:
    table = Table(
        title=f"multi-LoRA, {args.num_adapters} adapters r{args.rank} all-linear, "
        f"{args.num_prompts} x 128 in / {args.output_len} out"
    )
    for col in ("run", "tok/s", "ms/step", "vs w1 base", "vs peft"):
        table.add_column(col, justify="left" if col == "run" else "right")
    base, peft = rows["w1 base"]["tok_s"], rows.get("w3 peft", {}).get("tok_s")
    for name, row in rows.items():
        ms = row.get("ms_per_step")
        table.add_row(
            name,
            f"{row['tok_s']:.0f}",
            f"{ms:.1f}" if ms else "",
            f"{row['tok_s'] / base:.2f}x",
            f"{row['tok_s'] / peft:.2f}x" if peft else "",
        )
    return table


def print_report(
    console: Console,
    args: argparse.Namespace,
    rows: dict[str, dict[str, Any]],
    cold: dict[int, float],
) -> None:
    console.print(results_table(args, rows))
    if "w3 peft" in rows:
        ours, theirs = rows["w3"]["token_ids"], rows["w3 peft"]["token_ids"]
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        console.print(f"w3 greedy outputs equal to peft's: {same}/{len(ours)}")
    for rank, ms in cold.items():
        console.print(f"cold load r{rank} on {args.cold_load_model}: {ms:.1f} ms (median of 9)")


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    console = Console()
    work = args.adapters_dir or Path(tempfile.mkdtemp(prefix="loragate-bench-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    with new_progress(console) as progress:
        task = progress.add_task("build adapters", total=None)
        adapter_dirs = build_adapters(args.model, work, args.num_adapters, args.rank)
        progress.update(task, completed=1, total=1)
        rows = measure_throughput(args, adapter_dirs, progress)
        cold: dict[int, float] = {}
        if args.cold_load_model:
            # The throughput engine and its KV cache (2 GiB by default) went with
            # measure_throughput's frame; collected here, so that the cold loads get a fresh
            # engine in a process that holds nothing else.
            gc.collect()
            progress.add_task("cold loads r8, r16", total=None)
            cold = cold_load_ms(args.cold_load_model, work, (8, 16))
    print_report(console, args, rows, cold)
    if args.json:
        out = {k: {m: v for m, v in r.items() if m != "token_ids"} for k, r in rows.items()}
        args.json.write_text(json.dumps({"rows": out, "cold_load_ms": cold}, indent=2))


if __name__ == "__main__":
    main()
