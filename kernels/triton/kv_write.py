"""KV cache write: scatter a step's K/V rows into their cache slots (`kernels.attention.write_kv`).

    key_cache[num_kv_heads, num_blocks, block_size, head_dim]
    slot = block_id * block_size + offset_in_block; slot < 0: a padding token, not written

One program per (token, KV head) copies one head_dim vector for K and one for V: the op
is pure bandwidth, and a vector per program keeps every store a coalesced row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._checks import (
    check,
    check_float,
    check_index,
    check_last_contiguous,
    next_pow2,
    same_device,
)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _kv_write_kernel(  # type: ignore[no-untyped-def]  # triton reads annotations
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cb,
    stride_cs,
    block_size,
    head_dim,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = d < head_dim
    dst = head * stride_ch + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + d
    k = tl.load(key + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(value + token * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(key_cache + dst, k.to(key_cache.dtype.element_ty), mask=mask)
    tl.store(value_cache + dst, v.to(value_cache.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V ([num_tokens, num_kv_heads, head_dim], any row strides) at its
    slot, cast to the cache's dtype."""
    check(key.dim() == 3 and key.shape == value.shape, "key/value must be one [t, kvh, d] shape")
    check(key_cache.dim() == 4 and key_cache.shape == value_cache.shape, "caches differ")
    check(key_cache.stride() == value_cache.stride(), "key and value caches differ in strides")
    num_tokens, kvh, head_dim = key.shape
    check(
        key_cache.shape[0] == kvh and key_cache.shape[3] == head_dim,
        f"cache {tuple(key_cache.shape)} does not hold [{kvh}, *, *, {head_dim}] heads",
    )
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache)):
        check_float(name, t)
        check_last_contiguous(name, t)
    check_index("slot_mapping", slot_mapping, 1)
    check(slot_mapping.shape[0] == num_tokens, "slot_mapping must have one slot per token")
    same_device(key, value, key_cache, value_cache, slot_mapping)
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens, kvh)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.shape[2],
        head_dim,
        HEAD_DIM_PAD=next_pow2(head_dim),
    )
