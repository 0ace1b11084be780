"""The float32 linears' GEMM kernels side by side on this processor: our 16-column panels
(kernels/csrc/panel_linear.cpp), oneDNN's prepacked kernels and `F.linear` (MKL), at the demo
model's and SmolLM2's projection shapes, for a decode step (16 rows), one row, and a prompt
chunk.

    loragate-bench linears [--threads 1,2] [--cold] [--iters 50] [--shapes 16x256x512,...]

Each shape's weight is random; each kernel is timed over `--iters` calls after a warm-up, the
median kept. `--cold` writes 64 MiB between calls, so every call reads its weight from memory,
as a step does after the KV cache and the other layers' weights have passed through the caches.
The ratio column is oneDNN's time over the panels': above 1, the panels are faster.
`kernels.linear.packer` runs the panels where the kernels are built for AVX2 without AVX-512.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from kernels import cpu_features, linear, native

# rows x in x out: the demo model's q/k/v, o, gate/up, down and vocabulary projections, then
# SmolLM2-135M's; one row; prompt chunks of both.
Flush = torch.Tensor | None  # written between calls (--cold), or nothing

SHAPES = [
    (16, 256, 512),
    (16, 256, 256),
    (16, 256, 1024),
    (16, 512, 256),
    (16, 256, 8192),
    (16, 576, 960),
    (16, 576, 576),
    (16, 576, 3072),
    (16, 1536, 576),
    (16, 576, 49152),
    (1, 576, 3072),
    (512, 256, 1024),
    (256, 576, 3072),
]


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        rows, inputs, outputs = (int(n) for n in item.lower().split("x"))
        shapes.append((rows, inputs, outputs))
    return shapes


def timed(fn: Callable[[torch.Tensor], object], x: torch.Tensor, iters: int, flush: Flush) -> float:
    """Median microseconds a call of fn(x)."""
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.add_(1.0)
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(
    shape: tuple[int, int, int], iters: int, flush: Flush
) -> tuple[float, float | None, float]:
    """µs a call of F.linear, oneDNN's prepacked linear (None without oneDNN) and the panels."""
    rows, inputs, outputs = shape
    plain = torch.nn.Linear(inputs, outputs, bias=False)
    x = torch.randn(rows, inputs)
    iters = max(5, min(iters, int(4e9 / (rows * inputs * outputs))))
    with torch.inference_mode():
        mkl = timed(partial(F.linear, weight=plain.weight), x, iters, flush)
        panels = timed(linear.PanelLinear.reorder(plain), x, iters, flush)
        onednn = None
        if linear.available():
            onednn = timed(linear.OneDNNLinear.reorder(plain), x, iters, flush)
    return mkl, onednn, panels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loragate-bench linears", description=__doc__)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--cold", action="store_true", help="weights from memory each call")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--shapes", type=parse_shapes, default=SHAPES, help="rows x in x out, comma-separated"
    )
    args = parser.parse_args(argv)
    if not native.load():
        raise SystemExit("the CPU kernels do not build here: no panels to measure")
    console = Console()
    flush = torch.empty((64 << 20) // 4) if args.cold else None
    table = Table(
        title=f"float32 linears, µs a call ({'cold' if args.cold else 'hot'} weights); "
        f"{cpu_features.describe()}"
    )
    for column in ("threads", "rows x in x out", "F.linear", "oneDNN", "panels", "oneDNN/panels"):
        table.add_column(column, justify="right")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows, inputs, outputs in args.shapes:
            console.print(f"threads {threads}: {rows} x {inputs} x {outputs}", style="dim")
            mkl, onednn, panels = measure((rows, inputs, outputs), args.iters, flush)
            table.add_row(
                str(threads),
                f"{rows} x {inputs} x {outputs}",
                f"{mkl:,.0f}",
                "-" if onednn is None else f"{onednn:,.0f}",
                f"{panels:,.0f}",
                "-" if onednn is None else f"{onednn / panels:.2f}x",
            )
    console.print(table)


if __name__ == "__main__":
    main()
