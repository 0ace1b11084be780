"""Paged decode attention: one query token per row over its block table, split-K.

    key_cache[num_kv_heads, num_blocks, block_size, head_dim]   (the engine's layout)
    block_tables[rows, max_blocks], seq_lens[rows]: row r attends keys [0, seq_lens[r])

One program per (row, KV head, split) attends every query head of its KV head at
once (GQA at any ratio: the group is padded to a power of two >= 16, the smallest
tensor-core tile, and masked), so each K/V byte is read once per step whatever the
ratio. Keys go BLOCK_N at a time, each key's block looked up in the table, so any
block_size works and blocks need not be contiguous. head_dim is padded to the next
power of two and masked (64, 80, 96, 128, ...).

Flash-decoding: when rows x KV heads cannot fill the GPU, each row's keys are cut
into `num_splits` ranges attended by separate programs, each leaving its normalised
partial output and log-sum-exp; a second kernel merges them. With one split the
first kernel writes the output itself.

Cascade (rows sharing leading blocks): the kernel reads shared blocks through each
row's own table, like any other block. That is never slower than plain decode (it
is plain decode), and the shared blocks' repeated reads come from L2, where the
torch path's gather-once GEMM would buy nothing on a bandwidth-bound GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import PagedMetadata
from kernels.triton._checks import check, check_float, check_index, next_pow2, same_device
from kernels.triton._tile import dot

LOG2E = 1.4426950408889634
# A split under this many keys costs more in the merge than it gains in parallelism.
MIN_SPLIT_TOKENS = 256


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _attend_tile(  # type: ignore[no-untyped-def]  # triton reads annotations
    q_tile,
    key_cache,
    value_cache,
    offs,
    d,
    d_mask,
    n_mask,
    m_i,
    l_i,
    acc,
    qk_scale,
    UPCAST: tl.constexpr,
):
    """One tile of keys (their cache offsets `offs`, the valid ones `n_mask`) folded into
    the group's running softmax: online softmax in base 2 (qk_scale carries log2 e), m_i the
    running max, l_i the running sum, acc the unnormalised output; returns the three updated.
    A @triton.jit function called from a kernel is inlined: no cost on the GPU."""
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(key_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = dot(q_tile, tl.trans(k), UPCAST) * qk_scale
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(value_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + dot(p.to(value_cache.dtype.element_ty), v, UPCAST)
    return m_new, l_i, acc


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _decode_kernel(  # type: ignore[no-untyped-def]  # triton reads annotations
    q,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    out,
    part_out,
    part_lse,
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
    tokens_per_split,
    num_splits,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + row)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * group + g
    g_mask = g < group
    d_mask = d < head_dim
    q_tile = tl.load(
        q + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(key_cache.dtype.element_ty)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    kv_base = kv_head.to(tl.int64) * stride_ch
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block = tl.load(block_tables + row * stride_bt + n // block_size, mask=n_mask, other=0)
        offs = kv_base + block.to(tl.int64) * stride_cb + (n % block_size) * stride_cs
        m_i, l_i, acc = _attend_tile(
            q_tile, key_cache, value_cache, offs, d, d_mask, n_mask, m_i, l_i, acc, qk_scale, UPCAST
        )

    has_keys = l_i > 0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # Partials are [rows, num_heads, num_splits, head_dim] float32, lse [rows, heads, splits].
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        slot = (row * (tl.num_programs(1) * group) + heads) * num_splits + split
        tl.store(part_out + slot[:, None] * HEAD_DIM_PAD + d[None, :], o, mask=o_mask)
        tl.store(part_lse + slot, lse, mask=g_mask)
    else:
        tl.store(
            out + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(out.dtype.element_ty),
            mask=o_mask,
        )


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _merge_kernel(  # type: ignore[no-untyped-def]  # triton reads annotations
    part_out,
    part_lse,
    out,
    stride_ot,
    stride_oh,
    num_heads,
    num_splits,
    head_dim,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    base = (row * num_heads + head) * num_splits
    lse = tl.load(part_lse + base + s, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)
    parts = tl.load(
        part_out + (base + s)[:, None] * HEAD_DIM_PAD + d[None, :],
        mask=(s < num_splits)[:, None] & (d < head_dim)[None, :],  # the padding is never written
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    o = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out + row * stride_ot + head * stride_oh + d, o.to(out.dtype.element_ty), mask=d < head_dim
    )


def _num_splits(rows: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    if device.type != "cuda":
        return max(1, min(4, -(-max_seq_len // 32)))  # the interpreter: exercise the merge
    programs = rows * kv_heads
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-target // programs), -(-max_seq_len // MIN_SPLIT_TOKENS)))


def _check_arguments(
    query: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    out: torch.Tensor,
) -> None:
    """Refuses what the kernel would misread (decode_attention's docstring has the shapes)."""
    check(query.dim() == 3 and out.shape == query.shape, "query/out must be [rows, heads, dim]")
    rows, num_heads, head_dim = query.shape
    key_cache, value_cache = kv_cache
    check(key_cache.dim() == 4 and key_cache.shape == value_cache.shape, "caches differ")
    check(key_cache.stride() == value_cache.stride(), "key and value caches differ in strides")
    kvh, _, block_size, cache_dim = key_cache.shape
    check(cache_dim == head_dim, f"cache head_dim {cache_dim} != query head_dim {head_dim}")
    check(num_heads % kvh == 0, f"{num_heads} query heads do not group over {kvh} KV heads")
    check(key_cache.dtype == value_cache.dtype, "key and value caches differ in dtype")
    for name, t in (("query", query), ("key_cache", key_cache), ("out", out)):
        check_float(name, t)
        check(t.stride(-1) == 1, f"{name} must be contiguous in head_dim")
    check_index("block_tables", block_tables, 2)
    check_index("seq_lens", seq_lens, 1)
    check(block_tables.shape[0] == rows and seq_lens.shape[0] == rows, "one table/length per row")
    check(block_tables.stride(1) == 1, "block_tables must be contiguous in its rows")
    check(max_seq_len <= block_tables.shape[1] * block_size, "max_seq_len exceeds the tables")
    same_device(query, key_cache, value_cache, block_tables, seq_lens, out)


def _split_keys(max_seq_len: int, wanted: int, block_n: int) -> tuple[int, int]:
    """(splits, tokens_per_split): each split's key range rounded up to whole BLOCK_N tiles,
    so fewer splits than `wanted` where the rounding leaves the last ones without keys."""
    tokens_per_split = -(-max(max_seq_len, 1) // wanted)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n
    return max(1, -(-max_seq_len // tokens_per_split)), tokens_per_split


def decode_attention(
    query: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: PagedMetadata,
    scale: float,
    out: torch.Tensor,
    num_splits: int | None = None,
) -> None:
    """out[r] = softmax(query[r] . K[r]^T * scale) . V[r] for every decode row r of the step
    (its first `meta.num_decode` tokens, one query each).

    query/out: [num_tokens, num_heads, head_dim] (any token and head strides); kv_cache: the
    engine's layout; meta's block_tables: [rows, max_blocks] int32/int64, seq_lens: [rows],
    each decode row's <= meta.max_decode_seq_len (a host int: it sizes the splits without
    reading the device). `num_splits`: None picks one for the GPU; tests pass their own."""
    nd = meta.num_decode
    query, out = query[:nd], out[:nd]
    block_tables, seq_lens = meta.block_tables[:nd], meta.seq_lens[:nd]
    max_seq_len = meta.max_decode_seq_len
    _check_arguments(query, kv_cache, block_tables, seq_lens, max_seq_len, out)
    key_cache, value_cache = kv_cache
    rows, num_heads, head_dim = query.shape
    kvh, _, block_size, _ = key_cache.shape
    if rows == 0:
        return
    group = num_heads // kvh
    on_gpu = query.device.type == "cuda"
    block_n = 64 if on_gpu else 16
    wanted = num_splits or _num_splits(rows, kvh, max_seq_len, query.device)
    splits, tokens_per_split = _split_keys(max_seq_len, wanted, block_n)
    dim_pad = next_pow2(head_dim)
    if splits > 1:
        part_out = torch.empty(rows, num_heads, splits, dim_pad, device=query.device)
        part_lse = torch.empty(rows, num_heads, splits, device=query.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(rows, kvh, splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
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
        group,
        tokens_per_split,
        splits,
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM_PAD=dim_pad,
        BLOCK_N=block_n,
        SPLIT=splits > 1,
        UPCAST=not on_gpu,
        **({"num_warps": 4, "num_stages": 2} if on_gpu else {}),
    )
    if splits > 1:
        _merge_kernel[(rows, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            splits,
            head_dim,
            SPLITS_PAD=next_pow2(splits),
            HEAD_DIM_PAD=dim_pad,
        )
