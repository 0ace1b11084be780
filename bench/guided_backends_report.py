"""bench/guided_backends.py's report: the per-schema table, refusals and warnings, every
disagreement with `jsonschema`, and the totals (also the JSON file's summary)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from bench.guided_backends_compare import SchemaRow


def _percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


def summary(rows: list[SchemaRow], names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"schemas": len(rows)}
    for name in names:
        results = [r.backends[name] for r in rows]
        compile_ms = [b.compile_ms for b in results if b.compile_ms is not None]
        mask_us = [t for b in results for t in b.mask_us]
        wrong = [w for b in results for w in b.wrong_accepts]
        out[name] = {
            "accepted": sum(b.accepted for b in results),
            "compile_ms_p50": _percentile(compile_ms, 50),
            "compile_ms_p95": _percentile(compile_ms, 95),
            "compile_ms_max": max(compile_ms, default=None),
            "mask_us_p50": _percentile(mask_us, 50),
            "mask_us_p95": _percentile(mask_us, 95),
            "documents_checked": sum(
                r.num_valid + r.num_invalid for r in rows if r.backends[name].accepted
            ),
            "wrong_accepts": len(wrong),
            "wrong_accepts_silent": sum(not w.get("end_checked") for w in wrong),
            "wrong_rejects": sum(len(b.wrong_rejects) for b in results),
            "mask_mismatches": sum(b.mask_mismatches for b in results),
        }
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def schema_table(rows: list[SchemaRow], names: list[str]) -> Table:
    table = Table(title="per schema: compile, and disagreements with jsonschema")
    table.add_column("schema")
    table.add_column("docs ok/bad", justify="right")
    for name in names:
        short = "xgr" if name == "xgrammar" else "llg"
        table.add_column(f"{short} ms", justify="right")
        table.add_column(f"{short} wrong acc", justify="right")
        table.add_column(f"{short} wrong rej", justify="right")
    for row in rows:
        cells = [row.name, f"{row.num_valid}/{row.num_invalid}"]
        for name in names:
            b = row.backends[name]
            if not b.accepted:
                cells += ["refused", "-", "-"]
                continue
            silent = sum(not w.get("end_checked") for w in b.wrong_accepts)
            ended = len(b.wrong_accepts) - silent
            acc = str(silent) + (f" (+{ended} end-checked)" if ended else "")
            cells += [_ms(b.compile_ms), acc, str(len(b.wrong_rejects))]
        table.add_row(*cells)
    return table


def totals_table(total: dict[str, Any], names: list[str]) -> Table:
    table = Table(title=f"totals over {total['schemas']} schemas")
    table.add_column("")
    for name in names:
        table.add_column(name, justify="right")
    rows = [
        ("schemas accepted", lambda t: f"{t['accepted']} of {total['schemas']}"),
        (
            "compile ms p50 / p95 / max",
            lambda t: " / ".join(
                _ms(t[k]) for k in ("compile_ms_p50", "compile_ms_p95", "compile_ms_max")
            ),
        ),
        (
            "mask µs per token p50 / p95",
            lambda t: f"{_ms(t['mask_us_p50'])} / {_ms(t['mask_us_p95'])}",
        ),
        ("documents checked", lambda t: str(t["documents_checked"])),
        ("wrongly ACCEPTED (silent)", lambda t: str(t["wrong_accepts_silent"])),
        (
            "wrongly accepted, end-checked",
            lambda t: str(t["wrong_accepts"] - t["wrong_accepts_silent"]),
        ),
        ("wrongly rejected", lambda t: str(t["wrong_rejects"])),
        ("mask vs matcher mismatches", lambda t: str(t["mask_mismatches"])),
    ]
    for title, cell in rows:
        table.add_row(title, *[cell(total[name]) for name in names])
    return table


def print_report(rows: list[SchemaRow], names: list[str], console: Console) -> dict[str, Any]:
    console.print(schema_table(rows, names))
    refusals = Table(title="refusals and warnings")
    for column in ("schema", "backend", "refused because / warns"):
        refusals.add_column(column)
    for row in rows:
        for name in names:
            b = row.backends[name]
            if not b.accepted:
                refusals.add_row(row.name, name, b.reason[:240])
            for warning in b.warnings:
                refusals.add_row(row.name, name, f"warning: {warning[:230]}")
    if refusals.row_count:
        console.print(refusals)
    wrong = Table(title="disagreements: document, keywords the validator reports")
    for column in ("schema", "backend", "verdict", "document", "keywords"):
        wrong.add_column(column)
    for row in rows:
        for name in names:
            b = row.backends[name]
            for w in b.wrong_accepts:
                verdict = "accepted, end-checked" if w.get("end_checked") else "ACCEPTED"
                wrong.add_row(row.name, name, verdict, w["document"], ", ".join(w["keywords"]))
            for w in b.wrong_rejects:
                wrong.add_row(row.name, name, "rejected", w["document"], "(valid)")
    if wrong.row_count:
        console.print(wrong)
    total = summary(rows, names)
    console.print(totals_table(total, names))
    return total
