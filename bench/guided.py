"""Guided decoding's cost: W1 unguided vs W1 under a JSON schema, one engine, one process.

    python -m bench.guided --model DIR [--num-prompts 64] [--output-len 64] [--repeat 1]
        [--seed 0] [--threads N] [--json FILE]

Both runs decode W1 (prompts of 128 random token ids, greedy, exactly `output_len` new
tokens each: ignore_eos, and a schema whose shortest document is longer than that, so the
grammar never ends a request early). The guided run puts every request under the schema:
one bitmask filled for all rows each step, applied to the logits, one matcher advanced per
token. The figures are the median decode step (steps after every prompt is computed:
prefill excluded) and output tok/s; overhead is guided over unguided step; "mask ms" is
the time per step of filling and applying the bitmask. With --repeat N the two alternate N
times and each keeps its fastest.

Then grammar compile times for a few specs: cold (a fresh GrammarCache: xgrammar compile
plus our schema checks) and cached (a hit in the LRU). The first compile of an engine also
builds xgrammar's tokenizer info, shown on its own row.

`--schemas DIR` is another mode (bench/guided_schemas.py): every JSON schema in a directory
through guided decoding, and what comes out (refused, valid, invalid, out of tokens).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.workloads import make_workloads, new_progress

DTYPE = "float32"

# Every request writes a catalog of at least 64 items of several tokens each: no request can
# finish the document within a few hundred output tokens, so both runs decode the same count.
CATALOG = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000},
                    "tags": {"type": "array", "items": {"enum": ["new", "sale", "used"]}},
                    "in_stock": {"type": "boolean"},
                },
                "required": ["name", "price", "in_stock"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
    },
    "required": ["name", "age"],
}


def compile_specs() -> list[tuple[str, Any]]:
    from engine.request import GuidedSpec

    return [
        ("json schema: person", GuidedSpec(json_schema=PERSON)),
        ("json schema: catalog", GuidedSpec(json_schema=CATALOG)),
        ("json object", GuidedSpec(json_object=True)),
        ("regex: date", GuidedSpec(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")),
        ("choice: 100 strings", GuidedSpec(choice=tuple(f"option {i}" for i in range(100)))),
        ("grammar: arithmetic", GuidedSpec(grammar=ARITHMETIC)),
    ]


ARITHMETIC = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""


class _BitmaskTimer:
    """Adds up the seconds the sampler's GrammarBitmask.apply takes, over the steps it masks."""

    def __init__(self, llm: Any) -> None:
        self.bitmask = llm.engine.runner.sampler.grammar_bitmask
        self.seconds = 0.0
        self.calls = 0
        real = self.bitmask.apply

        def timed(logits: torch.Tensor, requests: Any) -> None:
            t0 = time.perf_counter()
            real(logits, requests)
            self.seconds += time.perf_counter() - t0
            self.calls += 1

        self.bitmask.apply = timed

    def remove(self) -> None:
        del self.bitmask.apply  # back to the class's method

    @property
    def ms_per_call(self) -> float:
        return 1e3 * self.seconds / self.calls if self.calls else 0.0


def run_once(
    llm: Any, prompts: list[list[int]], params: Any, progress: Progress, label: str
) -> dict[str, Any]:
    """One timed `generate`. A step counts as decode when, before it, every request had its
    prompt computed: those steps' times give decode ms/step, free of prefill."""
    engine = llm.engine
    engine.kv.reset_prefix_cache()
    task = progress.add_task(label, total=len(prompts))
    step_times: list[float] = []
    decode_times: list[float] = []
    prefilled = False  # was every prompt computed before the step that just ran?
    last = 0.0

    def on_step(num_finished: int) -> None:
        nonlocal prefilled, last
        now = time.perf_counter()
        step_times.append(now - last)
        if prefilled:
            decode_times.append(now - last)
        last = now
        sched = engine.scheduler
        prefilled = not sched.waiting and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running
        )
        progress.update(task, completed=num_finished)

    gc.collect()
    timer = _BitmaskTimer(llm)
    last = t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, on_step=on_step)
    wall = time.perf_counter() - t0
    timer.remove()
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    finish = {o.outputs[0].finish_reason for o in outputs}
    return {
        "wall_s": wall,
        "steps": len(step_times),
        "decode_steps": len(decode_times),
        # The median: on a shared machine a few steps stall on other processes.
        "decode_ms_per_step": 1e3 * statistics.median(decode_times),
        "output_tokens": num_tokens,
        "tok_s": num_tokens / wall,
        "bitmask_ms_per_step": timer.ms_per_call,
        "finish_reasons": sorted(r or "none" for r in finish),
        "texts": [o.outputs[0].text for o in outputs],
    }


