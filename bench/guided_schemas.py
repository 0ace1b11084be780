"""Guided JSON on real-world schemas: what the engine refuses, and whether what it accepts
comes out valid.

    loragate-bench guided --schemas DIR [--model models/smollm2] [--max-tokens 300]
        [--limit N] [--threads N] [--json FILE]

Every `*.json` file in DIR is one schema (tests/data/schemas/ ships a set from SchemaStore).
Each is first compiled in the engine's own GrammarCache (the engine's limits and timeout):
a GuidedSpecError there is what the gateway answers with a 400. The accepted ones then run
as one batch through the offline engine, greedy, under `response_format`'s default
(strict) json_schema spec, with a fixed chat prompt per schema ("Write a JSON document for
the <file> configuration file that follows this schema." plus its title and description).
Each finished document is checked with `jsonschema` (the schema's own draft, its format
checker): a document that fails is a bug, listed with the keywords it breaks.

Outcomes: refused (400), finished and valid, finished and INVALID, ran out of tokens,
not checkable (the validator cannot resolve the schema, e.g. an external $ref), errors
(the request failed after it was accepted, or anything not a GuidedSpecError).

Then compile time p50/p95 over the accepted schemas (cold, one at a time; xgrammar's
tokenizer info is built once beforehand and not counted), and the guided run against an
unguided run of the same prompts, each prompt decoding exactly as many tokens as its guided
output did (ignore_eos): the same work, so the ratio of the median decode step is guided
decoding's per-step overhead.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.workloads import new_progress

DEFAULT_MODEL = "models/smollm2"
PROMPT = "Write a JSON document for the {name} configuration file that follows this schema."
OUTCOMES = ("refused", "valid", "INVALID", "length", "not checkable", "error")
OUTCOME_LABELS = {
    "refused": "refused with a 400",
    "valid": "finished and valid",
    "INVALID": "finished and INVALID",
    "length": "ran out of tokens",
    "not checkable": "not checkable",
    "error": "errors",
}


@dataclass(slots=True)
class SchemaResult:
    """One schema's way through the bench."""

    name: str
    size: int  # bytes of the file
    draft: str
    outcome: str = "error"
    reason: str = ""  # the refusal, the error, or the violated keywords
    compile_ms: float | None = None
    num_tokens: int = 0
    text: str = ""
    keywords: list[str] = field(default_factory=list)


def load_schemas(directory: Path, limit: int | None) -> list[tuple[str, Any, int]]:
    """(name, parsed schema, bytes) for each *.json file, sorted by name."""
    paths = sorted(directory.glob("*.json"))[:limit]
    if not paths:
        raise SystemExit(f"no *.json schemas in {directory}")
    return [(p.stem, json.loads(p.read_text(encoding="utf-8")), p.stat().st_size) for p in paths]


def schema_prompt(name: str, schema: Any) -> str:
    lines = [PROMPT.format(name=name)]
    if isinstance(schema, dict):
        for key in ("title", "description"):
            if isinstance(schema.get(key), str):
                lines.append(f"{key.capitalize()}: {schema[key].strip()[:300]}")
    return "\n".join(lines)


def refusal_group(message: str) -> str:
    """A refusal reason without what is particular to one schema (quoted names, numbers,
    paths), so that the same refusal in two schemas reads the same."""
    text = re.sub(r"'[^']{25,}'|\"[^\"]{25,}\"", "'…'", message)
    text = re.sub(r"(?<= at )\S+", "…", text)
    text = re.sub(r"\d+", "N", text)
    return text[:160]


def compile_all(engine: Any, schemas: list[tuple[str, Any, int]], progress: Any) -> list[Any]:
    """Compile each schema in the engine's GrammarCache, one at a time; return the specs of
    those it accepts (None for the refused), filling in each result's outcome."""
    from concurrent.futures import TimeoutError as FutureTimeout

    from engine.errors import GuidedSpecError
    from engine.request import GuidedSpec

    cache = engine.grammars
    cache._xgrammar_compiler()  # tokenizer info: once per engine, not part of any compile
    timeout = engine.config.guided_compile_timeout
    task = progress.add_task("compile", total=len(schemas))
    specs: list[Any] = []
    results = []
    for name, schema, size in schemas:
        result = SchemaResult(name, size, _draft(schema))
        spec = None
        t0 = time.perf_counter()
        try:
            spec = GuidedSpec(json_schema=schema)
            compiled = cache.submit(spec).result(timeout=timeout)
            if isinstance(compiled, Exception):
                raise compiled
            result.compile_ms = 1e3 * (time.perf_counter() - t0)
            result.outcome = ""  # decided by the run
        except FutureTimeout:
            spec = None
            result.outcome, result.reason = "refused", f"did not compile within {timeout:g} s"
        except ValueError as exc:  # GuidedSpecError, or a spec GuidedSpec itself rejects
            spec = None
            kind = "" if isinstance(exc, GuidedSpecError) else f"{type(exc).__name__}: "
            result.outcome, result.reason = "refused", kind + (str(exc) or "(no message)")
        except Exception as exc:  # noqa: BLE001 - any other type is a bug to report
            spec = None
            result.outcome, result.reason = "error", f"{type(exc).__name__}: {exc}"
        specs.append(spec)
        results.append(result)
        progress.advance(task)
    return list(zip(results, specs, strict=True))


