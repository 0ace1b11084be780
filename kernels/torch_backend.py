"""The torch kernels: the specification every other backend matches (tests hold them
equal), and what runs where neither the C++ nor the triton kernels do."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels import quant
from kernels.attention import AttentionPlan, StepMetadata, build_plan, paged_attention, write_kv
from kernels.backend import Backend, Kernels, LoRAPoolView, LoRAStep, LoRASteps, Rope
from kernels.lora import LoRAGroup, SlotRows, add_lora


def rope_rows(
    positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, dtype: torch.dtype
) -> Rope:
    """Each token's cos and signed sin, [num_tokens, 1, head_dim], rounded to `dtype`."""
    return (cos[positions].unsqueeze(1).to(dtype), signed_sin[positions].unsqueeze(1).to(dtype))


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    # rotate_half(x) * sin == roll(x, half) * signed_sin: the sign flip is exact.
    cos, signed_sin = rope
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Computed in float32 exactly as HF does, so greedy outputs match token for token."""
    if x.dtype == torch.float32:
        # One fused op, bitwise equal to the formula below in float32.
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def slot_runs(token_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's runs of equal slots: (slot, start, end) per run, as three arrays. The model
    runner orders rows by slot where the kernels pad nothing, and then each adapter's tokens
    are a run or two."""
    starts = np.flatnonzero(np.diff(token_slots, prepend=token_slots[0] - 1))
    ends = np.append(starts[1:], len(token_slots))
    return token_slots[starts], starts, ends


class TorchLoRAStep:
    """A group of rows per slot: a slice where its tokens are one run, else their indices."""

    __slots__ = ("pool", "groups", "slots")

    def __init__(self, pool: LoRAPoolView, groups: list[LoRAGroup]) -> None:
        self.pool = pool
        self.groups = groups
        # Per target: the pool's offsets and widths, as they stand for this step.
        self.slots = [SlotRows(o, w) for o, w in zip(pool.offsets, pool.widths, strict=True)]

    def apply(self, layer: int, target: int, x: torch.Tensor, y: torch.Tensor) -> None:
        pool = self.pool
        a, b = pool.layer_a[target][layer], pool.layer_b[target][layer]
        add_lora(y, x, a, b, self.groups, self.slots[target])


class TorchLoRASteps:
    def __init__(self, pool: LoRAPoolView, device: torch.device) -> None:
        self.pool = pool
        self.device = device

    def step(self, token_slots: np.ndarray) -> LoRAStep:
        run_slots, starts, ends = slot_runs(token_slots)
        groups = []
        for slot in np.unique(run_slots[run_slots >= 0]).tolist():
            mine = run_slots == slot
            if mine.sum() == 1:
                i = int(np.flatnonzero(mine)[0])
                groups.append(LoRAGroup(slot, slice(int(starts[i]), int(ends[i]))))
            else:
                rows = torch.from_numpy(np.flatnonzero(token_slots == slot)).to(self.device)
                groups.append(LoRAGroup(slot, rows))
        return TorchLoRAStep(self.pool, groups)

    def pool_changed(self) -> None:
        pass  # a step reads the pool's offsets and widths as they stand


class TorchKernels(Kernels):
    backend = Backend.TORCH

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def plan(self, step: StepMetadata) -> AttentionPlan:
        return build_plan(step, self.device)

    def row_rank(self, num_computed_tokens: int, lora_slot: int) -> int:
        # Decode rows are attended in groups of similar length: shortest first.
        return num_computed_tokens

    def rope(
        self,
        positions: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        dtype: torch.dtype,
    ) -> Rope:
        return rope_rows(positions, cos, signed_sin, dtype)

    def rotate(self, qk: torch.Tensor, rope: Rope) -> torch.Tensor:
        return apply_rope(qk, rope)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, *kv_cache, plan.slot_mapping)
        return paged_attention(q, k, v, kv_cache, plan, scale)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return rms_norm(residual.add_(delta), weight, eps)

    def quantize(self, module: nn.Module) -> int:
        return quant.quantize(module)

    def lora_steps(self, pool: LoRAPoolView, max_rank: int) -> LoRASteps:
        return TorchLoRASteps(pool, self.device)
