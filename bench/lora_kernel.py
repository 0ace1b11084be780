"""Multi-LoRA op cost against the linears it rides on, one decoder layer of a real shape.

    python -m bench.lora_kernel [--dtype bfloat16|float32] [--iters 20] [--threads N]
        [--hidden 576 --intermediate 1536 --heads 9 --kv-heads 3]   (SmolLM2-135M's layer)

For each step shape (prompt runs, decode rows over 1 to 64 adapters, a mixed step) it times,
in one process and one loop of alternating rounds: the layer's four fused linears
(q/k/v, o, gate/up, down) as `F.linear`, the C++ op (`add_lora_sgmv`) over the same rows,
and the torch specification (`kernels.lora.add_lora`, a group per slot). The table gives
milliseconds per layer and the LoRA/linear ratio: an adapter adds a few percent of a
layer's FLOPs, so a ratio near that is the goal (issue 40 measured 3.6x before the pool).
Adapters are drawn from ranks {8, 16, 32, 64} (or --rank), all-linear, in one
LoRAManager pool, as the engine holds them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from bench.workloads import new_progress
from engine.lora.manager import LoRAConfig, LoRAManager
from engine.lora.types import LORA_TARGETS, LoRARequest, LoRAWeights, llama_fused_targets
from kernels import native
from kernels.backend import Kernels, LoRAStep
from kernels.native_backend import NativeKernels
from kernels.torch_backend import TorchKernels

# (name, prompt runs' lengths, decode rows, distinct adapters)
SHAPES = [
    ("prefill 16x128, 4 adapters", [128] * 16, 0, 4),
    ("prefill 4x512, 4 adapters", [512] * 4, 0, 4),
    ("decode 64, 1 adapter", [], 64, 1),
    ("decode 64, 8 adapters", [], 64, 8),
    ("decode 64, 40 adapters", [], 64, 40),
    ("decode 64, 64 adapters", [], 64, 64),
    ("mixed 48 decode/40 + 2x128", [128, 128], 48, 40),
]


def build_manager(
    config: Any, ranks: list[int], dtype: torch.dtype, kernels: Kernels
) -> LoRAManager:
    targets = llama_fused_targets(config)
    sizes = {n: (t.in_features, end - start) for t in targets for n, start, end in t.modules}

    def loader(request: LoRARequest) -> LoRAWeights:
        g = torch.Generator().manual_seed(int(request.name))
        r = ranks[int(request.name)]
        layer = {
            m: (
                torch.randn(r, sizes[m][0], generator=g) * 0.02,
                torch.randn(sizes[m][1], r, generator=g) * 0.02,
            )
            for m in LORA_TARGETS
        }
        return LoRAWeights(request.adapter_id, r, 2.0, [layer])

    manager = LoRAManager(
        targets,
        1,
        LoRAConfig(max_loras=len(ranks), max_lora_rank=max(ranks), max_cpu_loras=0),
        loader=loader,
        kernels=kernels,
        dtype=dtype,
    )
    for i in range(len(ranks)):
        manager.load_now(LoRARequest(str(i), "", f"bench-{i}"))
    return manager


def token_slots(prompts: list[int], decode: int, adapters: int, seed: int) -> np.ndarray:
    """Decode rows first, then prompts; rows ordered by slot as the model runner orders them."""
    rng = np.random.default_rng(seed)
    decode_slots = np.sort(rng.integers(0, adapters, size=decode)).astype(np.int64)
    if adapters <= decode:  # every adapter present at least once
        decode_slots[:adapters] = np.arange(adapters)
        decode_slots.sort()
    prompt_slots = [np.full(n, i % adapters, dtype=np.int64) for i, n in enumerate(prompts)]
    prompt_slots.sort(key=lambda a: int(a[0]))
    return np.concatenate([decode_slots, *prompt_slots]).astype(np.int64)


def time_it(fn: Callable[[], None], iters: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def measure(
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    weights: list[torch.Tensor],
    steps: dict[str, LoRAStep | None],
    iters: int,
) -> dict[str, float]:
    """Seconds per layer: the four linears, then each LoRA path over the same rows."""

    def linears() -> None:
        for x, w in zip(xs, weights, strict=True):
            F.linear(x, w)

    def lora(step: LoRAStep | None) -> Callable[[], None]:
        assert step is not None

        def run() -> None:
            for t, (x, y) in enumerate(zip(xs, ys, strict=True)):
                step.apply(0, t, x, y)

        return run

    timed = {"linears": time_it(linears, iters)}
    for label, step in steps.items():
        timed[label] = time_it(lora(step), iters)
    return timed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="loragate-bench lora-kernel", description=__doc__.split("\n")[0]
    )
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rank", type=int, default=None, help="one rank for every adapter")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--shapes", default=None, help="comma-separated indices into the shape list")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native.load():
        raise SystemExit("the C++ kernels could not be built here")
    dtype = getattr(torch, args.dtype)
    config = SimpleNamespace(
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
    )
    num_adapters = max(s[3] for s in SHAPES)
    rng = np.random.default_rng(0)
    ranks = [args.rank or int(rng.choice([8, 16, 32, 64])) for _ in range(num_adapters)]
    targets = llama_fused_targets(config)
    g = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(t.out_features, t.in_features, generator=g) * 0.02).to(dtype) for t in targets
    ]
    cpu = torch.device("cpu")
    ours = build_manager(config, ranks, dtype, NativeKernels(cpu, dtype, config.head_dim, 16))
    spec = build_manager(config, ranks, dtype, TorchKernels(cpu))
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]

    console = Console()
    results: dict[str, dict[str, list[float]]] = {name: {} for name, *_ in shapes}
    with new_progress(console) as progress:
        task = progress.add_task("rounds x shapes", total=args.rounds * len(shapes))
        for round_ in range(args.rounds):
            for name, prompts, decode, adapters in shapes:
                slots = token_slots(prompts, decode, adapters, seed=round_)
                n = len(slots)
                xs = [torch.randn(n, t.in_features, generator=g).to(dtype) for t in targets]
                ys = [torch.zeros(n, t.out_features, dtype=dtype) for t in targets]
                steps = {"C++": ours.step_context(slots), "torch spec": spec.step_context(slots)}

                timed = measure(xs, ys, weights, steps, args.iters)
                for label, seconds in timed.items():
                    results[name].setdefault(label, []).append(seconds)
                progress.advance(task)

    table = Table(
        title=f"multi-LoRA per decoder layer, {args.dtype}, {torch.get_num_threads()} threads"
    )
    for column in (
        "step",
        "rows",
        "linears ms",
        "C++ LoRA ms",
        "C++ / linears",
        "torch spec ms",
        "C++ vs spec",
    ):
        table.add_column(column, justify="right" if column != "step" else "left")
    for name, prompts, decode, _ in shapes:
        best = {label: min(v) for label, v in results[name].items()}
        table.add_row(
            name,
            str(sum(prompts) + decode),
            f"{1e3 * best['linears']:.3f}",
            f"{1e3 * best['C++']:.3f}",
            f"{best['C++'] / best['linears']:.2f}x",
            f"{1e3 * best['torch spec']:.3f}",
            f"{best['torch spec'] / best['C++']:.2f}x faster",
        )
    console.print(table)
    per_rank = sum(t.in_features + end - start for t in targets for _, start, end in t.modules)
    flops = sum(r * per_rank for r in ranks)
    base = sum(t.in_features * t.out_features for t in targets)
    console.print(
        f"ranks {sorted(set(ranks))} (mean {statistics.mean(ranks):.0f}): an adapter adds "
        f"{100 * flops / len(ranks) / base:.1f} % of the layer's multiply-adds on average"
    )