def measure_decode(
    llm: Any, prompts: list[list[int]], output_len: int, repeat: int, progress: Progress
) -> dict[str, dict[str, Any]]:
    from engine.request import GuidedSpec, SamplingParams

    plain = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    guided = SamplingParams(
        temperature=0,
        max_tokens=output_len,
        ignore_eos=True,
        guided=GuidedSpec(json_schema=CATALOG),
    )
    best: dict[str, dict[str, Any]] = {}
    for i in range(repeat):
        suffix = "" if repeat == 1 else f" #{i + 1}"
        for name, params in (("unguided", plain), ("guided", guided)):
            run = run_once(llm, prompts, params, progress, f"w1 {name}{suffix}")
            if name not in best or run["decode_ms_per_step"] < best[name]["decode_ms_per_step"]:
                best[name] = run
    return best


def measure_compiles(llm: Any) -> list[dict[str, Any]]:
    """Cold and cached compile times in a fresh GrammarCache with the engine's limits."""
    from engine.guided import canonical_text
    from engine.llm_engine import grammar_cache

    engine = llm.engine
    cache = grammar_cache(engine.config, engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    t0 = time.perf_counter()
    cache._xgrammar_compiler()  # tokenizer info: once per engine, before its first compile
    rows = [{"spec": "tokenizer info (once)", "bytes": None, "cold_ms": _ms(t0), "cached_us": None}]
    for name, spec in compile_specs():
        t0 = time.perf_counter()
        result = cache.submit(spec).result()
        cold = _ms(t0)
        if isinstance(result, Exception):
            raise result
        t0 = time.perf_counter()
        cache.submit(spec).result()
        cached = 1e3 * _ms(t0)
        size = len(canonical_text(spec).encode())
        rows.append({"spec": name, "bytes": size, "cold_ms": cold, "cached_us": cached})
    return rows


def _ms(t0: float) -> float:
    return 1e3 * (time.perf_counter() - t0)


def run_guided_bench(
    model_dir: str,
    *,
    num_prompts: int,
    output_len: int,
    repeat: int,
    seed: int,
    console: Console,
) -> dict[str, Any]:
    from transformers import AutoConfig, AutoTokenizer

    from engine.frontend.offline import LLM
    from engine.request import GuidedSpec, SamplingParams

    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    special = set(tokenizer.all_special_ids) | {int(i) for i in tokenizer.added_tokens_decoder}
    vocab = min(int(hf_config.vocab_size), len(tokenizer))
    (w1,) = make_workloads(["w1"], vocab, sorted(special), num_prompts=num_prompts, seed=seed)
    block_size = 16
    blocks_per_seq = -(-(w1.max_prompt_len + output_len) // block_size) + 1
    with new_progress(console) as progress:
        task = progress.add_task("load", total=None)

        def on_tensor(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        llm = LLM(
            model=model_dir,
            progress=on_tensor,
            dtype=DTYPE,
            block_size=block_size,
            num_kv_blocks=max(num_prompts * blocks_per_seq, 256),
        )
        warm = progress.add_task("warmup", total=None)
        warm_params = SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True, guided=GuidedSpec(json_schema=CATALOG)
        )
        llm.generate(w1.prompts[:4], warm_params)  # xgrammar's import and tokenizer info
        llm.generate(w1.prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        progress.update(warm, total=1, completed=1)
        decode = measure_decode(llm, w1.prompts, output_len, repeat, progress)
        task = progress.add_task("compile times", total=None)
        compiles = measure_compiles(llm)
        progress.update(task, total=1, completed=1)
    for name, run in decode.items():
        if run["finish_reasons"] != ["length"] or run["output_tokens"] != num_prompts * output_len:
            raise RuntimeError(f"the {name} run did not decode exactly {output_len} tokens each")
    for text in decode["guided"]["texts"]:
        if not text.startswith('{"items":[{"name":'):
            raise RuntimeError(f"a guided output does not follow the catalog schema: {text[:80]!r}")
    return {
        "model": model_dir,
        "num_prompts": num_prompts,
        "output_len": output_len,
        "torch_threads": torch.get_num_threads(),
        "decode": {k: {kk: vv for kk, vv in v.items() if kk != "texts"} for k, v in decode.items()},
        "overhead": decode["guided"]["decode_ms_per_step"]
        / decode["unguided"]["decode_ms_per_step"]
        - 1,
        "guided_sample": decode["guided"]["texts"][0][:120],
        "compiles": compiles,
    }


def decode_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"W1, unguided vs guided ({Path(result['model']).name})")
    columns = ("run", "decode ms/step", "overhead", "output tok/s", "tokens", "steps", "mask ms")
    for name in columns:
        table.add_column(name, justify="left" if name == "run" else "right")
    base = result["decode"]["unguided"]
    for name in ("unguided", "guided"):
        row = result["decode"][name]
        guided = name == "guided"
        table.add_row(
            "w1 json schema (catalog)" if guided else "w1 unguided",
            f"{row['decode_ms_per_step']:.2f}",
            f"{row['decode_ms_per_step'] / base['decode_ms_per_step'] - 1:+.1%}" if guided else "-",
            f"{row['tok_s']:,.0f}",
            f"{row['output_tokens']:,}",
            f"{row['steps']} ({row['decode_steps']} decode)",
            f"{row['bitmask_ms_per_step']:.2f}" if guided else "-",
        )
    return table


def compile_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="grammar compile times")
    for name in ("spec", "bytes", "cold ms", "cached µs"):
        table.add_column(name, justify="left" if name == "spec" else "right")
    for row in rows:
        table.add_row(
            row["spec"],
            f"{row['bytes']:,}" if row["bytes"] else "-",
            f"{row['cold_ms']:.1f}",
            "-" if row["cached_us"] is None else f"{row['cached_us']:.0f}",
        )
    return table


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loragate-bench guided",
        description="Guided vs unguided decode on W1, and grammar compile times. "
        "With --schemas DIR: every JSON schema in DIR instead (bench.guided_schemas; "
        "`--schemas DIR --help` lists its options).",
    )
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1, help="alternate the two runs N times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(arg == "--schemas" or arg.startswith("--schemas=") for arg in argv):
        from bench.guided_schemas import main as schemas_main  # the real-world schema mode

        schemas_main(argv)
        return
    args = _parser().parse_args(argv)
    for flag in ("num_prompts", "output_len", "repeat", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            _parser().error(f"--{flag.replace('_', '-')} must be positive")
    import transformers

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    console = Console() if Console().is_terminal else Console(width=150)
    result = run_guided_bench(
        args.model,
        num_prompts=args.num_prompts,
        output_len=args.output_len,
        repeat=args.repeat,
        seed=args.seed,
        console=console,
    )
    console.print(
        f"{result['num_prompts']} prompts x 128 tokens, {result['output_len']} output tokens, "
        f"greedy, torch threads {result['torch_threads']}; a guided output starts "
        f"{result['guided_sample'][:60]!r}",
        highlight=False,
    )
    console.print(decode_table(result))
    console.print(compile_table(result["compiles"]))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        console.print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
