"""Multi-LoRA for one batch: each token group adds its own adapter's low-rank update.

Two torch versions of one op (used on CPU; triton shrink/expand kernels with
these signatures come with the kernels issue):

- `add_lora` (grouped, the specification): for each group of tokens sharing an
  adapter slot, shrink `x @ A[slot].T` then expand `@ B[slot]` into the rows of
  `y`. Stacks are padded to the largest rank; `widths[slot]` says how many rows
  of that slot are in use, so a rank-4 adapter in a rank-16 stack costs rank-4
  work. Four ops per group: right for long prefills.
- `add_lora_masked` (dense): shrink every token against every slot in one
  matmul, zero what belongs to other slots with a mask, expand in one matmul.
  Three ops whatever the number of adapters: right for decode steps, where a
  handful of tokens per adapter make per-group op overhead the whole cost.
  Needs every row past a slot's width to be zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoRAGroup:
    """Tokens of one step that run under one adapter slot: a contiguous slice of
    the step's rows, or their indices when scattered."""

    slot: int
    rows: slice | torch.Tensor


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    groups: Sequence[LoRAGroup],
    widths: Sequence[int],
) -> None:
    """y[rows] += (x[rows] @ lora_a[slot, :w].T) @ lora_b[slot, :w] for every group, in place.

    x: [tokens, in]; y: [tokens, out]; lora_a: [slots, max_width, in];
    lora_b: [slots, max_width, out] (B transposed, scaling folded in).
    """
    for group in groups:
        width = widths[group.slot]
        if width == 0:
            continue
        a = lora_a[group.slot, :width]
        b = lora_b[group.slot, :width]
        rows = group.rows
        if isinstance(rows, slice):
            y[rows].addmm_(x[rows] @ a.t(), b)
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b)


def slot_mask(token_slots: torch.Tensor, num_slots: int, width: int) -> torch.Tensor:
    """[tokens, num_slots * width]: 1 where the column belongs to the token's slot
    (-1: no slot, all zeros)."""
    onehot = token_slots.unsqueeze(1) == torch.arange(num_slots, device=token_slots.device)
    return onehot.repeat_interleave(width, dim=1).to(torch.get_default_dtype())


def add_lora_masked(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    """y += ((x @ A_all.T) * mask) @ B_all, with A_all/B_all every slot's rows stacked."""
    slots, width, _ = lora_a.shape
    xa = x @ lora_a.view(slots * width, -1).t()
    xa.mul_(mask)
    y.addmm_(xa, lora_b.view(slots * width, -1))
