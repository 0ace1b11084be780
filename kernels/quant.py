"""int8 linears (`--quantization int8`): int8 weights and int8 activations (W8A8) for every
linear of a decoder layer (q/k/v, o, gate/up, down), both quantized in groups of GROUP inputs,
the inputs of the first three smoothed.

Why W8A8 and not int8 weights alone: on a CPU without AMX a decode step of a small model
is already bound by arithmetic at 16 sequences (bf16 GEMMs run near their peak), so halving
the weights' bytes buys little, while VNNI's int8 dot products do twice the work of bf16's
per instruction. Our C++ linear (kernels/csrc/int8_gemm.cpp: quantize, GEMM over a weight
packed at load, scale back, one op) runs them; elsewhere torch's int8 GEMM (`_int_mm`; float32 GEMMs
without VNNI, see `int_mm`).

Why groups: one scale per token (activations) and per output channel (weights) flattens the
small values of a row that has a few large ones to a few levels. A scale per group of 64
inputs, for the weight rows and the token alike (as llama.cpp's Q8_0 blocks of 32 do), confines
an outlier to its group: SmolLM2's KL divergence from float32 halves (see GROUP) for about 10 %
of int8's W1 throughput.

Why smoothing: a small model's activations have a few channels far larger than the rest
(SmolLM2's perplexity: +11 % with every projection quantized per token, unsmoothed).
SmoothQuant (Xiao et al. 2022) moves that range into the weights: each input channel j of a
linear is divided by s_j = max|x_j|^a / max|W_j|^(1 - a) and the weight's column j is
multiplied by it, which leaves the product unchanged. The division is folded into what feeds
the linear: the RMSNorm weight before q/k/v and before gate/up, the value projection's rows
before o (shared by the query heads of one KV head, so their channels take one scale).
down_proj's input, silu(gate) * up, has outliers that move from token to token, which no
per-channel scale follows: groups alone take those. max|x_j| comes from a short calibration
text run through the model at load (kernels/quant_calibration.py).

The embedding and the lm_head keep the compute dtype. Quality gate (tests/kernels/test_quant.py,
`loragate-bench quantization`): perplexity within 2 % of float32's, the one reference every
processor computes alike; bf16's own rounding moves with the processor's GEMMs (AMX, AVX-512
BF16), and int8 on top of it by as much again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_features

QUANTIZATIONS = ("int8",)
# The projections quantized: every linear of a decoder layer.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Those whose input is smoothed.
SMOOTHED = ("qkv_proj", "o_proj", "gate_up_proj")
# How much of the activations' range moves into the weights (SmoothQuant's alpha), chosen when
# activations were quantized per token: SmolLM2's perplexity +0.95 %, +0.48 %, +0.39 % over
# bf16 at 0.5, 0.6, 0.7 on the first 1,212 tokens of the perplexity text.
SMOOTHING_ALPHA = 0.7
# Weights and activations are quantized in groups of this many inputs, each with its own
# scale (per output row and group of the weight, per token and group of the activations).
# SmolLM2 over bench/data/perplexity.txt (4,851 tokens), mean KL divergence from float32 and
# perplexity against float32's, int8 computing in float32 / in bf16: per-channel weights and
# per-token activations (down_proj's in groups of 128) 0.0102 / 0.0125, +1.15 % / +1.48 %;
# groups of 64 everywhere 0.0043 / 0.0058, +0.52 % / +0.80 %. On the text's first 1,212
# tokens alone the perplexity of one scheme moved by 1.5 % with the calibration's or the
# compute dtype's rounding, which is why the text is longer now. A multiple of 16 (the C++
# linear's vector).
GROUP = 64
# The C++ linear (kernels/csrc/int8_gemm.cpp, AVX-512 VNNI) computes 16 outputs a vector and
# quantizes 16 inputs a vector.
VNNI_COLS = 16


# int8 products of one float32 dot product stay exact up to this many inputs (127^2 times it
# below 2^24).
_EXACT_FLOAT_INPUTS = 1024


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [m, k] int8 @ b [k, n] int8 in int32, exactly. torch's `_int_mm` runs oneDNN, which
    without VNNI (AVX2 alone) adds its products' pairs in saturating int16 and, for one row,
    loses what passes 32,767 (seen: 34,750 for 48,616); there the product is float32 GEMMs
    over chunks short enough to be exact, summed in int32."""
    if cpu_features.int8_dot_products():
        return torch._int_mm(a, b)
    total = torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32)
    for start in range(0, a.shape[1], _EXACT_FLOAT_INPUTS):
        end = start + _EXACT_FLOAT_INPUTS
        total += (a[:, start:end].float() @ b[start:end].float()).to(torch.int32)
    return total


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
    int32 sums per group scaled by the group's activation scale times the weight's scale of
    that group and output (weight_scales [in / group, out]), added up in float32 (and the
    bias), in x's dtype."""
    xq, scales = quantize_groups(x, group)
    y = None
    for g, start in enumerate(range(0, x.shape[1], group)):
        acc = int_mm(xq[:, start : start + group], qweight[:, start : start + group].t())
        part = acc.float() * (scales[:, g : g + 1] * weight_scales[g])
        y = part if y is None else y + part
    assert y is not None
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


