"""The triton kernels (kernels/triton), through `kernels.triton.ops` as kernels.dispatch
imported it: compiled on CUDA, interpreted on the CPU. This module imports nothing of
triton itself, so that importing it never decides between the two."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from kernels import quant
from kernels.attention import AttentionPlan, StepMetadata, build_triton_plan
from kernels.backend import Backend, Kernels, LoRAPoolView, LoRAStep, LoRASteps, Rope

if TYPE_CHECKING:
    from kernels.triton.lora_shrink_expand import LoRABatch, SlotLayout


class TritonLoRAStep:
    """Each slot's tokens gathered wherever they are: one segment per slot."""

    __slots__ = ("ops", "pool", "batch", "layouts")

    def __init__(
        self, ops: ModuleType, pool: LoRAPoolView, batch: LoRABatch, layouts: list[SlotLayout]
    ) -> None:
        self.ops = ops
        self.pool = pool
        self.batch = batch
        self.layouts = layouts  # per target: the slots' rows, widths and module blocks

    def apply(self, layer: int, target: int, x: torch.Tensor, y: torch.Tensor) -> None:
        pool = self.pool
        a, b = pool.layer_a[target][layer], pool.layer_b[target][layer]
        self.ops.add_lora(y, x, a, b, self.layouts[target], self.batch)


class TritonLoRASteps:
    def __init__(
        self, ops: ModuleType, pool: LoRAPoolView, max_rank: int, device: torch.device
    ) -> None:
        self.ops = ops
        self.pool = pool
        self.max_rank = max_rank
        self.device = device
        self._layouts: list[SlotLayout] | None = None  # per target; remade after slots change

    def step(self, token_slots: np.ndarray) -> LoRAStep:
        batch = self.ops.lora_batch(torch.from_numpy(token_slots), self.device)
        assert batch is not None, "a step with adapted tokens"
        if self._layouts is None:
            pool = self.pool
            self._layouts = self.ops.slot_layouts(
                pool.offsets, pool.widths, pool.segments, self.max_rank, self.device
            )
        return TritonLoRAStep(self.ops, self.pool, batch, self._layouts)

    def pool_changed(self) -> None:
        self._layouts = None


class TritonKernels(Kernels):
    backend = Backend.TRITON

    def __init__(self, ops: ModuleType, device: torch.device) -> None:
        """`ops`: kernels.triton.ops (kernels.dispatch.triton_ops)."""
        self.ops = ops
        self.device = device

    def plan(self, step: StepMetadata) -> AttentionPlan:
        return build_triton_plan(step, self.device)

    def row_rank(self, num_computed_tokens: int, lora_slot: int) -> int:
        # The triton attention pads nothing: rows go by slot, each adapter's tokens one run.
        return lora_slot

    def rope(
        self,
        positions: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        dtype: torch.dtype,
    ) -> Rope:
        # The kernel reads each token's row of the float32 tables itself.
        return (positions, cos, signed_sin)

    def rotate(self, qk: torch.Tensor, rope: Rope) -> torch.Tensor:
        rotated: torch.Tensor = self.ops.rotary_(qk, *rope)
        return rotated

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        scale: float,
    ) -> torch.Tensor:
        assert plan.paged is not None, "a plan built for the triton kernels"
        self.ops.write_kv(k, v, *kv_cache, plan.slot_mapping)
        out: torch.Tensor = self.ops.paged_attention(q, kv_cache, plan.paged, scale)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        normed: torch.Tensor = self.ops.rms_norm(x, weight, eps)
        return normed

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        normed: torch.Tensor = self.ops.add_rms_norm(residual, delta, weight, eps)
        return normed

    def quantize(self, module: nn.Module) -> int:
        return quant.quantize(module)

    def lora_steps(self, pool: LoRAPoolView, max_rank: int) -> LoRASteps:
        return TritonLoRASteps(self.ops, pool, max_rank, self.device)
