"""n-gram speculative decoding against none, in one run, on a workload that copies from its
prompt and on one that never does.

    loragate-bench spec-decode --model models/smollm2 [--dtype auto] [--repeat 2]
        [--num-speculative-tokens 4] [--prompt-lookup-max 4] [--prompt-lookup-min 2]

- copy: 32 chat requests, each asking to extract the fields of a generated invoice (the
  values repeated as written), greedy, up to 128 tokens;
- random: W1's prompts (128 random tokens, 64 output tokens, ignore_eos) sampled at
  temperature 1, where a draft is only ever a coincidence. (Greedy on random prompts is
  no such workload: SmolLM2 falls into loops, and 90 % of drafts are accepted.)

Both engines run the same prompts at each `--max-num-seqs` (sequences at a time),
alternating, the fastest of `--repeat`; the table gives output tok/s, the ratio, the
drafts' acceptance, and for greedy rows whether the outputs are identical (they must be).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.workloads import make_workloads, new_progress
from kernels import cpu_features

CUSTOMERS = ["Acme Robotics Ltd", "Blue Harbour Foods", "Northwind Traders", "Kestrel Labs GmbH"]
STREETS = ["14 Harbour Street, Bristol", "2 Mill Lane, Leeds", "88 Rue Oberkampf, Paris"]
ITEMS = ["servo motor", "controller board", "power supply", "sensor kit", "cable set"]


def invoice(rng: random.Random) -> str:
    lines = [
        f"Invoice number: INV-{rng.randint(2020, 2026)}-{rng.randint(1, 9999):04d}",
        f"Customer: {rng.choice(CUSTOMERS)}, {rng.choice(STREETS)}",
        f"Date: {rng.randint(1, 28)} March {rng.randint(2020, 2026)}",
    ]
    total = 0.0
    for item in rng.sample(ITEMS, 3):
        qty, price = rng.randint(1, 9), rng.randint(500, 20000) / 100
        total += qty * price
        model = f"{item[:2].upper()}-{rng.randint(10, 999)}"
        lines.append(f"Item: {qty} x {item} (model {model}) at {price:.2f} each")
    lines.append(f"Total: {total:.2f} GBP")
    return "\n".join(lines)


def copy_prompts(llm: Any, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    ask = (
        "Extract the customer, the date, every item with its model and price, and the total "
        "from this invoice. Repeat the values exactly as written.\n\n"
    )
    return [llm.chat_prompt(ask + invoice(rng)) for _ in range(n)]


def timed(
    llm: Any, prompts: list[list[int]], params: Any
) -> tuple[float, list[list[int]], tuple[int, int]]:
    """Output tok/s, the outputs, and (draft tokens, accepted) of the run."""
    engine = llm.engine
    before = (engine.num_draft_tokens, engine.num_accepted_tokens)
    llm.engine.kv.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    drafted = engine.num_draft_tokens - before[0]
    accepted = engine.num_accepted_tokens - before[1]
    return sum(len(t) for t in tokens) / wall, tokens, (drafted, accepted)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loragate-bench spec-decode", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--max-num-seqs", default="4,16", help="comma-separated concurrencies")
    return p


# (workload name, max_num_seqs, engine label): the key of every run's figures
RunKey = tuple[str, int, str]


@dataclass(slots=True)
class Measurements:
    """Every run's tok/s, the last run's outputs, and the n-gram engine's drafts."""

    results: dict[RunKey, list[float]] = field(default_factory=dict)
    outputs: dict[RunKey, list[list[int]]] = field(default_factory=dict)
    acceptance: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)


def load_engines(args: argparse.Namespace, spec: Any, progress: Progress) -> dict[str, Any]:
    """The engine without speculation ("off") and with the n-gram proposer ("ngram")."""
    from engine import LLM

    engines: dict[str, Any] = {}
    for label, config in (("off", None), ("ngram", spec)):
        task = progress.add_task(f"load {label}", total=None)
        engines[label] = LLM(
            args.model,
            dtype=args.dtype,
            kv_cache_memory=1 << 30,
            max_model_len=2048,
            speculative_config=config,
        )
        progress.update(task, total=1, completed=1)
    return engines


