"""`adapter_config.json` of a PEFT LoRA adapter, read as untrusted input: what it must say
(LORA, a rank within the server's bound, a finite alpha, supported target modules) and the
features it must not use (DoRA and the other variants, per-module ranks, base-modifying
initialisations), each refused with an AdapterError naming the field and why."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, TypeGuard

from engine.lora.types import LORA_TARGETS

CONFIG_FILE = "adapter_config.json"

# Config fields that, when set, change the forward pass away from `W x + scaling * B A x` on the
# seven projections, or make peft pick layers and ranks by rules this loader does not follow.
_UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA rescales every adapted weight by a learned magnitude vector",
    "modules_to_save": "it replaces whole base-model modules with trained copies",
    "layers_to_transform": "adapters restricted to chosen layers by config are not supported",
    "layers_pattern": "adapters restricted to chosen layers by config are not supported",
    "rank_pattern": "the engine holds one rank per adapter, not one per module",
    "alpha_pattern": "the engine holds one scaling per adapter, not one per module",
    "lora_bias": "it adds a trained bias to lora_B",
    "fan_in_fan_out": "it stores factors transposed, for GPT-2 style Conv1D layers",
    "use_qalora": "QALoRA pools the input before lora_A",
    "use_bdlora": "BD-LoRA uses block-diagonal factors",
    "alora_invocation_tokens": "Activated LoRA applies the adapter only after invocation tokens",
    "arrow_config": "Arrow routes each token between several adapters",
    "kasa_config": "KaSA inserts a learned diagonal between lora_A and lora_B",
    "monteclora_config": "MonteCLoRA samples the adapter's weights",
    "trainable_token_indices": "it trains token embeddings, outside the adapted projections",
    "target_parameters": "it adapts raw parameters (such as MoE experts), not linear modules",
    "layer_replication": "it duplicates decoder layers of the base model",
}

# Initialisations that subtract the initial adapter from (or quantize) the base weights: such an
# adapter is only correct on top of the modified base it was saved with.
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq")


class AdapterError(ValueError):
    """An adapter was refused; the message says which file, which module, expected vs got."""


def lora_scaling(alpha: float, rank: int, rslora: bool) -> float:
    """peft's multiplier of `B A x`: alpha / r, or alpha / sqrt(r) for rsLoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


@dataclass(frozen=True, slots=True)
class LoraConfig:
    rank: int
    scaling: float
    # The entries of a list-form target_modules; None when it is a pattern or "all-linear",
    # which leave it to the tensors to say what is adapted.
    target_modules: tuple[str, ...] | None
    base_model: str | None


def parse_config(data: bytes, max_lora_rank: int) -> LoraConfig:
    try:
        config = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object, not {type(config).__name__}")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(
            f"{CONFIG_FILE}: peft_type is {short(peft_type)}; only LORA adapters are supported"
        )
    for field, reason in _UNSUPPORTED_FEATURES.items():
        if _is_set(config.get(field)):
            raise AdapterError(
                f"{CONFIG_FILE}: {field}={short(config[field])} is not supported: {reason}"
            )
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterError(
            f"{CONFIG_FILE}: bias={short(bias)} is not supported: the adapter trained "
            f"base-model biases; only bias='none' adapters can be served"
        )
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise AdapterError(
            f"{CONFIG_FILE}: init_lora_weights={init!r} is not supported: the adapter is only "
            f"valid on the base weights its initialisation modified; convert it to plain LoRA"
        )
    rank, alpha, rslora = config.get("r"), config.get("lora_alpha"), config.get("use_rslora", False)
    if not _is_int(rank) or rank < 1:
        raise AdapterError(f"{CONFIG_FILE}: r must be a positive integer, got {short(rank)}")
    if rank > max_lora_rank:
        raise AdapterError(
            f"{CONFIG_FILE}: rank r={rank} exceeds this server's max_lora_rank {max_lora_rank}"
        )
    if not _is_number(alpha):
        raise AdapterError(f"{CONFIG_FILE}: lora_alpha must be a finite number, got {short(alpha)}")
    if not isinstance(rslora, bool):
        raise AdapterError(f"{CONFIG_FILE}: use_rslora must be true or false, got {short(rslora)}")
    base_model = config.get("base_model_name_or_path")
    if base_model is not None and not isinstance(base_model, str):
        raise AdapterError(
            f"{CONFIG_FILE}: base_model_name_or_path must be a string, got {short(base_model)}"
        )
    return LoraConfig(
        rank=rank,
        scaling=lora_scaling(alpha, rank, rslora),
        target_modules=_parse_target_modules(config.get("target_modules")),
        base_model=base_model or None,
    )


def _parse_target_modules(value: Any) -> tuple[str, ...] | None:
    supported = ", ".join(LORA_TARGETS)
    if isinstance(value, str):
        if value == "all-linear":  # peft's shorthand: every linear layer but the output head
            return None
        # A pattern is compiled, never matched: matching a tenant's regex could backtrack for
        # minutes. The tensors say what is adapted, and each is checked by name below.
        try:
            re.compile(value)
        except (re.error, RecursionError, OverflowError) as exc:
            raise AdapterError(
                f"{CONFIG_FILE}: target_modules {short(value)} is not a valid pattern: {exc}"
            ) from exc
        return None
    if not isinstance(value, list) or not value:
        raise AdapterError(
            f"{CONFIG_FILE}: target_modules must be a non-empty list of module names or a "
            f"pattern, got {short(value)}"
        )
    for entry in value:
        # An entry names a module by its full name or a dotted suffix of it (see _listed).
        if not isinstance(entry, str) or entry.rsplit(".", 1)[-1] not in LORA_TARGETS:
            raise AdapterError(
                f"{CONFIG_FILE}: target module {short(entry)} is not supported; "
                f"supported: {supported}"
            )
    return tuple(value)


def _is_set(value: Any) -> bool:
    """Whether a config field is in use. 0 counts: `layers_to_transform: 0` means layer 0."""
    return value is not None and value is not False and value not in ("", [], {})


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> TypeGuard[float]:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def short(value: Any, limit: int = 80) -> str:
    """repr() cut to a readable length: a refusal must not echo a megabyte of config."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