def _draft(schema: Any) -> str:
    uri = schema.get("$schema", "") if isinstance(schema, dict) else ""
    found = re.search(r"draft-0?(\d+)|/(\d{4}-\d{2})/", uri)
    return (found.group(1) or found.group(2)) if found else "-"


def timed_generate(
    llm: Any, prompts: list[list[int]], params: list[Any], progress: Any, label: str
) -> tuple[list[Any], dict[str, float]]:
    """`llm.generate` with the median decode step: steps after every prompt was computed."""
    engine = llm.engine
    task = progress.add_task(label, total=len(prompts))
    decode: list[float] = []
    prefilled = False
    last = time.perf_counter()

    def on_step(num_finished: int) -> None:
        nonlocal prefilled, last
        now = time.perf_counter()
        if prefilled:
            decode.append(now - last)
        last = now
        sched = engine.scheduler
        prefilled = not sched.waiting and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running
        )
        progress.update(task, completed=num_finished)

    engine.kv.reset_prefix_cache()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, on_step=on_step)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return outputs, {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall if wall else 0.0,
        "decode_steps": len(decode),
        "decode_ms_per_step": 1e3 * statistics.median(decode) if decode else 0.0,
    }


def check_document(schema: Any, text: str) -> tuple[str, list[str], str]:
    """(outcome, violated keywords, first message) for a finished guided document."""
    import jsonschema
    from referencing.exceptions import Unresolvable

    from gateway.openai.guided_validation import schema_validator

    try:
        document = json.loads(text)
    except ValueError as exc:
        return "INVALID", ["json"], f"not JSON: {exc}"
    validator = schema_validator(schema)
    try:
        errors = list(validator.iter_errors(document))
    except (Unresolvable, jsonschema.exceptions.RefResolutionError) as exc:
        return "not checkable", [], f"{type(exc).__name__}: {exc}"[:300]
    if not errors:
        return "valid", [], ""
    best = jsonschema.exceptions.best_match(errors)
    where = "/" + "/".join(str(p) for p in best.absolute_path)
    keywords = sorted({str(e.validator) for e in errors})
    return "INVALID", keywords, f"{best.validator} at {where}: {best.message}"[:300]


def run_schema_bench(
    model_dir: str,
    schema_dir: Path,
    *,
    max_tokens: int,
    limit: int | None,
    num_threads: int | None,
    console: Console,
) -> dict[str, Any]:
    from engine.frontend.offline import LLM
    from engine.request import SamplingParams

    schemas = load_schemas(schema_dir, limit)
    by_name = {name: schema for name, schema, _ in schemas}
    with new_progress(console) as progress:
        task = progress.add_task("load", total=None)

        def on_tensor(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        llm = LLM(model=model_dir, progress=on_tensor, dtype="float32", num_threads=num_threads)
        compiled = compile_all(llm.engine, schemas, progress)
        accepted = [(r, s) for r, s in compiled if s is not None]
        guided_run: dict[str, float] = {}
        plain_run: dict[str, float] = {}
        if accepted:
            prompts = [llm.chat_prompt(schema_prompt(r.name, by_name[r.name])) for r, _ in accepted]
            params = [
                SamplingParams(temperature=0, max_tokens=max_tokens, guided=s) for _, s in accepted
            ]
            outputs, guided_run = timed_generate(llm, prompts, params, progress, "guided")
            counts = [max(1, len(o.outputs[0].token_ids)) for o in outputs]
            plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in counts]
            _, plain_run = timed_generate(llm, prompts, plain, progress, "unguided, same tokens")
            for (result, _), output in zip(accepted, outputs, strict=True):
                _classify(result, by_name[result.name], output)
    results = [r for r, _ in compiled]
    compile_ms = sorted(r.compile_ms for r in results if r.compile_ms is not None)
    return {
        "model": model_dir,
        "schemas_dir": str(schema_dir),
        "max_tokens": max_tokens,
        "counts": {o: sum(r.outcome == o for r in results) for o in OUTCOMES},
        "compile_ms_p50": _percentile(compile_ms, 50),
        "compile_ms_p95": _percentile(compile_ms, 95),
        "guided": guided_run,
        "unguided": plain_run,
        "overhead": (
            guided_run["decode_ms_per_step"] / plain_run["decode_ms_per_step"] - 1
            if plain_run.get("decode_ms_per_step")
            else None
        ),
        "schemas": [asdict(r) for r in results],
    }


