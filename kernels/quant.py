"""int8 linears (`--quantization int8`): int8 weights and int8 activations (W8A8) for the
attention's q/k/v and o projections and the MLP's gate/up, smoothed first so that the
activations quantize.

Why W8A8 and not int8 weights alone: on a CPU without AMX a decode step of a small model
is already bound by arithmetic at 16 sequences (bf16 GEMMs run near their peak), so halving
the weights' bytes buys little, while VNNI's int8 dot products do twice the work of bf16's
per instruction. torch's int8 GEMM (`_int_mm`) runs them; a token's activations are
quantized per row (max |x| / 127) and weights per output channel.

Why smoothing: a small model's activations have a few channels far larger than the rest,
and per-token int8 flattens everything else to a few levels (SmolLM2's perplexity: +11 %
with every projection quantized). SmoothQuant (Xiao et al. 2022) moves that range into the
weights: each input channel j of a linear is divided by s_j = max|x_j|^a / max|W_j|^(1 - a)
and the weight's column j is multiplied by it, which leaves the product unchanged. The
division is folded into what feeds the linear: the RMSNorm weight before q/k/v and before
gate/up, the value projection's rows before o (shared by the query heads of one KV head, so
their channels take one scale). down_proj is left in the compute dtype (see PROJECTIONS).
max|x_j| comes from a short calibration text run through the model at load
(kernels/quant_calibration.py).

The embedding and the lm_head keep the compute dtype. Quality gate (`loragate bench
quantization`): perplexity within 2 % of bf16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

QUANTIZATIONS = ("int8",)
# The projections quantized. down_proj stays in the compute dtype: its input,
# silu(gate) * up, has the widest range of all; quantized too (smoothed through up's rows),
# SmolLM2's perplexity rises by 2.0-3.5 % (alpha 0.6-0.8) instead of 0.4 %.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj")
# How much of the activations' range moves into the weights (SmoothQuant's alpha): SmolLM2's
# perplexity +0.95 %, +0.48 %, +0.39 % at 0.5, 0.6, 0.7 with the calibration text as it is.
SMOOTHING_ALPHA = 0.7
# The C++ int8 GEMM (kernels/csrc/int8_gemm.cpp, AVX-512 VNNI) computes 16 outputs a vector and
# serves steps of up to this many rows; past it torch's int8 GEMM is faster (at 2,048 rows
# 1.4-1.6x bf16), and below it torch's is no faster than bf16.
VNNI_COLS = 16
VNNI_MAX_ROWS = 64


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row to int8 with its own scale: (int8 [rows, cols], float32 scales [rows]).
    The specification of torch.ops.loragate.quantize_rows."""
    xf = x.float()
    scales = xf.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(xf / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


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


class Int8Linear(nn.Module):
    """A linear over int8 weight rows (per-row scales) and per-token int8 activations."""

    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] float32

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_rows(linear.weight.detach())
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        bias = linear.bias
        self.bias = None if bias is None else bias.detach().float()
        self.native = False  # the C++ halves (kernels.native), set by the model runner
        # The weight packed for the C++ decode-sized GEMM, and its column sums (pack_for_vnni).
        self.packed: torch.Tensor | None = None
        self.col_sums: torch.Tensor | None = None

    def pack_for_vnni(self) -> None:
        """[out / 16, in / 4, 16, 4]: four consecutive inputs of sixteen outputs per 64 bytes,
        as kernels/csrc/int8_gemm.cpp reads them."""
        out_f, in_f = self.qweight.shape
        blocks = self.qweight.view(out_f // VNNI_COLS, VNNI_COLS, in_f // 4, 4)
        self.packed = blocks.permute(0, 2, 1, 3).contiguous()
        self.col_sums = self.qweight.sum(dim=1, dtype=torch.int32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        if self.native:
            xq, row_scales = torch.ops.loragate.quantize_rows(rows)
            if self.packed is not None and rows.shape[0] <= VNNI_MAX_ROWS:
                acc = torch.ops.loragate.int8_mm_packed(xq, self.packed, self.col_sums)
            else:
                acc = torch._int_mm(xq, self.qweight.t())
            torch.ops.loragate.dequantize_mm(acc, row_scales, self.scales, self.bias, out)
        else:
            xq, row_scales = quantize_rows(rows)
            dequantize_mm(
                torch._int_mm(xq, self.qweight.t()), row_scales, self.scales, self.bias, out
            )
        return out.view(*x.shape[:-1], self.out_features)


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
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS
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
            setattr(module, name, Int8Linear(child))
            count += 1
        else:
            count += quantize(child)
    return count


def use_native(module: nn.Module, enabled: bool) -> None:
    vnni = enabled and bool(torch.ops.loragate.int8_mm_available())
    for child in module.modules():
        if isinstance(child, Int8Linear):
            child.native = enabled
            shapes_fit = child.out_features % VNNI_COLS == 0 and child.in_features % 4 == 0
            if vnni and shapes_fit:
                child.pack_for_vnni()
            else:
                child.packed = child.col_sums = None
