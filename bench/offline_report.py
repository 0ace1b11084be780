"""The offline benchmark's report: the header (model, machine, threads, the matmul peak) and the
table of its rows (bench/offline.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.mfu import PEAK_SIZE


def print_header(
    console: Console,
    env: dict[str, Any],
    batch_size: int,
    output_len: int,
    block_size: int,
    seed: int,
) -> None:
    params = env["num_params"]
    console.print(
        f"[bold]{env['model_name']}[/] ({env['model']}), "
        f"{params / 1e6:.2f}M params, {env.get('dtype', '?')} on {env.get('device', '?')}\n"
        f"{env['cpu']}\n"
        f"torch {env['torch']}: {env['torch_threads']} threads; "
        f"{env['cpu_count']} cores ({env['cpu_affinity']} usable), "
        f"load average {env['loadavg_1m']:.2f} before the runs\n"
        f"batch {batch_size}, {output_len} output tokens, greedy, block {block_size}, "
        f"seed {seed}; KV {env.get('kv_bytes_per_token', 0):.0f} B/token, "
        f"pool {env.get('kv_pool_blocks', '?')} blocks; a {PEAK_SIZE}^3 matmul peaks at "
        f"{env.get('peak_flops', 0) / 1e9:.0f} GFLOP/s (the MFU columns' denominator)",
        highlight=False,
    )


def results_table(rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(title="offline throughput: ours vs HF generate")
    for name in (
        "workload",
        "ours tok/s",
        "HF tok/s",
        "ratio",
        "ours KV alloc/used",
        "HF KV alloc/used",
        "ours wall s",
        "HF wall s",
        "ours MFU",
        "HF MFU",
        "greedy match",
    ):
        table.add_column(name, justify="left" if name == "workload" else "right")

    def fmt(row: dict[str, Any], key: str, spec: str) -> str:
        value = row.get(key)
        return "-" if value is None else format(value, spec)

    for row in rows:
        if row.get("skipped"):
            table.add_row(row["workload"], "skipped", *[""] * 9)
            continue
        table.add_row(
            row["workload"],
            fmt(row, "ours_tok_s", ",.0f"),
            fmt(row, "hf_tok_s", ",.0f"),
            fmt(row, "ratio", ".2f") + ("x" if row.get("ratio") is not None else ""),
            fmt(row, "ours_kv_alloc_used", ".3f"),
            fmt(row, "hf_kv_alloc_used", ".3f"),
            fmt(row, "ours_wall_s", ".2f"),
            fmt(row, "hf_wall_s", ".2f"),
            fmt(row, "ours_mfu", ".1%"),
            fmt(row, "hf_mfu", ".1%"),
            fmt(row, "greedy_match", ".0%"),
        )
    return table
