"""What the engine calls of its kernels, whichever implementation runs them.

    kernels/torch_backend.py   the torch specifications
    kernels/native_backend.py  kernels/csrc's C++ ops (CPU, float32 or bfloat16)
    kernels/triton_backend.py  kernels/triton (CUDA; on the CPU under triton's interpreter)

`kernels.dispatch.choose` builds one of them per engine, from its config. The model's
modules and the LoRA manager are handed it as they are built and call it without asking
which it is: the backend is chosen once, not at every call.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn

from kernels.attention import AttentionPlan, StepMetadata


class Backend(enum.Enum):
    TRITON = "triton"
    NATIVE = "native"
    TORCH = "torch"


# A step's rotary input as its backend reads it, built once per step for every layer: the
# torch and C++ paths' per-token (cos, signed_sin), each [num_tokens, 1, head_dim]; the
# triton path's (positions, cos table, signed_sin table), whose kernel looks rows up itself.
Rope = tuple[torch.Tensor, ...]


class LoRAStep(Protocol):
    """One forward pass's adapters: which tokens run under which slot, as the backend's
    LoRA kernel reads that. Every LoRA-targeted linear of every layer calls `apply`."""

    def apply(self, layer: int, target: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the step's adapters' contribution for fused target `target` of `layer`."""
        ...


class LoRAPoolView(Protocol):
    """What the LoRA kernels read of engine/lora/pool.py's `LoRAPool`, per fused target."""

    @property
    def layer_a(self) -> Sequence[Sequence[torch.Tensor]]: ...  # [target][layer] -> [rows, in]
    @property
    def layer_b(self) -> Sequence[Sequence[torch.Tensor]]: ...  # [target][layer] -> [rows, out]
    @property
    def tables(self) -> Sequence[torch.Tensor]: ...  # the C++ op's slot tables
    @property
    def offsets(self) -> Sequence[Sequence[int]]: ...  # [target][slot]: first row
    @property
    def widths(self) -> Sequence[Sequence[int]]: ...  # [target][slot]: rows
    @property
    def segments(self) -> Sequence[Sequence[Sequence[tuple[int, int, int, int]]]]: ...


class LoRASteps(Protocol):
    """Builds each step's `LoRAStep` over one pool."""

    def step(self, token_slots: np.ndarray) -> LoRAStep:
        """The step whose tokens run under `token_slots` (-1: base model only; one at least
        is adapted)."""
        ...

    def pool_changed(self) -> None:
        """Adapters moved in the pool (placed, evicted, compacted): what was derived from
        its layout is stale."""
        ...


class Kernels(Protocol):
    """One engine's kernels, on its device."""

    device: torch.device

    @property
    def backend(self) -> Backend: ...

    def plan(self, step: StepMetadata) -> AttentionPlan:
        """The step's attention plan for these kernels (kernels.attention's builder of
        theirs)."""
        ...

    def row_rank(self, num_computed_tokens: int, lora_slot: int) -> int:
        """Where a row goes among the step's decode rows (or among its prefill rows), lowest
        first: by length where attention groups rows of similar length, else by LoRA slot,
        so that each adapter's tokens are one run of rows."""
        ...

    def rope(
        self,
        positions: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        dtype: torch.dtype,
    ) -> Rope:
        """The step's rotary input from the model's float32 tables ([max_len, head_dim])."""
        ...

    def rotate(self, qk: torch.Tensor, rope: Rope) -> torch.Tensor:
        """qk ([num_tokens, heads, head_dim], q and k heads side by side) rotated: in place
        where the kernel can, so the caller uses what is returned."""
        ...

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        scale: float,
    ) -> torch.Tensor:
        """The step's k and v written to their cache slots, then paged attention of q."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm rounded as HF rounds it (computed in float32)."""
        ...

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta (in place), then the norm of the sum."""
        ...

    def quantize(self, module: nn.Module) -> int:
        """`--quantization int8`: every projection under `module` made an int8 linear
        (kernels.quant.quantize; quantize_native on the C++ kernels) running on these kernels;
        returns how many."""
        ...

    def lora_steps(self, pool: LoRAPoolView, max_rank: int) -> LoRASteps:
        """The builder of each step's adapters over `pool` (adapters of rank <= max_rank)."""
        ...
