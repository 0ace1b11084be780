"""What the engine knows of a LoRA adapter apart from where it lives: its identity (the
request's `LoRARequest`), its weights as a loader hands them over (`LoRAWeights`) and in slot
layout (`PackedLoRA`), the loader's signature and failure, and the model's fused linears that
adapters target. engine/lora/manager.py's `LoRAManager` places them in device slots and a CPU cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# The projections an adapter may target, in HF names.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Which adapter a request runs under.

    `adapter_id` is the sha256 of the adapter's config and weights: the engine
    keys residency and the prefix cache by it, so an adapter replaced under the
    same name never serves the old one's KV blocks.
    """

    name: str
    path: str
    adapter_id: str


@dataclass(slots=True)
class LoRAWeights:
    """One adapter's weights, as the loader hands them over (CPU tensors)."""

    adapter_id: str
    rank: int
    scaling: float  # alpha / r, or alpha / sqrt(r) for rsLoRA
    # layers[i][module] = (A [rank, in_features], B [out_features, rank]) for each
    # targeted module of decoder layer i; a module absent from the dict is not adapted.
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for layer in self.layers
            for a, b in layer.values()
        )


@dataclass(slots=True)
class PackedLoRA:
    """An adapter in slot layout, built off the engine thread: per fused target,
    one entry per module the adapter adapts, in the target's order, holding A as
    [layers, rank, in] and B transposed as [layers, rank, out of that module] with
    the scaling folded in. Nothing is padded: installing writes each module's
    rows and columns of the slot and zeroes the rest of them."""

    adapter_id: str
    rank: int
    # modules[target] = [(HF module, A, B), ...]
    modules: list[list[tuple[str, torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for target in self.modules
            for _, a, b in target
            for t in (a, b)
        )


class LoRALoadError(RuntimeError):
    """An adapter could not be loaded; the requests naming it fail with this message."""


LoRALoader = Callable[[LoRARequest], LoRAWeights]


@dataclass(frozen=True, slots=True)
class FusedTarget:
    """One of the model's fused linears and the HF modules it packs, with their
    output column ranges."""

    name: str
    in_features: int
    out_features: int
    modules: tuple[tuple[str, int, int], ...]  # (HF module, first column, last column + 1)


# Indices of llama_fused_targets' entries, as the model passes them to LoRAStep.apply.
QKV, O_PROJ, GATE_UP, DOWN = range(4)


def llama_fused_targets(hf_config: Any) -> list[FusedTarget]:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    q, kv = heads * head_dim, kv_heads * head_dim
    return [
        FusedTarget(
            "qkv",
            hidden,
            q + 2 * kv,
            (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)),
        ),
        FusedTarget("o", q, hidden, (("o_proj", 0, hidden),)),
        FusedTarget(
            "gate_up", hidden, 2 * inter, (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter))
        ),
        FusedTarget("down", inter, hidden, (("down_proj", 0, hidden),)),
    ]
