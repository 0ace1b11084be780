"""What a stream's updates cost across the engine's pipe: each step's updates pickled as the
engine sends them (the text appended since the last update) against the same updates carrying
the whole output text so far, as they did before.

    loragate-bench update-bytes [--model models/demo] [--sequences 16] [--max-tokens 1000]

The engine runs the sequences to `--max-tokens` (greedy, EOS ignored); every step's list of
updates is pickled both ways (the engine process sends it pickled, engine/messages.py's
StepResult) and unpickled again, and the bytes and seconds are summed. Whole texts grow with
the output, so their bytes grow with its square; deltas grow with its length.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import time

from rich.console import Console
from rich.table import Table

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.outputs import SequenceUpdate

PROMPT = "Once upon a time, in a city by the sea,"


def _pickle_seconds(updates: list[SequenceUpdate]) -> tuple[int, float]:
    start = time.perf_counter()
    data = pickle.dumps(updates, protocol=pickle.HIGHEST_PROTOCOL)
    pickle.loads(data)
    return len(data), time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict[str, float]:
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype="float32",
            kv_cache_memory=256 << 20,
            max_model_len=args.max_tokens + 64,
        )
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.sequences):
        engine.add_request(f"s{i}", PROMPT, params)
    texts: dict[str, str] = {}
    totals = {"tokens": 0.0, "delta_bytes": 0.0, "whole_bytes": 0.0}
    totals |= {"delta_seconds": 0.0, "whole_seconds": 0.0}
    console = Console(stderr=True)
    steps = 0
    while engine.has_unfinished_requests():
        updates = engine.step()
        whole = []
        for update in updates:
            texts[update.request_id] = texts.get(update.request_id, "") + update.text_delta
            whole.append(dataclasses.replace(update, text_delta=texts[update.request_id]))
            totals["tokens"] += len(update.new_token_ids)
        for kind, batch in (("delta", updates), ("whole", whole)):
            size, seconds = _pickle_seconds(batch)
            totals[f"{kind}_bytes"] += size
            totals[f"{kind}_seconds"] += seconds
        steps += 1
        if steps % 200 == 0:
            console.print(f"  step {steps}: {int(totals['tokens'])} tokens")
    return totals


def report(totals: dict[str, float], args: argparse.Namespace) -> None:
    table = Table(
        title=f"the engine's updates over its pipe: {args.sequences} sequences x "
        f"{args.max_tokens} tokens, {args.model}"
    )
    for column in ("updates carry", "bytes", "bytes per token", "pickle + unpickle s"):
        table.add_column(column, justify="right")
    tokens = totals["tokens"]
    for kind, label in (("whole", "the whole text (before)"), ("delta", "the text appended")):
        table.add_row(
            label,
            f"{totals[f'{kind}_bytes']:,.0f}",
            f"{totals[f'{kind}_bytes'] / tokens:,.1f}",
            f"{totals[f'{kind}_seconds']:.3f}",
        )
    Console().print(table)
    Console().print(
        f"deltas: {totals['whole_bytes'] / totals['delta_bytes']:.1f}x fewer bytes, "
        f"{totals['whole_seconds'] / totals['delta_seconds']:.1f}x less time pickling"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="loragate-bench update-bytes", description=__doc__)
    p.add_argument("--model", default="models/demo")
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1000)
    args = p.parse_args(argv)
    report(measure(args), args)
