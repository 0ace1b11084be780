"""`lora-scale`'s workload (S-LoRA's, on one engine): an adapter catalog, a seeded trace of
requests over it, and the PEFT adapter directories the trace touches.

The catalog: `num_adapters` all-linear adapters, adapter i of rank drawn uniformly from
`ranks` and owned by tenant i mod `num_tenants` (tenants only label the report; the engine
sees adapters). Popularity follows adapter index: request j picks adapter k with
probability proportional to (k + 1)^-alpha, or the base model with `base_fraction`.

Adapter files are written directly (no peft: a thousand adapters would take an hour), in
the layout adapters/peft.py loads and peft itself reads, bfloat16 on disk. Only the
adapters the trace touches get files, so a catalog of 1000 SmolLM2 adapters (~18 GB in
bfloat16 at mean rank 30) costs the disk of the few hundred a trace names. A directory's
name holds everything its bytes depend on (model shapes, seed, index, rank), so reruns
reuse it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from adapters.peft import CONFIG_FILE, WEIGHTS_FILE, BaseModelInfo
from bench.workloads import allowed_token_ids
from engine.lora.types import LORA_TARGETS

# |scaling * B A x| / |x|: small, so that a real model's outputs stay sane under any adapter,
# yet B is nonzero and every adapter costs its full arithmetic.
ADAPTER_STRENGTH = 0.1
FILE_FORMAT = 1  # bump when ensure_adapter draws or writes differently: old files are not reused
BLOCK = {m: "self_attn" for m in LORA_TARGETS[:4]} | {m: "mlp" for m in LORA_TARGETS[4:]}
# np.random.default_rng([seed, STREAM]) streams, one per thing drawn.
RANK_STREAM, PICK_STREAM, BASE_STREAM, LEN_STREAM, ARRIVAL_STREAM, PROMPT_STREAM = range(6)


@dataclass(frozen=True, slots=True)
class TraceSpec:
    num_adapters: int
    ranks: tuple[int, ...]
    num_tenants: int
    num_requests: int
    alpha: float
    base_fraction: float
    input_len: tuple[int, int]  # uniform, both ends included
    output_len: tuple[int, int]
    max_model_len: int  # prompt + output at most this
    rate: float  # Poisson arrivals per second; 0: all at once
    seed: int


@dataclass(frozen=True, slots=True)
class Trace:
    spec: TraceSpec
    catalog_ranks: list[int]  # per adapter index
    adapters: list[int | None]  # per request: adapter index, None for the base model
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]  # seconds after the start, ascending

    @property
    def touched(self) -> list[int]:
        """The adapters some request names, by popularity (index)."""
        return sorted({a for a in self.adapters if a is not None})

    def tenant(self, adapter: int) -> int:
        return adapter % self.spec.num_tenants


def catalog_ranks(num_adapters: int, ranks: Sequence[int], seed: int) -> list[int]:
    """Adapter i's rank depends on (seed, i) only: the first 100 adapters of a catalog of 1000
    are those of a catalog of 100, and their files are shared."""
    return [
        int(np.random.default_rng([seed, RANK_STREAM, i]).choice(np.asarray(ranks)))
        for i in range(num_adapters)
    ]


def make_trace(spec: TraceSpec, vocab_size: int, special_ids: Sequence[int]) -> Trace:
    n = spec.num_requests

    def rng(stream: int) -> np.random.Generator:
        return np.random.default_rng([spec.seed, stream])

    weights = np.arange(1, spec.num_adapters + 1, dtype=np.float64) ** -spec.alpha
    picks = rng(PICK_STREAM).choice(spec.num_adapters, size=n, p=weights / weights.sum())
    on_base = rng(BASE_STREAM).random(n) < spec.base_fraction
    lens = rng(LEN_STREAM)
    in_lens = lens.integers(spec.input_len[0], spec.input_len[1] + 1, size=n)
    out_lens = lens.integers(spec.output_len[0], spec.output_len[1] + 1, size=n)
    in_lens = np.minimum(in_lens, spec.max_model_len - 1)
    out_lens = np.maximum(1, np.minimum(out_lens, spec.max_model_len - in_lens))
    if spec.rate > 0:
        arrivals = np.cumsum(rng(ARRIVAL_STREAM).exponential(1.0 / spec.rate, size=n))
        arrivals -= arrivals[0]  # the first request arrives at once
    else:
        arrivals = np.zeros(n)
    ids = allowed_token_ids(vocab_size, special_ids)
    draw = rng(PROMPT_STREAM)
    return Trace(
        spec=spec,
        catalog_ranks=catalog_ranks(spec.num_adapters, spec.ranks, spec.seed),
        adapters=[None if base else int(k) for k, base in zip(picks, on_base, strict=True)],
        prompts=[draw.choice(ids, size=int(length)).tolist() for length in in_lens],
        output_lens=[int(x) for x in out_lens],
        arrivals=[float(t) for t in arrivals],
    )


# -- adapter files ----------------------------------------------------------------------------


def store_dir(root: Path, base: BaseModelInfo) -> Path:
    """The store's folder for one base model's shapes (adapters of another would not load)
    and this module's way of drawing factors."""
    shapes = json.dumps(
        [FILE_FORMAT, ADAPTER_STRENGTH, base.num_layers, sorted(base.module_shapes.items())]
    )
    digest = hashlib.sha256(shapes.encode()).hexdigest()[:10]
    return root / f"{base.names[0]}-{digest}"