class Int8Linear(nn.Module):
    """A linear over int8 weights and int8 activations quantized as each step runs, both in
    groups of `group` inputs (a scale per output and group, a scale per token and group);
    group = in_features is per-channel and per-token quantization."""

    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [in / group, out] float32

    def __init__(self, linear: nn.Linear, group: int | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group = group or self.in_features
        if self.in_features % self.group:
            raise ValueError(f"group {self.group} does not divide {self.in_features} inputs")
        q, scales = quantize_groups(linear.weight.detach(), self.group)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales.t().contiguous())
        bias = linear.bias
        self.bias = None if bias is None else bias.detach().float()
        self.native = False  # the C++ halves (kernels.native): quantize_native, use_native
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
            acc = int_mm(xq, self.qweight.t())
            torch.ops.loragate.dequantize_mm(acc, row_scales, self.scales[0], self.bias, out)
        else:
            out = int8_linear_reference(rows, self.qweight, self.scales, self.bias, self.group)
        return out.view(*x.shape[:-1], self.out_features)

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) from the fused gate/up output [..., 2 * in_features]: in the
        C++ linear the product is computed as its rows are quantized (one pass over gate/up
        instead of three); elsewhere torch's two ops first."""
        if self.packed is None:
            gate, up = torch.split(gate_up, self.in_features, dim=-1)
            out: torch.Tensor = self(F.silu(gate) * up)
            return out
        rows = gate_up.reshape(-1, 2 * self.in_features).contiguous()
        return self._packed_linear(rows, gated=True).view(*gate_up.shape[:-1], self.out_features)

    def _packed_linear(self, rows: torch.Tensor, gated: bool) -> torch.Tensor:
        out: torch.Tensor = torch.ops.loragate.int8_linear(
            rows, self.packed, self.col_sums, self.scales, self.bias, self.group, gated
        )
        return out


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
    """Replace every projection under `module` by its Int8Linear, on torch's int8 GEMM;
    returns how many."""
    count = _replace_projections(module)
    use_native(module, False)
    return count


def quantize_native(module: nn.Module) -> int:
    """`quantize`, the linears on the C++ kernels (packed for them where the CPU has VNNI)."""
    count = _replace_projections(module)
    use_native(module, True)
    return count


def _replace_projections(module: nn.Module) -> int:
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and name in PROJECTIONS:
            setattr(module, name, Int8Linear(child, _group(child.in_features)))
            count += 1
        else:
            count += _replace_projections(child)
    return count


def _group(in_features: int) -> int:
    """GROUP where it divides the width; the whole row elsewhere."""
    return GROUP if in_features % GROUP == 0 else in_features


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
