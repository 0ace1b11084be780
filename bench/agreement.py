"""Greedy agreement with Hugging Face transformers in a reduced dtype, and where it ends.

In float32 our engine matches transformers token for token. In bfloat16 two correct
implementations round differently (another GEMM blocking, float32 attention where
transformers rounds scores to bf16), and a logit 8 bits wide ties often: near 30, bf16
steps by 0.125. Greedy outputs then agree until the first step where the reference's
top two logits are that close, and may differ after it. This module finds that step and
reports the reference's top-2 gap there and where our token stands, so "agrees until a
near-tie" is checked, not assumed.

    loragate-bench agreement --model models/smollm2 [--dtype bfloat16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.hf_baseline import hf_generate
from kernels import cpu_features

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Give me a recipe for pancakes.",
    "Who wrote Hamlet?",
    "What is 12 times 7?",
    "Describe a cat in two sentences.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Name the planets of the solar system in order.",
    "Write a Python function that reverses a string.",
    "What are the benefits of regular exercise?",
    "Summarise the plot of Romeo and Juliet.",
    "How do vaccines work?",
    "Suggest a name for a small bakery.",
]


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first step where our greedy token differs from the reference's."""

    step: int  # index into the generated tokens
    top_gap: float  # the reference's top-1 minus top-2 logit there
    our_gap: float  # the reference's top logit minus its logit of our token
    ulp: float  # the reference dtype's spacing at the top logit's magnitude

    @property
    def is_near_tie(self) -> bool:
        """Our token is within two rounding steps of the reference's best."""
        return self.our_gap <= 2 * self.ulp


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s values at |value| (bf16: 8 significant bits)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(value), 1e-30)))


@torch.inference_mode()
def first_divergence(
    model: Any, prompt: list[int], ours: list[int], theirs: list[int]
) -> Divergence | None:
    """None when the outputs agree; else the reference model's logits at the first
    differing step, teacher-forced on the common prefix."""
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if step is None:
        return None
    ids = torch.tensor([prompt + theirs[:step]])
    logits = model(ids).logits[0, -1]
    top2 = logits.float().topk(2).values.tolist()
    return Divergence(
        step=step,
        top_gap=top2[0] - top2[1],
        our_gap=top2[0] - float(logits[ours[step]]),
        ulp=ulp(top2[0], logits.dtype),
    )


def run_agreement(
    model_dir: str, dtype: str = "bfloat16", max_tokens: int = 64
) -> list[tuple[int, Divergence | None]]:
    """Each question's (tokens generated, divergence or None), ours vs transformers, both
    greedy in `dtype` with EOS ignored."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams

    llm = LLM(model_dir, kv_cache_memory=256 << 20, max_model_len=1024, dtype=dtype)
    prompts = [llm.chat_prompt(q) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=llm.engine.runner.dtype)
    reference.eval()
    results = []
    for prompt, mine in zip(prompts, ours, strict=True):
        # One prompt at a time: no padding, as our engine sees it.
        theirs = hf_generate(reference, llm.tokenizer, [prompt], max_tokens)[0].tolist()
        results.append((len(mine), first_divergence(reference, prompt, mine, theirs)))
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "auto"])
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    console = Console()
    console.print(f"{Path(args.model).name}, {args.dtype}; {cpu_features.describe()}")
    results = run_agreement(args.model, args.dtype, args.max_tokens)
    table = Table(title="greedy agreement with transformers in the same dtype")
    for column in ("prompt", "agreed tokens", "top-2 gap there", "our token's gap", "near-tie"):
        table.add_column(column, justify="right")
    for i, (n, div) in enumerate(results):
        if div is None:
            table.add_row(str(i), f"{n} (all)", "-", "-", "-")
        else:
            table.add_row(
                str(i),
                str(div.step),
                f"{div.top_gap:.4g}",
                f"{div.our_gap:.4g} ({div.our_gap / div.ulp:.0f} ulp)",
                "yes" if div.is_near_tie else "NO",
            )
    console.print(table)
    full = sum(div is None for _, div in results)
    ties = sum(div is not None and div.is_near_tie for _, div in results)
    console.print(
        f"{full}/{len(results)} identical; {ties} diverge at a near-tie; "
        f"{len(results) - full - ties} elsewhere"
    )


if __name__ == "__main__":
    main()
