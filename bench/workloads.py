"""The offline benchmark's workloads: seeded prompts of random token ids, special tokens excluded.

w1  prompts of exactly 128 tokens
w2  w1's prompts, each behind one shared 1024-token prefix
wv  prompt lengths uniform in [32, 256]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

WORKLOAD_NAMES = ("w1", "w2", "wv")
PROMPT_LEN = 128
PREFIX_LEN = 1024
VAR_MIN_LEN, VAR_MAX_LEN = 32, 256
# Token ids are drawn from [TOKEN_MARGIN, vocab - TOKEN_MARGIN), minus special tokens.
TOKEN_MARGIN = 100


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    description: str
    prompts: list[list[int]]

    @property
    def max_prompt_len(self) -> int:
        return max(len(p) for p in self.prompts)


def allowed_token_ids(vocab_size: int, special_ids: Sequence[int]) -> np.ndarray:
    """Ordinary token ids: away from both ends of the vocabulary, no special tokens."""
    lo, hi = TOKEN_MARGIN, vocab_size - TOKEN_MARGIN
    if hi - lo < 16:  # a toy vocabulary: use all of it
        lo, hi = 0, vocab_size
    ids = np.arange(lo, hi, dtype=np.int64)
    return ids[~np.isin(ids, np.asarray(list(special_ids), dtype=np.int64))]


def make_workloads(
    names: Sequence[str],
    vocab_size: int,
    special_ids: Sequence[int] = (),
    *,
    num_prompts: int = 64,
    seed: int = 0,
) -> list[Workload]:
    """The named workloads. Each draws from its own RNG stream ([seed, k]), so a workload's
    prompts do not depend on which others are selected; w2's suffixes are w1's prompts."""
    ids = allowed_token_ids(vocab_size, special_ids)

    def draw(stream: int, shape: int | tuple[int, ...]) -> np.ndarray:
        return np.random.default_rng([seed, stream]).choice(ids, size=shape)

    def w1_prompts() -> list[list[int]]:
        return draw(1, (num_prompts, PROMPT_LEN)).tolist()

    out = []
    for name in names:
        if name == "w1":
            out.append(Workload(name, f"{num_prompts} x {PROMPT_LEN} tokens", w1_prompts()))
        elif name == "w2":
            prefix = draw(2, PREFIX_LEN).tolist()
            prompts = [prefix + p for p in w1_prompts()]
            desc = f"{num_prompts} x ({PREFIX_LEN} shared + {PROMPT_LEN}) tokens"
            out.append(Workload(name, desc, prompts))
        elif name == "wv":
            rng = np.random.default_rng([seed, 3])
            lens = rng.integers(VAR_MIN_LEN, VAR_MAX_LEN + 1, size=num_prompts)
            prompts = [rng.choice(ids, size=int(n)).tolist() for n in lens]
            desc = f"{num_prompts} x U[{VAR_MIN_LEN}, {VAR_MAX_LEN}] tokens"
            out.append(Workload(name, desc, prompts))
        else:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOAD_NAMES)}")
    return out


def parse_workloads(spec: str) -> list[str]:
    names = [w.strip().lower() for w in spec.split(",") if w.strip()]
    if names == ["all"]:
        return list(WORKLOAD_NAMES)
    for name in names:
        if name not in WORKLOAD_NAMES:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOAD_NAMES)}")
    return names


def best_of(measure: Callable[[str], dict[str, Any]], label: str, repeat: int) -> dict[str, Any]:
    """Run `measure(progress_label)` `repeat` times; keep the fastest, note every wall time."""
    runs = [measure(label if repeat == 1 else f"{label} #{i + 1}") for i in range(repeat)]
    best = min(runs, key=lambda r: r["wall_s"])
    best["wall_s_runs"] = [r["wall_s"] for r in runs]
    return best


def new_progress(console: Console) -> Progress:
    """The benchmarks' progress bars. A slow refresh: the bar's thread competes with the
    measured work for the GIL."""
    return Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        refresh_per_second=4,
    )
