"""int8 (W8A8, smoothed) against the compute dtype, in one run: quality (perplexity on a
fixed text against float32's, greedy agreement) and W1 throughput.

    loragate-bench quantization --model models/smollm2 [--dtype auto] [--repeat 3]

Perplexity is our engine's own forward (the quantized linears, our attention and norms)
over `bench/data/perplexity.txt` in windows of `--window` tokens, each scored from its
second token on, for float32 (the reference every processor computes alike), the compute
dtype and int8. Agreement is the greedy chat answers of bench.agreement's questions, int8
against the unquantized engine: tokens equal before the first difference. Throughput is
W1 (64 prompts of 128 tokens, 64 output tokens, greedy) at the engine's default
concurrency and at 16 sequences, both engines alternating, the fastest of `--repeat` runs.
A second table times the first layer's four projections of each engine alone (the weights
hot in cache, as a layer's are not in a step) at decode and prefill row counts.
The quality gate (tests/kernels/test_quant.py): perplexity within 2 % of float32's.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.agreement import QUESTIONS
from bench.offline_ours import run_ours
from bench.workloads import make_workloads, new_progress
from kernels import cpu_features
from kernels.quant import Int8Linear

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


@torch.inference_mode()
def perplexity(llm: Any, token_ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) of every token after the first of each window,
    through our engine's own forward (its quantized linears, attention and norms)."""
    runner = llm.engine.runner
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        ids = token_ids[start : start + window]
        if len(ids) < 2:
            break
        hidden = runner.forward_prompt(ids)
        logprobs = torch.log_softmax(runner.model.compute_logits(hidden[:-1]), dim=-1)
        nll -= float(logprobs.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        count += len(ids) - 1
    return math.exp(nll / count)


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
# down_proj with its activation: silu(gate) * up then down, from the gate/up output (the int8
# engine computes the product inside down's quantization).
GATED_DOWN = "mlp.down_proj+silu"
LINEAR_ROWS = (16, 64, 2048)


@torch.inference_mode()
def projection_us(llm: Any, name: str, rows: int, repeat: int = 5) -> float:
    """Microseconds per call of layer 0's projection `name` on `rows` rows, on every core (as
    the engine runs steps of these sizes): the fastest of `repeat` timings of a few calls."""
    runner = llm.engine.runner
    call: Callable[[torch.Tensor], torch.Tensor]
    if name == GATED_DOWN:
        mlp = runner.model.layers[0].mlp
        x = torch.randn(rows, 2 * mlp.intermediate_size, dtype=runner.dtype)
        if isinstance(mlp.down_proj, Int8Linear):
            call = mlp.down_proj.forward_gated
        else:

            def call(gate_up: torch.Tensor) -> torch.Tensor:
                gate, up = gate_up.split(mlp.intermediate_size, dim=-1)
                return mlp.down_proj(F.silu(gate) * up)

    else:
        module = runner.model.layers[0].get_submodule(name)
        x = torch.randn(rows, module.in_features, dtype=runner.dtype)
        call = module
    calls = max(1, 4096 // rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(runner.prefill_threads)
    try:
        call(x)
        best = math.inf
        for _ in range(repeat):
            start = time.perf_counter()
            for _ in range(calls):
                call(x)
            best = min(best, (time.perf_counter() - start) / calls)
    finally:
        torch.set_num_threads(threads)
    return best * 1e6


def agreed_tokens(ours: list[list[int]], reference: list[list[int]]) -> list[int]:
    return [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), len(x))
        for x, y in zip(ours, reference, strict=True)
    ]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loragate-bench quantization", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64, help="greedy answer length")
    return p


@dataclass(slots=True)
class Measurements:
    """What the tables show: perplexity and greedy answers per engine, W1 tok/s of every run."""

    dtype: str  # the compute dtype `--dtype` resolved to
    num_text_tokens: int
    ppl_float32: float
    quality: dict[str, tuple[float, list[list[int]]]]  # engine label: (perplexity, answers)
    walls: dict[str, dict[str, list[float]]]  # engine label: {"seqs=N": tok/s of each run}


