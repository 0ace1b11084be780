"""RMSNorm, alone or with the residual add fused in front (`engine.models.llama.RMSNorm`).

Rounding follows the torch specification (and HF's LlamaRMSNorm) step by step, so that
bfloat16/float16 outputs differ from it only by the order of the sum of squares:

    residual = round(residual + delta)          # the add, in the model dtype
    normed   = round(x32 * rsqrt(mean(x32^2) + eps))   # statistics in float32
    out      = round(weight * normed)           # the weight product, in the model dtype

(In float32 every round is the identity.) One program per row: a row of hidden <= 16384
fits in one tile, so the row is read once and written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._checks import check, check_float, check_last_contiguous, next_pow2


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _rms_norm_kernel(  # type: ignore[no-untyped-def]  # triton reads annotations
    x,
    delta,
    weight,
    out,
    stride_x,
    stride_d,
    stride_o,
    hidden,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    v = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta + row * stride_d + cols, mask=mask, other=0.0)
        v = (v.to(tl.float32) + d.to(tl.float32)).to(x.dtype.element_ty)
        tl.store(x + row * stride_x + cols, v, mask=mask)
    v32 = v.to(tl.float32)
    inv = tl.rsqrt(tl.sum(v32 * v32, axis=0) / hidden + eps)
    normed = (v32 * inv).to(out.dtype.element_ty).to(tl.float32)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + cols, (w * normed).to(out.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    check(x.dim() == 2, f"x must be [rows, hidden], got {tuple(x.shape)}")
    hidden = x.shape[1]
    check(weight.shape == (hidden,), f"weight must be [{hidden}], got {tuple(weight.shape)}")
    check(weight.dtype == x.dtype, f"weight is {weight.dtype}, x {x.dtype}")
    check_float("x", x)
    check_last_contiguous("x", x)
    check(weight.is_contiguous(), "weight must be contiguous")
    if delta is not None:
        check(delta.shape == x.shape and delta.dtype == x.dtype, "delta must match x")
        check_last_contiguous("delta", delta)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0] == 0:
        return out
    _rms_norm_kernel[(x.shape[0],)](
        x,
        x if delta is None else delta,
        weight,
        out,
        x.stride(0),
        0 if delta is None else delta.stride(0),
        out.stride(0),
        hidden,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK=next_pow2(hidden),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm of each row of x ([rows, hidden])."""
    return _launch(x, None, weight, eps)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += delta (in place), then the norm of the sum."""
    return _launch(residual, delta, weight, eps)