def adapter_name(seed: int, index: int | str, rank: int) -> str:
    return f"s{seed}-{index}-r{rank}"


def ensure_adapter(
    directory: Path, base: BaseModelInfo, rank: int, seed: tuple[int, ...], dtype: torch.dtype
) -> bool:
    """Write a PEFT adapter of `rank` on all seven projections of every layer into
    `directory` unless it is there already; True if written. Factors are uniform with
    peft's scale (A std 1/sqrt(in), B such that scaling * B A x ~ ADAPTER_STRENGTH x),
    drawn from `seed`."""
    if (directory / CONFIG_FILE).is_file() and (directory / WEIGHTS_FILE).is_file():
        return False
    alpha = 2 * rank
    scaling = alpha / rank
    generator = torch.Generator().manual_seed(int.from_bytes(_seed_bytes(seed), "big"))
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(base.num_layers):
        for module in LORA_TARGETS:
            in_features, out_features = base.module_shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{BLOCK[module]}.{module}"
            a_std = 1.0 / math.sqrt(in_features)
            b_std = ADAPTER_STRENGTH / (scaling * math.sqrt(rank))
            tensors[f"{prefix}.lora_A.weight"] = _uniform((rank, in_features), a_std, generator)
            tensors[f"{prefix}.lora_B.weight"] = _uniform((out_features, rank), b_std, generator)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base.names[0],
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "target_modules": sorted(LORA_TARGETS),
    }

    def fill(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
        cast = {k: v.to(dtype) for k, v in tensors.items()}
        save_file(cast, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})

    _write_dir(directory, fill)
    return True


def _seed_bytes(seed: tuple[int, ...]) -> bytes:
    return hashlib.sha256(json.dumps(seed).encode()).digest()[:8]


def _uniform(shape: tuple[int, int], std: float, generator: torch.Generator) -> torch.Tensor:
    uniform = torch.rand(shape, generator=generator, dtype=torch.float32)
    return (2.0 * uniform - 1.0) * (std * math.sqrt(3.0))


def _write_dir(directory: Path, fill: Callable[[Path], None]) -> None:
    """Fill a fresh folder beside `directory`, then rename it into place: an interrupted run
    leaves no half-written adapter for the next one to reuse."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)
        shutil.rmtree(directory, ignore_errors=True)  # a partial one (a file missing)
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def adapter_file_bytes(base: BaseModelInfo, rank: int, bytes_per_value: int = 2) -> int:
    """The size of one all-linear adapter's factors at `rank`."""
    per_rank = sum(i + o for i, o in base.module_shapes.values())
    return per_rank * rank * base.num_layers * bytes_per_value
