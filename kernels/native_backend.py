"""The C++ CPU kernels (kernels/csrc, loaded by kernels.native): norms with the residual add
fused in, rotary and the KV write in place, decode attention reading blocks where they lie
(and prompts' attention too where the CPU has bf16 dot products), multi-LoRA over runs of
rows. Each matches its torch twin in kernels/torch_backend.py."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kernels import native, quant
from kernels.attention import (
    AttentionPlan,
    StepMetadata,
    build_native_decode_plan,
    build_native_plan,
    paged_attention,
)
from kernels.backend import Backend, Kernels, LoRAPoolView, LoRAStep, LoRASteps, Rope
from kernels.torch_backend import rope_rows, slot_runs


class NativeLoRAStep:
    __slots__ = ("pool", "runs")

    def __init__(self, pool: LoRAPoolView, runs: torch.Tensor) -> None:
        self.pool = pool
        self.runs = runs  # [n, 3] int64: (slot, start, end) per run of adapted rows

    def apply(self, layer: int, target: int, x: torch.Tensor, y: torch.Tensor) -> None:
        pool = self.pool
        a, b = pool.layer_a[target][layer], pool.layer_b[target][layer]
        torch.ops.loragate.add_lora_sgmv(y, x, a, b, self.runs, pool.tables[target])


class NativeLoRASteps:
    def __init__(self, pool: LoRAPoolView) -> None:
        self.pool = pool

    def step(self, token_slots: np.ndarray) -> LoRAStep:
        run_slots, starts, ends = slot_runs(token_slots)
        adapted = run_slots >= 0
        runs = np.stack([run_slots[adapted], starts[adapted], ends[adapted]], axis=1)
        return NativeLoRAStep(self.pool, torch.from_numpy(np.ascontiguousarray(runs)))

    def pool_changed(self) -> None:
        pass  # the op reads the pool's slot tables as it runs


class NativeKernels(Kernels):
    backend = Backend.NATIVE

    def __init__(
        self, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int
    ) -> None:
        """The C++ ops must be loaded (kernels.native.load) and take `dtype`; the prompts'
        attention goes to them too where they run caches of this kind."""
        self.device = device
        self._build_plan = (
            build_native_plan
            if native.prefill_attention_available(dtype, head_dim, block_size)
            else build_native_decode_plan
        )

    def plan(self, step: StepMetadata) -> AttentionPlan:
        return self._build_plan(step, self.device)

    def row_rank(self, num_computed_tokens: int, lora_slot: int) -> int:
        # The C++ attention pads nothing: rows go by slot, each adapter's tokens one run.
        return lora_slot

    def rope(
        self,
        positions: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        dtype: torch.dtype,
    ) -> Rope:
        return rope_rows(positions, cos, signed_sin, dtype)

    def rotate(self, qk: torch.Tensor, rope: Rope) -> torch.Tensor:
        torch.ops.loragate.rotary_(qk, *rope)
        return qk

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        scale: float,
    ) -> torch.Tensor:
        torch.ops.loragate.write_kv(k, v, *kv_cache, plan.slot_mapping)
        # The plan built for these kernels sends its decode rows (and its prefill rows, where
        # build_native_plan made it) to the C++ attention.
        return paged_attention(q, k, v, kv_cache, plan, scale)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.loragate.rms_norm(x, weight, eps, out)
        return out

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        out = torch.empty_like(residual)
        torch.ops.loragate.add_rms_norm(residual, delta, weight, eps, out)
        return out

    def quantize(self, module: nn.Module) -> int:
        return quant.quantize_native(module)

    def lora_steps(self, pool: LoRAPoolView, max_rank: int) -> LoRASteps:
        return NativeLoRASteps(pool)
