"""Linear layers whose weights are reordered once, at load, for the CPU's GEMM kernels.

A decode step multiplies a few rows by every weight matrix. Two layouts, chosen once per
process and dtype (`packer`):

- `PanelLinear` (float32 on processors whose widest vectors are 256 bits, AVX2 with FMA): the
  weight in panels of 16 output columns and our register-blocked GEMM (kernels/csrc/
  panel_linear.cpp). On a Zen 3 without AVX-512 a decode step's projections run 1.3-1.9x
  faster than oneDNN's prepacked kernels, prompt chunks 1.1-1.3x (issue 43). A fused gate/up
  projection packs as `GateUpPanelLinear`, whose silu(gate) * up comes out of the GEMM's pass.
- `OneDNNLinear` (float32 elsewhere, and bfloat16 where the CPU has bf16 dot products): oneDNN's
  blocked layout, which streams the weights faster than MKL reading the plain row-major matrix
  each time (16 rows x the demo model's 16 projections: 1.3 vs 2.2 ms on Zen 4; prefills gain
  about 20 %); oneDNN runs its AVX-512, AVX-512 BF16 or AMX kernels, accumulating in float32.

Either's products differ from `F.linear`'s in the last bits (another summation order), as
two BLAS libraries' do. `prepack` leaves other dtypes alone.
"""

from __future__ import annotations

import abc
import ctypes
from typing import Any, ClassVar

import torch
from torch import nn

from kernels import cpu_features, native

# The row count oneDNN tunes the layout for; any count works (decode batches are around it).
BATCH_HINT = 16
PANEL = 16  # output columns a panel holds (kernels/csrc/panel_linear.cpp's kPanel)


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


class PrepackedLinear(nn.Module, abc.ABC):
    """`nn.Linear` (CPU) over a copy of its weight reordered for one GEMM kernel. `packed`: the
    weight in that layout; `keep`: what holds its bytes where it does not own them (a mapped
    file, engine/checkpoints/weights_cache.py). A layout says how to pack a weight, how to hand
    its bytes out and how to rebuild it over them."""

    layout: ClassVar[str]

    def __init__(
        self,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        shape: tuple[int, int],
        keep: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        self.packed, self.bias, self.keep = packed, bias, keep

    @classmethod
    def reorder(cls, linear: nn.Linear) -> PrepackedLinear:
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(
            cls.pack(linear.weight.detach()), bias, (linear.out_features, linear.in_features)
        )

    @staticmethod
    @abc.abstractmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """`weight` [out_features, in_features] in this layout."""

    @abc.abstractmethod
    def to_bytes(self) -> tuple[memoryview, torch.Tensor | None]:
        """The reordered weight's bytes, read in place, and what else `from_bytes` needs to
        rebuild it over them (a layout descriptor, or None)."""

    @classmethod
    @abc.abstractmethod
    def from_bytes(
        cls,
        data: torch.Tensor,
        shape: tuple[int, int],
        dtype: torch.dtype,
        descriptor: torch.Tensor | None,
    ) -> torch.Tensor:
        """The reordered weight over `data` (uint8, no copy; the caller keeps it alive)."""


class OneDNNLinear(PrepackedLinear):
    """Over oneDNN's blocked layout (float32, or bfloat16 with bf16 dot products)."""

    layout = "onednn"

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out

    def to_bytes(self) -> tuple[memoryview, torch.Tensor | None]:
        size = torch.ops.mkldnn._nbytes(self.packed)
        address = torch.ops.mkldnn.data_ptr(self.packed)
        data = memoryview((ctypes.c_uint8 * size).from_address(address)).cast("B")
        return data, torch.ops.mkldnn._get_mkldnn_serialized_md(self.packed)

    @classmethod
    def from_bytes(
        cls,
        data: torch.Tensor,
        shape: tuple[int, int],
        dtype: torch.dtype,
        descriptor: torch.Tensor | None,
    ) -> torch.Tensor:
        if descriptor is None:
            raise ValueError("a oneDNN weight needs its layout descriptor")
        weight: torch.Tensor = torch.ops.loragate.packed_weight_from_bytes(
            data, list(shape), dtype, descriptor
        )
        return weight


class PanelLinear(PrepackedLinear):
    """Over panels of 16 output columns, k-major: [ceil(out / 16), in, 16] (float32)."""

    layout = "panels"

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        packed: torch.Tensor = torch.ops.loragate.pack_panels(weight)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.loragate.panel_linear(
            x, self.packed, self.bias, self.out_features
        )
        return out

    def to_bytes(self) -> tuple[memoryview, torch.Tensor | None]:
        flat: Any = self.packed.detach().reshape(-1).view(torch.uint8).numpy()
        return memoryview(flat), None

    @classmethod
    def from_bytes(
        cls,
        data: torch.Tensor,
        shape: tuple[int, int],
        dtype: torch.dtype,
        descriptor: torch.Tensor | None,
    ) -> torch.Tensor:
        out_features, in_features = shape
        panels = -(-out_features // PANEL)
        if dtype != torch.float32 or data.numel() != panels * in_features * PANEL * 4:
            raise ValueError(f"{data.numel()} bytes are not float32 panels of {shape}")
        return data.view(torch.float32).view(panels, in_features, PANEL)


class GateUpPanelLinear(PanelLinear):
    """An MLP's fused gate/up projection ([gate | up], a multiple of 16 outputs, no bias) over
    panels of eight gate and eight up columns of the same units: `forward` gives [gate | up] (a
    LoRA adds to it before the activation), `silu_mul` gives silu(gate) * up in the same pass."""

    layout = "gate_up_panels"

    @classmethod
    def reorder(cls, linear: nn.Linear) -> PrepackedLinear:
        if linear.bias is not None or linear.out_features % (2 * 8):
            return PanelLinear.reorder(linear)  # no pairs to make: plain panels
        return super().reorder(linear)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        packed: torch.Tensor = torch.ops.loragate.pack_gate_up_panels(weight)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.loragate.gate_up_panel_linear(x, self.packed)
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.loragate.silu_mul_panel_linear(x, self.packed)
        return out


LAYOUTS: dict[str, type[PrepackedLinear]] = {
    cls.layout: cls for cls in (OneDNNLinear, PanelLinear, GateUpPanelLinear)
}
# Fused gate/up projections by their name in engine/models (packed as gate/up panels).
GATE_UP_NAMES = frozenset({"gate_up_proj"})


def packer(dtype: torch.dtype) -> type[PrepackedLinear] | None:
    """The layout this process reorders `dtype` weights into, or None to leave them as they are:
    panels for float32 where the C++ kernels are built for 256-bit vectors with FMA, oneDNN for
    every dtype it runs natively otherwise."""
    if dtype == torch.float32 and native.load() and torch.ops.loragate.panel_linear_preferred():
        return PanelLinear
    return OneDNNLinear if available() and dtype in packable_dtypes() else None


def prepack(module: nn.Module) -> int:
    """Replace every CPU `nn.Linear` under `module` whose dtype has a layout here (`packer`) by
    its PrepackedLinear (a fused gate/up projection in panels by GateUpPanelLinear); returns how
    many. The plain weights are dropped unless something else holds them (tied embeddings)."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            cls = packer(child.weight.dtype) if child.weight.device.type == "cpu" else None
            if cls is PanelLinear and name in GATE_UP_NAMES:
                cls = GateUpPanelLinear
            if cls is not None:
                setattr(module, name, cls.reorder(child))
                count += 1
        else:
            count += prepack(child)
    return count
