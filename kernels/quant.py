"""int8 linears (`--quantization int8`): int8 weights and int8 activations (W8A8) for every
linear of a decoder layer (q/k/v, o, gate/up, down), the first three smoothed so that their
activations quantize, down_proj's quantized in groups.

Why W8A8 and not int8 weights alone: on a CPU without AMX a decode step of a small model
is already bound by arithmetic at 16 sequences (bf16 GEMMs run near their peak), so halving
the weights' bytes buys little, while VNNI's int8 dot products do twice the work of bf16's
per instruction. Our C++ linear (kernels/csrc/int8_gemm.cpp: quantize, GEMM over a weight
packed at load, scale back, one op) runs them; elsewhere torch's int8 GEMM (`_int_mm`). A
token's activations are quantized per row (max |x| / 127), or per group of inputs, and the
weights per output channel.

Why smoothing: a small model's activations have a few channels far larger than the rest,
and per-token int8 flattens everything else to a few levels (SmolLM2's perplexity: +11 %
with every projection quantized). SmoothQuant (Xiao et al. 2022) moves that range into the
weights: each input channel j of a linear is divided by s_j = max|x_j|^a / max|W_j|^(1 - a)
and the weight's column j is multiplied by it, which leaves the product unchanged. The
division is folded into what feeds the linear: the RMSNorm weight before q/k/v and before
gate/up, the value projection's rows before o (shared by the query heads of one KV head, so
their channels take one scale). down_proj's outliers move from token to token, which no
per-channel scale follows; it takes a scale per group of inputs instead (DOWN_PROJ_GROUP).
max|x_j| comes from a short calibration text run through the model at load
(kernels/quant_calibration.py).

The embedding and the lm_head keep the compute dtype. Quality gate (`loragate bench
quantization`): perplexity within 2 % of bf16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("int8",)
# The projections quantized: every linear of a decoder layer.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Those whose input is smoothed (the rest are quantized in groups, below).
SMOOTHED = ("qkv_proj", "o_proj", "gate_up_proj")
# How much of the activations' range moves into the weights (SmoothQuant's alpha): SmolLM2's
# perplexity +0.95 %, +0.48 %, +0.39 % at 0.5, 0.6, 0.7 with the calibration text as it is.
SMOOTHING_ALPHA = 0.7
# down_proj's input, silu(gate) * up, has outliers that move from token to token, which no
# per-channel smoothing flattens: one scale per token raised SmolLM2's perplexity by 2.6 %
# more than bf16's (3.5 % smoothed through up's rows). One scale per group of this many
# inputs of a token confines an outlier to its group: +1.46 % in all at 128 (64: +1.1 %),
# the same as with down_proj left in bf16.
DOWN_PROJ_GROUP = 128
# The C++ linear (kernels/csrc/int8_gemm.cpp, AVX-512 VNNI) computes 16 outputs a vector and
# quantizes 16 inputs a vector.
VNNI_COLS = 16


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's groups of `group` inputs to int8 with their own scale: (int8 [rows, cols],
    float32 scales [rows, cols / group]). group = cols is per-token quantization."""
    rows, cols = x.shape
    xf = x.float().view(rows, cols // group, group)
    scales = xf.abs().amax(dim=2).clamp(min=1e-8) / 127.0
    q = torch.round(xf / scales[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(rows, cols), scales


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row to int8 with its own scale: (int8 [rows, cols], float32 scales [rows]).
    The specification of torch.ops.loragate.quantize_rows."""
    q, scales = quantize_groups(x, x.shape[1])
    return q, scales[:, 0]


def dequantize_mm(
    acc: torch.Tensor,
    row_scales: torch.Tensor,
    col_scales: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """out = acc * row_scales[:, None] * col_scales (+ bias): the specification of
    torch.ops.loragate.dequantize_mm."""
    y = acc.float() * row_scales[:, None] * col_scales
    if bias is not None:
        y = y + bias
    out.copy_(y)


def int8_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """The specification of torch.ops.loragate.int8_linear: x [rows, in] quantized in groups,
    int32 sums per group scaled by the group's scale and added up in float32, then the
    weight's scale per output (and the bias), in x's dtype."""
    xq, scales = quantize_groups(x, group)
    y = None
    for g, start in enumerate(range(0, x.shape[1], group)):
        acc = torch._int_mm(xq[:, start : start + group], qweight[:, start : start + group].t())
        part = acc.float() * scales[:, g : g + 1]
        y = part if y is None else y + part
    assert y is not None
    y = y * weight_scales
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


class Int8Linear(nn.Module):
    """A linear over int8 weight rows (per-row scales) and int8 activations quantized as each
    step runs, per token or per `group` inputs of a token."""

    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] float32

    def __init__(self, linear: nn.Linear, group: int | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group = group or self.in_features
        if self.in_features % self.group:
            raise ValueError(f"group {self.group} does not divide {self.in_features} inputs")
        q, scales = quantize_rows(linear.weight.detach())
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        bias = linear.bias
        self.bias = None if bias is None else bias.detach().float()
        self.native = False  # the C++ halves (kernels.native), set by the model runner
        # The weight packed for the C++ linear, and its column sums per group (pack_for_vnni).
        self.packed: torch.Tensor | None = None
        self.col_sums: torch.Tensor | None = None

    def pack_for_vnni(self) -> None:
        """[out / 16, in / 4, 16, 4]: four consecutive inputs of sixteen outputs per 64 bytes,
        as kernels/csrc/int8_gemm.cpp reads them; column sums [in / group, out]."""
        out_f, in_f = self.qweight.shape
        blocks = self.qweight.view(out_f // VNNI_COLS, VNNI_COLS, in_f // 4, 4)
        self.packed = blocks.permute(0, 2, 1, 3).contiguous()
        groups = self.qweight.view(out_f, in_f // self.group, self.group)
        self.col_sums = groups.sum(dim=2, dtype=torch.int32).t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        if self.packed is not None:
            out = self._packed_linear(rows, gated=False)
        elif self.native and self.group == self.in_features:
            out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
            xq, row_scales = torch.ops.loragate.quantize_rows(rows)
            acc = torch._int_mm(xq, self.qweight.t())
            torch.ops.loragate.dequantize_mm(acc, row_scales, self.scales, self.bias, out)
        else:
            out = int8_linear_reference(rows, self.qweight, self.scales, self.bias, self.group)
        return out.view(*x.shape[:-1], self.out_features)

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) from the fused gate/up output [..., 2 * in_features]: in the
        C++ linear the product is computed as its rows are quantized (one pass over gate/up
        instead of three); elsewhere torch's two ops first."""
        if self.packed is None:
            gate, up = gate_up.split(self.in_features, dim=-1)
            return self(F.silu(gate) * up)
        rows = gate_up.reshape(-1, 2 * self.in_features).contiguous()
        return self._packed_linear(rows, gated=True).view(*gate_up.shape[:-1], self.out_features)

    def _packed_linear(self, rows: torch.Tensor, gated: bool) -> torch.Tensor:
        return torch.ops.loragate.int8_linear(
            rows, self.packed, self.col_sums, self.scales, self.bias, self.group, gated
        )


@torch.no_grad()
def activation_ranges(
    model: nn.Module, run: Callable[[list[int]], Any], batches: Iterable[list[int]]
) -> dict[str, torch.Tensor]:
    """max |x_j| per input channel of every projection, over `run(ids)` of each batch."""
    ranges: dict[str, torch.Tensor] = {}

    def observe(name: str) -> Callable[..., None]:
        def hook(_: nn.Module, inputs: tuple[torch.Tensor, ...], __: Any) -> None:
            x = inputs[0].detach().float().abs().reshape(-1, inputs[0].shape[-1]).amax(0)
            ranges[name] = torch.maximum(ranges[name], x) if name in ranges else x

        return hook

    hooks = [
        module.register_forward_hook(observe(name))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in SMOOTHED
    ]
    try:
        for ids in batches:
            run(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


def _smoothing(x_range: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    w_range = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    return (x_range.clamp(min=1e-5) ** alpha / w_range ** (1 - alpha)).clamp(min=1e-5)


def _scale_(param: torch.Tensor, factor: torch.Tensor) -> None:
    """param *= factor, computed in float32 and rounded once to the parameter's dtype."""
    param.copy_(param.float() * factor)


@torch.no_grad()
def smooth(model: Any, ranges: dict[str, torch.Tensor], alpha: float = SMOOTHING_ALPHA) -> None:
    """Fold SmoothQuant's per-channel scales into every decoder layer (see the module doc):
    the model computes the same function, with activations of a flatter range."""
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"layers.{i}."
        s = _smoothing(ranges[prefix + "self_attn.qkv_proj"], attn.qkv_proj.weight, alpha)
        _scale_(layer.input_layernorm.weight, 1 / s)
        _scale_(attn.qkv_proj.weight, s)
        s = _smoothing(ranges[prefix + "mlp.gate_up_proj"], mlp.gate_up_proj.weight, alpha)
        _scale_(layer.post_attention_layernorm.weight, 1 / s)
        _scale_(mlp.gate_up_proj.weight, s)
        # o_proj's input channel (head h, i) is value channel (h's KV head, i): the query
        # heads of one KV head share the scale, their largest.
        per_kv = attn.num_heads // attn.num_kv_heads
        s = _smoothing(ranges[prefix + "self_attn.o_proj"], attn.o_proj.weight, alpha)
        s = s.view(attn.num_kv_heads, per_kv, attn.head_dim).amax(dim=1)
        values = attn.qkv_proj.weight[attn.q_size + attn.kv_size :]
        _scale_(values, 1 / s.reshape(-1, 1))
        if attn.qkv_proj.bias is not None:
            _scale_(attn.qkv_proj.bias[attn.q_size + attn.kv_size :], 1 / s.reshape(-1))
        _scale_(attn.o_proj.weight, s[:, None, :].expand(-1, per_kv, -1).reshape(-1))


def quantize(module: nn.Module) -> int:
    """Replace every projection under `module` by its Int8Linear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and name in PROJECTIONS:
            setattr(module, name, Int8Linear(child, _group(name, child.in_features)))
            count += 1
        else:
            count += quantize(child)
    return count


def _group(name: str, in_features: int) -> int:
    """down_proj's group (DOWN_PROJ_GROUP) where it divides the width; per token elsewhere."""
    if name == "down_proj" and in_features % DOWN_PROJ_GROUP == 0:
        return DOWN_PROJ_GROUP
    return in_features


def use_native(module: nn.Module, enabled: bool) -> None:
    vnni = enabled and bool(torch.ops.loragate.int8_linear_available())
    for child in module.modules():
        if isinstance(child, Int8Linear):
            child.native = enabled
            shapes_fit = child.out_features % VNNI_COLS == 0 and child.group % VNNI_COLS == 0
            if vnni and shapes_fit:
                child.pack_for_vnni()
            else:
                child.packed = child.col_sums = None