def spec_workloads(llm: Any) -> dict[str, tuple[list[list[int]], Any]]:
    """name: (prompts, sampling params) of the copying workload and the random one."""
    from engine import SamplingParams

    tokenizer = llm.tokenizer
    (w1,) = make_workloads(["w1"], len(tokenizer), tokenizer.all_special_ids, num_prompts=64)
    return {
        "copy": (
            copy_prompts(llm, 32),
            SamplingParams(temperature=0, max_tokens=128),
        ),
        "random, T=1": (
            w1.prompts,
            SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True),
        ),
    }


def measure(
    engines: dict[str, Any],
    workloads: dict[str, tuple[list[list[int]], Any]],
    concurrencies: list[int],
    repeat: int,
    progress: Progress,
) -> Measurements:
    """Both engines on the same prompts at each concurrency, alternating, `repeat` times."""
    measured = Measurements()
    for _ in range(repeat):
        for name, (prompts, params) in workloads.items():
            for seqs in concurrencies:
                for label, llm in engines.items():
                    llm.engine.scheduler.max_num_seqs = seqs
                    task = progress.add_task(f"{name} x{seqs} spec {label}", total=None)
                    tok_s, tokens, drafts = timed(llm, prompts, params)
                    progress.update(task, total=1, completed=1)
                    measured.results.setdefault((name, seqs, label), []).append(tok_s)
                    measured.outputs[(name, seqs, label)] = tokens
                    if label == "ngram":
                        measured.acceptance[(name, seqs)] = drafts
    return measured


def results_table(
    measured: Measurements,
    workloads: dict[str, tuple[list[list[int]], Any]],
    concurrencies: list[int],
) -> Table:
    table = Table(title="n-gram speculative decoding vs none (fastest of the runs)")
    for col in ("workload", "seqs", "off tok/s", "ngram tok/s", "ratio", "drafts accepted",
                "identical outputs", "runs off / ngram"):  # fmt: skip
        table.add_column(col, justify="right")
    results, outputs = measured.results, measured.outputs
    for name, (_, params) in workloads.items():
        for seqs in concurrencies:
            off, on = results[(name, seqs, "off")], results[(name, seqs, "ngram")]
            drafted, accepted = measured.acceptance[(name, seqs)]
            same = outputs[(name, seqs, "off")] == outputs[(name, seqs, "ngram")]
            table.add_row(
                name,
                str(seqs),
                f"{max(off):.0f}",
                f"{max(on):.0f}",
                f"{max(on) / max(off):.2f}x",
                f"{accepted} / {drafted} ({accepted / drafted:.0%})" if drafted else "0 / 0",
                ("yes" if same else "NO") if params.temperature == 0 else "- (sampled)",
                " ".join(f"{v:.0f}" for v in off) + " / " + " ".join(f"{v:.0f}" for v in on),
            )
    return table


def main(argv: list[str] | None = None) -> None:
    from engine import SamplingParams
    from engine.spec_decode import SpeculativeConfig

    args = _parser().parse_args(argv)
    console = Console(width=max(Console().width, 120))
    spec = SpeculativeConfig(
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_max=args.prompt_lookup_max,
        prompt_lookup_min=args.prompt_lookup_min,
    )
    with new_progress(console) as progress:
        engines = load_engines(args, spec, progress)
        dtype = str(engines["off"].engine.runner.dtype).removeprefix("torch.")
        workloads = spec_workloads(engines["off"])
        for llm in engines.values():  # warm both up
            llm.generate(workloads["copy"][0][:2], SamplingParams(temperature=0, max_tokens=8))
        concurrencies = [int(c) for c in args.max_num_seqs.split(",")]
        measured = measure(engines, workloads, concurrencies, args.repeat, progress)

    console.print(
        f"{Path(args.model).name}, {dtype}; {cpu_features.describe()}\n"
        f"speculative config: k={spec.num_speculative_tokens}, "
        f"n-gram {spec.prompt_lookup_min}..{spec.prompt_lookup_max}"
    )
    console.print(results_table(measured, workloads, concurrencies))


if __name__ == "__main__":
    main()
