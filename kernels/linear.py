"""Linear layers whose weights oneDNN has reordered for the CPU's GEMM kernels, once at load.

A decode step multiplies a few rows by every weight matrix, which is bound by reading the
weights: oneDNN's blocked layout streams them faster than MKL reading the plain row-major
matrix each time (16 rows x the demo model's 16 projections: 1.3 vs 2.2 ms; prefills
gain about 20 %). The products differ from `F.linear`'s in the last bits (another
summation order), as two BLAS libraries' do.

float32 everywhere; bfloat16 where the CPU has bf16 dot products (oneDNN then runs its
AVX-512 BF16 or AMX kernels, accumulating in float32); `prepack` leaves anything else alone.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from kernels import cpu_features

# The row count oneDNN tunes the layout for; any count works (decode batches are around it).
BATCH_HINT = 16


def available() -> bool:
    # torch leaves mkldnn.is_available unannotated.
    return torch.backends.mkldnn.is_available() and hasattr(  # type: ignore[no-untyped-call]
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def native_bf16() -> bool:
    """bfloat16 GEMMs are native here: the CPU has bf16 dot products and oneDNN uses them."""
    return (
        cpu_features.native_bf16() and available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def packable_dtypes() -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.bfloat16) if native_bf16() else (torch.float32,)


class PrepackedLinear(nn.Module):
    """`nn.Linear` (CPU, float32 or bfloat16) over a oneDNN-reordered copy of its weight."""

    def __init__(
        self, packed: torch.Tensor, bias: torch.Tensor | None, keep: torch.Tensor | None = None
    ) -> None:
        """`packed`: the weight in oneDNN's layout; `keep`: what holds its bytes where it does
        not own them (a mapped file, engine/checkpoints/weights_cache.py)."""
        super().__init__()
        self.out_features, self.in_features = packed.shape
        self.packed, self.bias, self.keep = packed, bias, keep

    @classmethod
    def reorder(cls, linear: nn.Linear) -> PrepackedLinear:
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        return cls(packed, None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out


def prepack(module: nn.Module) -> int:
    """Replace every CPU `nn.Linear` under `module` whose dtype oneDNN runs natively by a
    PrepackedLinear; returns how many. The plain weights are dropped unless something else
    holds them (tied embeddings)."""
    dtypes = packable_dtypes()
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            if child.weight.dtype in dtypes and child.weight.device.type == "cpu":
                setattr(module, name, PrepackedLinear.reorder(child))
                count += 1
        else:
            count += prepack(child)
    return count


def packed_bytes(packed: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A reordered weight's bytes (oneDNN's blocked layout, read in place) and the serialized
    descriptor that `from_packed_bytes` rebuilds it from."""
    size = torch.ops.mkldnn._nbytes(packed)
    address = torch.ops.mkldnn.data_ptr(packed)
    data = memoryview((ctypes.c_uint8 * size).from_address(address)).cast("B")
    return data, torch.ops.mkldnn._get_mkldnn_serialized_md(packed)


def from_packed_bytes(
    data: torch.Tensor, shape: list[int], dtype: torch.dtype, descriptor: torch.Tensor
) -> torch.Tensor:
    """The reordered weight over `data` (uint8, no copy; the caller keeps it alive)."""
    weight: torch.Tensor = torch.ops.loragate.packed_weight_from_bytes(
        data, shape, dtype, descriptor
    )
    return weight
