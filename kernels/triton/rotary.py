"""Rotary embedding in place over q and k heads (`engine.models.llama.apply_rope`).

The kernel takes the model's precomputed float32 tables, cos[max_len, head_dim] and
signed_sin (sin with its first half negated), so every rope scaling the model supports
(default, linear, llama3, yarn: all of them only change the tables) costs the kernel
nothing. Per token and head, with h = head_dim / 2:

    out[i] = x[i] * cos[i] + x[i + h] * signed_sin[i]       i < h
    out[i] = x[i] * cos[i] + x[i - h] * signed_sin[i]       i >= h

rounded as the torch version rounds in the model dtype: tables cast to it, each product
rounded, then their sum. One program per token rotates all its heads: the cos/sin row is
read once per token, and each head's two halves are read and written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._checks import check, check_float, check_index, next_pow2, same_device


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _rotary_kernel(  # type: ignore[no-untyped-def]  # triton reads annotations
    x,
    positions,
    cos,
    signed_sin,
    stride_xt,
    stride_xh,
    stride_table,
    num_heads,
    half,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    h = tl.arange(0, HEADS_PAD)
    col_mask = i < half
    dt = x.dtype.element_ty
    c1 = tl.load(cos + pos * stride_table + i, mask=col_mask).to(dt).to(tl.float32)
    c2 = tl.load(cos + pos * stride_table + half + i, mask=col_mask).to(dt).to(tl.float32)
    s1 = tl.load(signed_sin + pos * stride_table + i, mask=col_mask).to(dt).to(tl.float32)
    s2 = tl.load(signed_sin + pos * stride_table + half + i, mask=col_mask).to(dt).to(tl.float32)
    mask = (h[:, None] < num_heads) & col_mask[None, :]
    base = x + token * stride_xt + h[:, None] * stride_xh + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * c1[None, :]).to(dt).to(tl.float32) + (x2 * s1[None, :]).to(dt).to(tl.float32)
    o2 = (x2 * c2[None, :]).to(dt).to(tl.float32) + (x1 * s2[None, :]).to(dt).to(tl.float32)
    tl.store(base, o1.to(dt), mask=mask)
    tl.store(base + half, o2.to(dt), mask=mask)


def rotary_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """Rotate x ([num_tokens, num_heads, head_dim], any token/head strides, e.g. the q and
    k heads of the fused qkv output) in place by each token's position; returns x."""
    check(x.dim() == 3, f"x must be [tokens, heads, head_dim], got {tuple(x.shape)}")
    num_tokens, num_heads, head_dim = x.shape
    check(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    check_float("x", x)
    check(head_dim <= 1 or x.stride(2) == 1, "x must be contiguous in head_dim")
    check(
        cos.dim() == 2 and cos.shape == signed_sin.shape and cos.shape[1] == head_dim,
        f"cos/sin tables must be one [max_len, {head_dim}] shape",
    )
    check(cos.dtype == signed_sin.dtype == torch.float32, "cos/sin tables must be float32")
    check(cos.is_contiguous() and signed_sin.is_contiguous(), "cos/sin tables must be contiguous")
    check_index("positions", positions, 1)
    check(positions.shape[0] == num_tokens, "positions must have one entry per token")
    same_device(x, positions, cos, signed_sin)
    if num_tokens == 0:
        return x
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        x,
        positions,
        cos,
        signed_sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        num_heads,
        half,
        HEADS_PAD=next_pow2(num_heads),
        HALF_PAD=next_pow2(half),
    )
    return x
