"""Paged prefill/extend attention: variable-length query chunks of many rows, one launch.

Row r's queries are tokens [query_start_loc[r], query_start_loc[r + 1]) of the step and
sit at the end of its sequence: query i has position ctx + i, ctx = seq_lens[r] - q_len
(0 for a fresh prompt; the cached context for a later chunk, a prefix-cache hit or a
recompute after preemption). It attends keys [0, ctx + i], every one read from the
paged cache through the row's block table, so the step's own K/V must be written first
(`kv_write`), as the torch specification requires too.

One program per (query tile of BLOCK_M tokens, row, query head); a grid sized by the
longest chunk leaves programs past a shorter row's end to return at once. Keys go
BLOCK_N at a time, stopping at the tile's causal frontier, with an online softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import PagedMetadata
from kernels.triton._checks import check, check_float, check_index, next_pow2, same_device
from kernels.triton._tile import dot

LOG2E = 1.4426950408889634


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _prefill_kernel(  # type: ignore[no-untyped-def]  # triton reads annotations
    q,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    out,
    stride_qt,
    stride_qh,
    stride_ch,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    qk_scale,
    block_size,
    head_dim,
    group,
    first_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    row = (first_row + tl.program_id(1)).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc + row)
    q_len = tl.load(query_start_loc + row + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens + row)
    ctx = seq_len - q_len
    kv_head = head // group

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    m_mask = m < q_len
    d_mask = d < head_dim
    tokens = (q_start + m).to(tl.int64)
    q_tile = tl.load(
        q + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(key_cache.dtype.element_ty)
    q_pos = ctx + m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    kv_base = kv_head.to(tl.int64) * stride_ch
    hi = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block = tl.load(block_tables + row * stride_bt + n // block_size, mask=n_mask, other=0)
        offs = kv_base + block.to(tl.int64) * stride_cb + (n % block_size) * stride_cs
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = dot(q_tile, tl.trans(k), UPCAST) * qk_scale
        allowed = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A query with no allowed key yet keeps m = -inf: subtract 0 instead (p is 0 anyway).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(value_cache.dtype.element_ty), v, UPCAST)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
        o.to(out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def prefill_attention(
    query: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: PagedMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal attention of the step's prefill rows, [meta.num_decode, meta.num_rows).

    query/out: [num_tokens, num_heads, head_dim] (any token and head strides); meta's
    block_tables [rows, max_blocks], seq_lens [rows], query_start_loc [rows + 1]: every
    attention row of the step, indexed from 0; its `max_prefill_query_len`: the longest chunk
    among the rows attended (a host int: it sizes the grid). A row with no queries writes
    nothing."""
    key_cache, value_cache = kv_cache
    block_tables, seq_lens, query_start_loc = meta.block_tables, meta.seq_lens, meta.query_start_loc
    first_row, num_rows = meta.num_decode, meta.num_rows - meta.num_decode
    max_query_len = meta.max_prefill_query_len
    check(query.dim() == 3 and out.shape == query.shape, "query/out must be [tokens, heads, dim]")
    _, num_heads, head_dim = query.shape
    check(key_cache.dim() == 4 and key_cache.shape == value_cache.shape, "caches differ")
    check(key_cache.stride() == value_cache.stride(), "key and value caches differ in strides")
    check(key_cache.dtype == value_cache.dtype, "key and value caches differ in dtype")
    kvh, _, block_size, cache_dim = key_cache.shape
    check(cache_dim == head_dim, f"cache head_dim {cache_dim} != query head_dim {head_dim}")
    check(num_heads % kvh == 0, f"{num_heads} query heads do not group over {kvh} KV heads")
    for name, t in (("query", query), ("key_cache", key_cache), ("out", out)):
        check_float(name, t)
        check(t.stride(-1) == 1, f"{name} must be contiguous in head_dim")
    check_index("block_tables", block_tables, 2)
    check_index("seq_lens", seq_lens, 1)
    check_index("query_start_loc", query_start_loc, 1)
    total_rows = seq_lens.shape[0]
    check(block_tables.shape[0] == total_rows, "one block table per row")
    check(query_start_loc.shape[0] == total_rows + 1, "query_start_loc must be [rows + 1]")
    check(first_row >= 0 and first_row + num_rows <= total_rows, "rows out of range")
    check(block_tables.stride(1) == 1, "block_tables must be contiguous in its rows")
    same_device(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out)
    if num_rows == 0 or max_query_len == 0:
        return
    on_gpu = query.device.type == "cuda"
    block_m = 64 if on_gpu else 16
    block_n = 64 if on_gpu else 16
    grid = (-(-max_query_len // block_m), num_rows, num_heads)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        block_size,
        head_dim,
        num_heads // kvh,
        first_row,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM_PAD=next_pow2(head_dim),
        UPCAST=not on_gpu,
        **({"num_warps": 4, "num_stages": 2} if on_gpu else {}),
    )
