"""Demo LoRA adapters: real PEFT adapters with seeded weights, made without training.

`build_demo_adapter` has peft itself build and save the adapter (LoraConfig,
get_peft_model, save_pretrained), so the files are exactly what peft writes;
only the factors are ours. peft starts lora_B at zero, which would make every
adapter a no-op, so both factors are drawn from the seed instead, sized so
that the adapter's update `scaling * B A x` is `UPDATE_STRENGTH` times the
magnitude of the base projection's `W x`:

    A [r, in]:  std 1 / sqrt(in)                      A x has unit-scale entries
    B [out, r]: std strength / (scaling * sqrt(r))    so scaling * B A x ~ strength

whatever the rank, alpha or rsLoRA. On the demo model that changes the greedy
continuation of most prompts while the logits stay as far apart as the base
model's (the final norm and lm_head, which spread them, are not adapted).

`clone_adapter` redraws an existing adapter's factors from another seed without
peft: thousands of distinct adapters in seconds.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from adapters.peft import WEIGHTS_FILE
from adapters.peft_config import CONFIG_FILE, lora_scaling
from engine.lora.types import LORA_TARGETS

# |scaling * B A x| / |W x|. At 0.5 the demo model's greedy output changes on most prompts;
# see tests/adapters/test_demo.py.
UPDATE_STRENGTH = 0.5

TARGET_PRESETS: dict[str, tuple[str, ...]] = {
    "all": LORA_TARGETS,
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


@dataclass(frozen=True, slots=True)
class LoraScaling:
    """An adapter's `lora_alpha` (None: 2 * rank) and whether its update is scaled by
    alpha / sqrt(r) (rsLoRA, peft's `use_rslora`) rather than alpha / r."""

    alpha: int | None = None
    rslora: bool = False

    def lora_alpha(self, rank: int) -> int:
        return 2 * rank if self.alpha is None else self.alpha


def build_demo_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int,
    targets: str | Sequence[str] = "all",
    seed: int,
    scaling: LoraScaling | None = None,
) -> Path:
    """Write a PEFT LoRA adapter for the model in `model_dir` to `out_dir` and return it.

    `targets` is "all" (the seven projections), "attention" (q/k/v/o) or a list
    of module names. `scaling` defaults to alpha 2 * rank, without rsLoRA. The
    same arguments give the same bytes; an existing `out_dir` is replaced whole.
    """
    modules = _target_modules(targets)
    if rank < 1:
        raise ValueError(f"rank must be positive, got {rank}")
    chosen = scaling or LoraScaling()
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no model at {model_dir}: config.json is missing")
    return _replace_dir(
        Path(out_dir),
        lambda tmp: _save_with_peft(model_dir, tmp, rank, chosen, modules, seed),
    )


def clone_adapter(src: str | Path, dst: str | Path, *, seed: int) -> Path:
    """Write to `dst` an adapter with `src`'s config and shapes and factors drawn from `seed`.

    Cloning an adapter with the seed it was built with reproduces it byte for byte.
    """
    src = Path(src)
    config_bytes = (src / CONFIG_FILE).read_bytes()
    config = json.loads(config_bytes)
    scaling = lora_scaling(config["lora_alpha"], config["r"], config.get("use_rslora", False))
    with safe_open(str(src / WEIGHTS_FILE), framework="pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    factors = _seeded_factors(shapes, scaling, seed)

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_bytes(config_bytes)
        save_file(factors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})

    return _replace_dir(Path(dst), write)


def _target_modules(targets: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(targets, str):
        if targets not in TARGET_PRESETS:
            raise ValueError(f"targets must be {' or '.join(TARGET_PRESETS)} or a list of modules")
        return TARGET_PRESETS[targets]
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown or not targets:
        raise ValueError(f"targets must be a non-empty subset of {LORA_TARGETS}, got {targets}")
    return tuple(sorted(set(targets), key=LORA_TARGETS.index))


def _save_with_peft(
    model_dir: Path,
    out_dir: Path,
    rank: int,
    scaling: LoraScaling,
    modules: tuple[str, ...],
    seed: int,
) -> None:
    # Imported here: transformers and peft take seconds to import, and clone_adapter needs neither.
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoConfig, AutoModelForCausalLM

    alpha, rslora = scaling.lora_alpha(rank), scaling.rslora
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    # Recorded as the adapter's base_model_name_or_path: the directory's name, which the
    # loader matches against the server's model, rather than this machine's path.
    config._name_or_path = model_dir.resolve().name
    # peft needs the model's modules, not its weights: on the meta device the model is built
    # without reading or allocating any, in milliseconds whatever its size.
    with torch.device("meta"):
        # transformers leaves the auto classes' from_config unannotated.
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    lora_config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=list(modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft calls transformers APIs deprecated in 5.x; nothing the caller can act on.
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, lora_config)
    lora_layers = {
        name: module for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)
    }
    # Keys as save_pretrained writes them: the module's name, without the adapter's name.
    shapes = {
        f"{name}.{side}.weight": tuple(getattr(module, side)["default"].weight.shape)
        for name, module in lora_layers.items()
        for side in ("lora_A", "lora_B")
    }
    factors = _seeded_factors(shapes, lora_scaling(alpha, rank, rslora), seed)
    for name, module in lora_layers.items():
        for side in ("lora_A", "lora_B"):
            weight = torch.nn.Parameter(factors[f"{name}.{side}.weight"], requires_grad=False)
            getattr(module, side)["default"].weight = weight
    # peft keeps target_modules as a set, whose order follows the interpreter's hash seed;
    # sorted, the config's bytes (and so the adapter's identity) are the same on every run.
    saved_config = peft_model.peft_config["default"]
    assert isinstance(saved_config, LoraConfig)
    saved_config.target_modules = sorted(modules)
    # save_embedding_layers=False: otherwise peft looks the base model up on the hub.
    peft_model.save_pretrained(str(out_dir), safe_serialization=True, save_embedding_layers=False)
    # The model card names this machine's paths and is no part of the adapter.
    (out_dir / "README.md").unlink(missing_ok=True)


def _seeded_factors(
    shapes: Mapping[str, tuple[int, ...]], scaling: float, seed: int
) -> dict[str, torch.Tensor]:
    """A tensor for every lora_A / lora_B name in `shapes`, drawn in name order from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    factors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if ".lora_A." in name:
            std = 1.0 / math.sqrt(shape[1])
        elif ".lora_B." in name:
            std = UPDATE_STRENGTH / (scaling * math.sqrt(shape[1]))
        else:
            raise ValueError(f"{name!r} is not a LoRA factor")
        # Uniform of the wanted std rather than normal, as in engine/models/demo.py:
        # torch.rand is bit-identical on every CPU, torch.randn's vectorised math is not.
        uniform = torch.rand(shape, generator=generator, dtype=torch.float32)
        factors[name] = (2.0 * uniform - 1.0) * (std * math.sqrt(3.0))
    return factors


def _replace_dir(out_dir: Path, fill: Callable[[Path], None]) -> Path:
    """Fill a fresh directory next to `out_dir`, then rename it into place.

    Readers never see a half-written adapter: the old one, the new one or (for the instant
    between two renames, when one is replaced) none.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    old = tmp.with_name(tmp.name + ".old")
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the adapter from other users
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
    except BaseException:
        if old.exists() and not out_dir.exists():
            old.rename(out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out_dir
