"""LoRA adapters inside the engine: identity, weights, device slots and CPU cache.

The engine never reads adapter files itself: it is handed a loader (the
gateway wires `adapters.peft`) that turns a `LoRARequest` into `LoRAWeights`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