def _classify(result: SchemaResult, schema: Any, request_output: Any) -> None:
    output = request_output.outputs[0]
    result.text = output.text
    result.num_tokens = len(output.token_ids)
    if output.finish_reason == "length":
        result.outcome = "length"
    elif output.finish_reason == "error":
        result.outcome, result.reason = "error", request_output.error or "finish_reason error"
    else:
        result.outcome, result.keywords, result.reason = check_document(schema, output.text)


def _percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    index = min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))
    return values[index]  # nearest rank


# -- tables --------------------------------------------------------------------------------


def outcome_table(result: dict[str, Any]) -> Table:
    total = len(result["schemas"])
    table = Table(
        title=f"{total} schemas, {Path(result['model']).name}, greedy, "
        f"{result['max_tokens']} tokens"
    )
    table.add_column("outcome")
    table.add_column("schemas", justify="right")
    for outcome in OUTCOMES:
        count = result["counts"][outcome]
        if count or outcome not in ("not checkable",):
            table.add_row(OUTCOME_LABELS[outcome], f"{count} ({count / total:.0%})")
    return table


def refusal_table(result: dict[str, Any]) -> Table:
    groups: dict[str, list[str]] = defaultdict(list)
    for row in result["schemas"]:
        if row["outcome"] == "refused":
            groups[refusal_group(row["reason"])].append(row["name"])
    table = Table(title="refusal reasons")
    table.add_column("reason")
    table.add_column("n", justify="right")
    table.add_column("schemas")
    for reason, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        table.add_row(reason, str(len(names)), ", ".join(names))
    return table


def detail_table(result: dict[str, Any], outcome: str, title: str) -> Table:
    table = Table(title=title)
    for name in ("schema", "draft", "tokens", "why"):
        table.add_column(name, justify="right" if name == "tokens" else "left")
    for row in result["schemas"]:
        if row["outcome"] == outcome:
            table.add_row(row["name"], row["draft"], str(row["num_tokens"]), row["reason"])
    return table


def speed_table(result: dict[str, Any]) -> Table:
    table = Table(title="accepted schemas: guided vs unguided, same prompts and token counts")
    for name in ("run", "decode ms/step", "overhead", "output tok/s", "tokens", "decode steps"):
        table.add_column(name, justify="left" if name == "run" else "right")
    base = result["unguided"]
    for name in ("unguided", "guided"):
        row = result[name]
        overhead = row["decode_ms_per_step"] / base["decode_ms_per_step"] - 1
        table.add_row(
            name,
            f"{row['decode_ms_per_step']:.2f}",
            f"{overhead:+.1%}" if name == "guided" else "-",
            f"{row['tok_s']:,.0f}",
            f"{row['tokens']:,}",
            str(row["decode_steps"]),
        )
    return table


def print_report(result: dict[str, Any], console: Console) -> None:
    console.print(outcome_table(result))
    if result["counts"]["refused"]:
        console.print(refusal_table(result))
    if result["counts"]["INVALID"]:
        console.print(detail_table(result, "INVALID", "finished and INVALID (bugs)"))
    for outcome in ("error", "not checkable"):
        if result["counts"][outcome]:
            console.print(detail_table(result, outcome, outcome))
    p50, p95 = result["compile_ms_p50"], result["compile_ms_p95"]
    if p50 is not None:
        console.print(f"compile ms over accepted schemas: p50 {p50:.1f}, p95 {p95:.1f}")
    if result["guided"] and result["unguided"].get("decode_ms_per_step"):
        console.print(speed_table(result))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loragate-bench guided",
        description="Every JSON schema in DIR through guided decoding: refused, valid, "
        "invalid, out of tokens; compile times; guided vs unguided decode.",
    )
    p.add_argument("--schemas", type=Path, required=True, metavar="DIR", help="*.json schemas")
    p.add_argument("--model", default=DEFAULT_MODEL, help="Hugging Face checkpoint directory")
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--limit", type=int, default=None, help="only the first N schemas by name")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    for flag in ("max_tokens", "limit", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            _parser().error(f"--{flag.replace('_', '-')} must be positive")
    if not args.schemas.is_dir():
        _parser().error(f"--schemas {args.schemas}: not a directory")
    import transformers

    transformers.logging.set_verbosity_error()
    console = Console() if Console().is_terminal else Console(width=150)
    result = run_schema_bench(
        args.model,
        args.schemas,
        max_tokens=args.max_tokens,
        limit=args.limit,
        num_threads=args.threads,
        console=console,
    )
    print_report(result, console)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        console.print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