def load_engines(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    """The unquantized engine ("none") and the int8 one, in the compute dtype."""
    from engine import LLM

    engines: dict[str, Any] = {}
    for label, method in (("none", None), ("int8", "int8")):
        task = progress.add_task(f"load {label}", total=None)
        engines[label] = LLM(
            args.model,
            dtype=args.dtype,
            quantization=method,
            kv_cache_memory=1 << 30,
            max_model_len=2048,
        )
        progress.update(task, total=1, completed=1)
    return engines


def measure(
    args: argparse.Namespace, engines: dict[str, Any], console: Console, progress: Progress
) -> Measurements:
    """Perplexity (float32's, then each engine's), greedy answers, then W1 throughput with the
    engines alternating, `--repeat` times at each concurrency."""
    from engine import LLM, SamplingParams

    base = engines["none"]
    dtype = str(base.engine.runner.dtype).removeprefix("torch.")
    console.print(f"{Path(args.model).name}, {dtype}; {cpu_features.describe()}")
    tokenizer = base.tokenizer
    text_ids = tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    task = progress.add_task("float32 perplexity", total=None)
    reference = LLM(args.model, dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048)
    ppl_float32 = perplexity(reference, text_ids, args.window)
    del reference
    progress.update(task, total=1, completed=1)
    prompts = [base.chat_prompt(q) for q in QUESTIONS]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    vocab = len(tokenizer)
    special = tokenizer.all_special_ids
    (w1,) = make_workloads(["w1"], vocab, special, num_prompts=64, seed=0)
    quality: dict[str, tuple[float, list[list[int]]]] = {}
    for label, llm in engines.items():
        answers = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        quality[label] = (perplexity(llm, text_ids, args.window), answers)
    walls: dict[str, dict[str, list[float]]] = {label: {} for label in engines}
    for _ in range(args.repeat):
        for label, llm in engines.items():
            for seqs in (llm.engine.config.max_num_seqs, 16):
                llm.engine.scheduler.max_num_seqs = seqs
                row = run_ours(llm, w1, 64, progress, f"{label} w1 seqs={seqs}")
                walls[label].setdefault(f"seqs={seqs}", []).append(row["tok_s"])
            llm.engine.scheduler.max_num_seqs = llm.engine.config.max_num_seqs
    return Measurements(dtype, len(text_ids), ppl_float32, quality, walls)


def quality_table(measured: Measurements, max_tokens: int) -> Table:
    dtype, num_tokens = measured.dtype, measured.num_text_tokens
    table = Table(title=f"int8 weights vs {dtype}: {num_tokens} tokens of perplexity text")
    for col in ("weights", "perplexity", "vs float32", "vs " + dtype, "greedy tokens agreed (mean)",
                "W1 tok/s", "vs " + dtype, "W1 seqs=16 tok/s", "vs " + dtype):  # fmt: skip
        table.add_column(col, justify="right")
    ppl_float32 = measured.ppl_float32
    ppl0, answers0 = measured.quality["none"]
    best = {label: {k: max(v) for k, v in runs.items()} for label, runs in measured.walls.items()}
    keys = list(best["none"])
    table.add_row("float32", f"{ppl_float32:.3f}", "", f"{ppl_float32 / ppl0 - 1:+.2%}", *[""] * 5)
    for label in measured.quality:
        ppl, answers = measured.quality[label]
        agreed = agreed_tokens(answers, answers0)
        table.add_row(
            dtype if label == "none" else "int8",
            f"{ppl:.3f}",
            f"{ppl / ppl_float32 - 1:+.2%}",
            f"{ppl / ppl0 - 1:+.2%}",
            f"{statistics.mean(agreed):.1f} of {max_tokens}",
            f"{best[label][keys[0]]:.0f}",
            f"{best[label][keys[0]] / best['none'][keys[0]]:.2f}x",
            f"{best[label][keys[1]]:.0f}",
            f"{best[label][keys[1]] / best['none'][keys[1]]:.2f}x",
        )
    return table


def projections_table(engines: dict[str, Any], dtype: str) -> Table:
    """Layer 0's projections of both engines side by side, each timed as its row is filled."""
    linears = Table(title="layer 0's projections alone (us per call, all cores)")
    for col in ("projection", "rows", dtype, "int8", "vs " + dtype):
        linears.add_column(col, justify="right")
    for name in (*PROJECTIONS, GATED_DOWN):
        for rows in LINEAR_ROWS:
            base_us, int8_us = (projection_us(engines[k], name, rows) for k in ("none", "int8"))
            linears.add_row(
                name.rsplit(".", 1)[-1], str(rows), f"{base_us:.0f}", f"{int8_us:.0f}",
                f"{base_us / int8_us:.2f}x",
            )  # fmt: skip
    return linears


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    console = Console(width=max(Console().width, 120))
    with new_progress(console) as progress:
        engines = load_engines(args, progress)
        measured = measure(args, engines, console, progress)
    console.print(quality_table(measured, args.max_tokens))
    console.print(projections_table(engines, measured.dtype))
    console.print(
        "throughput runs (tok/s): "
        + "; ".join(
            f"{label} {k}: " + " ".join(f"{v:.0f}" for v in runs[k])
            for label, runs in measured.walls.items()
            for k in runs
        )
    )


if __name__ == "__main__":
    main()
