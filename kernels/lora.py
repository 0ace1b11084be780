"""Multi-LoRA for one batch: each token group adds its own adapter's low-rank update.

The torch reference (the specification, used on CPU): for each group of tokens
sharing an adapter slot, shrink `x @ A[slot].T` then expand `@ B[slot]` into
the rows of `y`. Stacks are padded to the largest rank; `widths[slot]` says how
many rows of that slot are in use, so a rank-4 adapter in a rank-16 stack costs
rank-4 work. Triton shrink/expand kernels with this signature come with the
kernels issue.
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
