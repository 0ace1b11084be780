"""The triton kernels on a GPU: decode attention's achieved bandwidth, and a full decode step
at Llama-3-8B's shape against the HBM roofline, with and without 4 LoRA adapters.

Decode attention: one layer's paged decode (32 query heads, 8 KV heads, head_dim 128,
bfloat16, blocks of 16 scattered at random) for each batch x context; bytes = the K and V
of every row's context (queries, outputs and tables are noise), over the median time of
`--iters` launches (CUDA events), as GB/s and as a share of `--peak-gbps`.

Decode step: engine.models.llama at Llama-3-8B's shape (32 layers, hidden 4096, 32 heads,
8 KV heads, intermediate 14336, vocabulary 128256, bfloat16; random weights), every
triton kernel in, one decode token per row at `--step-context`, logits included. Its
roofline is the bytes a step must read (every weight once, the embedding rows aside, and
every row's KV in every layer) over the peak. Then again with 4 rank-16 adapters on
every projection, the rows spread evenly over them: their cost as a share of the step.
With `--cuda-graph` each step is also captured once and replayed (launch overhead out).

Targets: decode attention >= 70 % of peak at batch 64 x 2k; the step >= 60 % of its
roofline; 4 adapters <= 15 % of the step. `--toy` runs everything at toy shapes on the
CPU under triton's interpreter: a check that the script works, its figures meaningless.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from transformers import LlamaConfig

from engine.lora.manager import LoRAConfig, LoRAManager
from engine.lora.types import LoRARequest, LoRAWeights, llama_fused_targets
from engine.models.llama import LlamaForCausalLM
from kernels import dispatch
from kernels.attention import StepMetadata, build_triton_plan
from kernels.backend import Kernels
from kernels.triton_backend import TritonKernels

H200_PEAK_GBPS = 4800.0
BLOCK_SIZE = 16
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class Shapes:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    lora_rank: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA3_8B = Shapes(32, 4096, 32, 8, 14336, 128256, (1, 16, 64), (512, 2048, 8192), 16)
TOY = Shapes(2, 128, 4, 2, 256, 512, (1, 2), (24, 40), 4)


def timed(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median seconds of one call, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def random_step(batch: int, context: int, num_blocks: int, device: torch.device, seed: int):  # type: ignore[no-untyped-def]
    """A plan of `batch` decode rows at `context`, their blocks scattered over the pool."""
    per_row = -(-context // BLOCK_SIZE)
    perm = np.random.default_rng(seed).permutation(num_blocks)[: batch * per_row]
    tables = [perm[i * per_row : (i + 1) * per_row].tolist() for i in range(batch)]
    pos = context - 1
    slots = np.array([t[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for t in tables])
    lens = np.full(batch, context)
    step = StepMetadata(np.ones(batch, np.int64), lens, tables, slots, batch, BLOCK_SIZE)
    return build_triton_plan(step, device)


def bench_attention(s: Shapes, device: torch.device, iters: int, peak: float) -> list[list[str]]:
    ops = dispatch.triton_ops(device)
    rows = []
    d = s.head_dim
    for batch in s.batches:
        for context in s.contexts:
            num_blocks = batch * -(-context // BLOCK_SIZE) + 1
            shape = (s.kv_heads, num_blocks, BLOCK_SIZE, d)
            kc = torch.randn(shape, dtype=torch.bfloat16, device=device)
            vc = torch.randn(shape, dtype=torch.bfloat16, device=device)
            q = torch.randn(batch, s.heads, d, dtype=torch.bfloat16, device=device)
            plan = random_step(batch, context, num_blocks, device, batch + context)
            assert plan.paged is not None
            meta = plan.paged
            call = partial(ops.paged_attention, q, (kc, vc), meta, d**-0.5)
            seconds = timed(call, iters, device)
            nbytes = 2 * batch * context * s.kv_heads * d * 2
            gbps = nbytes / seconds / 1e9
            rows.append(
                [
                    str(batch),
                    str(context),
                    f"{seconds * 1e6:.1f}",
                    f"{gbps:.0f}",
                    f"{100 * gbps / peak:.1f}",
                ]
            )
            del call, kc, vc
    return rows


def build_model(s: Shapes, device: torch.device, max_len: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        intermediate_size=s.intermediate,
        vocab_size=s.vocab,
        max_position_embeddings=max_len,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config, max_len, kernels=triton_kernels(device))
    model.to(torch.bfloat16)
    model.rotary.to(torch.float32)
    model.eval()
    return model


def triton_kernels(device: torch.device) -> Kernels:
    return TritonKernels(dispatch.triton_ops(device), device)


def lora_manager(s: Shapes, config: Any, device: torch.device) -> LoRAManager:
    targets = llama_fused_targets(config)
    sizes = {name: (t.in_features, end - start) for t in targets for name, start, end in t.modules}

    def loader(request: LoRARequest) -> LoRAWeights:
        g = torch.Generator().manual_seed(int(request.name))
        r = s.lora_rank
        layers = [
            {
                m: (
                    torch.randn(r, sizes[m][0], generator=g) * 0.01,
                    torch.randn(sizes[m][1], r, generator=g) * 0.01,
                )
                for m in LORA_MODULES
            }
            for _ in range(s.layers)
        ]
        return LoRAWeights(request.adapter_id, r, 2.0, layers)

    manager = LoRAManager(
        targets,
        s.layers,
        LoRAConfig(max_loras=4, max_lora_rank=s.lora_rank, max_cpu_loras=4),
        loader=loader,
        kernels=triton_kernels(device),
        dtype=torch.bfloat16,
    )
    for i in range(4):
        manager.load_now(LoRARequest(str(i), "", f"bench-{i}"))
    return manager


def bench_step(
    s: Shapes,
    device: torch.device,
    iters: int,
    peak: float,
    batches: list[int],
    context: int,
    cuda_graph: bool,
) -> list[list[str]]:
    model = build_model(s, device, context + 1)
    manager = lora_manager(s, model.config, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= model.embed_tokens.weight.numel() * 2  # a step reads `batch` rows of it
    rows = []
    for batch in batches:
        num_blocks = batch * -(-context // BLOCK_SIZE) + 1
        shape = (s.kv_heads, num_blocks, BLOCK_SIZE, s.head_dim)
        caches = [
            (
                torch.randn(shape, dtype=torch.bfloat16, device=device),
                torch.randn(shape, dtype=torch.bfloat16, device=device),
            )
            for _ in range(s.layers)
        ]
        plan = random_step(batch, context, num_blocks, device, batch)
        ids = torch.randint(0, s.vocab, (batch,), device=device)
        pos = torch.full((batch,), context - 1, device=device)
        kv_bytes = 2 * batch * context * s.kv_heads * s.head_dim * 2 * s.layers
        roofline = (weight_bytes + kv_bytes) / (peak * 1e9)
        slots = np.repeat(np.arange(4), -(-batch // 4))[:batch]

        for label, lora in (("base", False), (f"4 x LoRA r{s.lora_rank}", True)):
            with torch.inference_mode():
                step = manager.step_context(slots) if lora else None
                fn = partial(decode_step, model, ids, pos, plan, caches, step)
                seconds = timed(fn, iters, device)
                graph_s = graph_seconds(fn, iters, device) if cuda_graph else None
            rows.append(
                [
                    str(batch),
                    label,
                    f"{seconds * 1e3:.2f}",
                    "-" if graph_s is None else f"{graph_s * 1e3:.2f}",
                    f"{roofline * 1e3:.2f}",
                    f"{100 * roofline / min(seconds, graph_s or seconds):.1f}",
                ]
            )
        del fn, caches
    return rows


def decode_step(model: LlamaForCausalLM, *inputs: Any) -> torch.Tensor:
    return model.compute_logits(model(*inputs))


def graph_seconds(fn: Callable[[], object], iters: int, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm: compile every kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, iters, device)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="loragate-bench kernels", description=__doc__.split("\n")[0])
    p.add_argument("--peak-gbps", type=float, default=H200_PEAK_GBPS, help="HBM peak (H200: 4800)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--step-batches", default="16,64", help="batches of the full decode step")
    p.add_argument("--step-context", type=int, default=2048)
    p.add_argument(
        "--cuda-graph", action="store_true", help="also replay each step as a CUDA graph"
    )
    p.add_argument("--toy", action="store_true", help="toy shapes on the CPU (interpreter)")
    args = p.parse_args(argv)
    console = Console(width=max(Console().width, 120))
    if args.toy:
        # The interpreter is triton's choice at import: this process asks for it before
        # anything loads the kernels (dispatch.triton_ops refuses without it).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, shapes, iters = torch.device("cpu"), TOY, 1
        batches, context = [2], 24
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench kernels needs a CUDA device (or --toy)")
        device, shapes, iters = torch.device("cuda"), LLAMA3_8B, args.iters
        batches, context = [int(b) for b in args.step_batches.split(",")], args.step_context
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    console.print(
        f"device: {name}; peak {args.peak_gbps:.0f} GB/s" + ("; TOY SHAPES" if args.toy else "")
    )

    table = Table(
        title=f"paged decode attention, one layer ({shapes.heads} heads, {shapes.kv_heads} KV "
        f"heads, head_dim {shapes.head_dim}, bf16)"
    )
    for column in ("batch", "context", "us", "GB/s", "% of peak"):
        table.add_column(column, justify="right")
    attention = bench_attention(shapes, device, iters, args.peak_gbps)
    for row in attention:
        table.add_row(*row)
    console.print(table)

    table = Table(
        title=f"decode step at context {context} ({shapes.layers} layers, hidden {shapes.hidden}, "
        "bf16, logits included)"
    )
    for column in ("batch", "adapters", "ms", "ms (graph)", "roofline ms", "% of roofline"):
        table.add_column(column, justify="right")
    steps = bench_step(shapes, device, iters, args.peak_gbps, batches, context, args.cuda_graph)
    for row in steps:
        table.add_row(*row)
    console.print(table)

    target = [r for r in attention if r[0] == "64" and r[1] == "2048"]
    console.print("targets:")
    if target:
        console.print(f"  decode attention at 64 x 2k: {target[0][4]} % of peak (target >= 70 %)")
    for base, lora in zip(steps[::2], steps[1::2], strict=True):
        best = [float(x) for x in (base[2], lora[2])]
        if base[3] != "-":
            best = [min(b, float(g)) for b, g in zip(best, (base[3], lora[3]), strict=True)]
        share = 100 * (best[1] - best[0]) / best[0]
        console.print(
            f"  batch {base[0]}: step {base[5]} % of roofline (target >= 60 %); "
            f"4 adapters +{share:.1f} % of the step (target <= 15 %)"
        )
    if args.toy:
        console.print("toy run: the figures above measure the interpreter, not a GPU")


if __name__ == "__main__":
    main()
