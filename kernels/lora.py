"""Multi-LoRA for one batch: each token group adds its own adapter's low-rank update.

The adapters of one LoRA-targeted linear live in a pool of rows (engine/lora/pool.py):

    pool_a [rows, in]    A's rows of every resident adapter, each adapter's rows contiguous
    pool_b [rows, out]   B transposed, the scaling folded in, zero outside a module's columns

slot s owns rows [offsets[s], offsets[s] + widths[s]), its rank times the modules it adapts;
nothing is padded to the largest rank, so an adapter costs its own rank's work and bytes.

`add_lora` is the specification: for each group of tokens under one slot, shrink
`x @ A.T`, round to the model dtype, expand `@ B` into the group's rows of y. The C++ op
(`torch.ops.loragate.add_lora_sgmv`, kernels/csrc/lora.cpp) and the triton kernels
(kernels/triton/lora_shrink_expand.py) compute the same from a step's runs or segments.
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


@dataclass(frozen=True, slots=True)
class SlotRows:
    """Where each slot's rows lie in one LoRA-targeted linear's pool: slot s owns rows
    [offsets[s], offsets[s] + widths[s]) (engine/lora/pool.py's `offsets[target]` and
    `widths[target]`, read as they are)."""

    offsets: Sequence[int]
    widths: Sequence[int]


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    pool_a: torch.Tensor,
    pool_b: torch.Tensor,
    groups: Sequence[LoRAGroup],
    slots: SlotRows,
) -> None:
    """y[rows] += (x[rows] @ A.T) @ B for every group, in place, with A and B the group's
    slot's rows (`slots`) of pool_a [rows, in] and pool_b [rows, out]."""
    offsets, widths = slots.offsets, slots.widths
    for group in groups:
        width = widths[group.slot]
        if width == 0:
            continue
        first = offsets[group.slot]
        a = pool_a[first : first + width]
        b = pool_b[first : first + width]
        rows = group.rows
        if isinstance(rows, slice):
            y[rows].addmm_(x[rows] @ a.t(), b)
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b)
