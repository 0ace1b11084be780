"""Paged attention: write a step's K/V into the block cache, then attend through block tables.

Cache layout, one pair per layer, KV heads outermost so that gathering a
sequence's blocks yields a contiguous [kv_heads, tokens, head_dim] run per
head, ready for a batched matmul with no further copy:

    key_cache[num_kv_heads, num_blocks, block_size, head_dim]
    slot = block_id * block_size + offset_in_block

A step's tokens arrive flattened ("super sequence"), decode rows (one query
token each) first, then prefill rows (a prompt chunk, or a recompute after
preemption). `build_plan` turns the step's host-side metadata into the index
tensors every layer reuses.

Decode rows are attended together in one batched matmul per phase. When they
share leading blocks (a common system prompt, n > 1 samples, a few-shot
prefix) the shared blocks are gathered once and attended by every query in a
single GEMM ("cascade" attention); each row's own tail is attended
separately and the two parts are merged in one softmax. Prefill rows are
attended one row at a time with SDPA: there are few of them and padding them
together would waste more than the loop costs.

This torch version is the specification; a triton kernel with the same
signatures must match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillRow:
    query_start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)]
    mask: torch.Tensor | None  # [query_len, seq_len] bool; None: plain causal (no cached context)


@dataclass(slots=True)
class AttentionPlan:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode: int
    shared_block_ids: torch.Tensor | None  # [num_shared] blocks every decode row starts with
    decode_block_tables: torch.Tensor | None  # [num_decode, max_tail_blocks] after the shared ones
    decode_mask: torch.Tensor | None  # [1, num_decode, 1, max_tail_blocks * block_size] bool
    prefill_rows: list[PrefillRow]


def build_plan(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: list[list[int]],
    slot_mapping: np.ndarray,
    num_decode: int,
    block_size: int,
    device: torch.device,
) -> AttentionPlan:
    """Rows [0, num_decode) must have query_len == 1; the rest are prefills."""
    shared = decode_bt = decode_mask = None
    if num_decode:
        lens = seq_lens[:num_decode]
        width = max(len(t) for t in block_tables[:num_decode])
        bt = np.zeros((num_decode, width), dtype=np.int64)
        for i, table in enumerate(block_tables[:num_decode]):
            bt[i, : len(table)] = table
        num_shared = 0
        if num_decode > 1:
            same = (bt == bt[0]).all(axis=0)
            num_shared = int(same.argmin()) if not same.all() else width
            # Every row keeps at least its own last token in the tail.
            num_shared = min(num_shared, int((lens.min() - 1) // block_size))
        if num_shared:
            shared = torch.from_numpy(bt[0, :num_shared].copy()).to(device)
        tail_blocks = int(-(-lens.max() // block_size)) - num_shared
        decode_bt = torch.from_numpy(bt[:, num_shared : num_shared + tail_blocks].copy()).to(device)
        key_pos = np.arange(tail_blocks * block_size) + num_shared * block_size
        mask = key_pos[None, :] < lens[:, None]
        decode_mask = torch.from_numpy(mask).view(1, num_decode, 1, -1).to(device)
    prefill_rows = []
    query_start = int(query_lens[:num_decode].sum())
    for i in range(num_decode, len(query_lens)):
        q_len, s_len = int(query_lens[i]), int(seq_lens[i])
        num_blocks = -(-s_len // block_size)
        ids = torch.tensor(block_tables[i][:num_blocks], dtype=torch.long, device=device)
        mask = None
        if s_len > q_len:
            ctx = s_len - q_len
            rows = torch.arange(q_len, device=device)[:, None]
            mask = torch.arange(s_len, device=device)[None, :] <= rows + ctx
        prefill_rows.append(PrefillRow(query_start, q_len, s_len, ids, mask))
        query_start += q_len
    return AttentionPlan(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        num_decode=num_decode,
        shared_block_ids=shared,
        decode_block_tables=decode_bt,
        decode_mask=decode_mask,
        prefill_rows=prefill_rows,
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V ([num_tokens, num_kv_heads, head_dim]) at its slot."""
    kvh, _, _, head_dim = key_cache.shape
    key_cache.view(kvh, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    value_cache.view(kvh, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[kv_heads, *block_ids.shape[:-1], num_blocks * block_size, head_dim], contiguous."""
    g = cache[:, block_ids]
    return g.view(*g.shape[:-3], g.shape[-3] * g.shape[-2], g.shape[-1])


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each query token over its sequence's cached K/V.

    query: [num_tokens, num_heads, head_dim]; returns the same shape. The
    step's own K/V must already be in the cache (`write_kv`).
    """
    out = torch.empty_like(query)
    if plan.num_decode:
        out[: plan.num_decode] = _decode_attention(
            query[: plan.num_decode], key_cache, value_cache, plan, scale
        )
    for row in plan.prefill_rows:
        q = query[row.query_start : row.query_start + row.query_len].transpose(0, 1).unsqueeze(0)
        k = _gather(key_cache, row.block_ids)[:, : row.seq_len].unsqueeze(0)
        v = _gather(value_cache, row.block_ids)[:, : row.seq_len].unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=row.mask, is_causal=row.mask is None, scale=scale, enable_gqa=True
        )
        out[row.query_start : row.query_start + row.query_len] = o[0].transpose(0, 1)
    return out


def _decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """One query per row; the softmax spans the shared blocks and each row's tail."""
    assert plan.decode_block_tables is not None and plan.decode_mask is not None
    num_rows, num_heads, head_dim = query.shape
    kvh = key_cache.shape[0]
    group = num_heads // kvh
    # Heads h*group .. (h+1)*group-1 read KV head h, as in HF's repeat_kv.
    q = (query * scale).view(num_rows, kvh, group, head_dim).transpose(0, 1)  # [kvh, D, G, d]

    k_tail = _gather(key_cache, plan.decode_block_tables)  # [kvh, D, L, d]
    v_tail = _gather(value_cache, plan.decode_block_tables)
    s_tail = torch.matmul(q, k_tail.transpose(-1, -2))  # [kvh, D, G, L]
    s_tail = s_tail.masked_fill_(~plan.decode_mask, float("-inf"))
    m = s_tail.amax(dim=-1, keepdim=True)

    if plan.shared_block_ids is None:
        p_tail = torch.exp_(s_tail - m)
        o = torch.matmul(p_tail, v_tail) / p_tail.sum(dim=-1, keepdim=True)
    else:
        k_shared = _gather(key_cache, plan.shared_block_ids)  # [kvh, S, d]
        v_shared = _gather(value_cache, plan.shared_block_ids)
        s_shared = torch.matmul(
            q.reshape(kvh, num_rows * group, head_dim), k_shared.transpose(-1, -2)
        )
        s_shared = s_shared.view(kvh, num_rows, group, -1)
        m = torch.maximum(m, s_shared.amax(dim=-1, keepdim=True))
        p_tail = torch.exp_(s_tail - m)
        p_shared = torch.exp_(s_shared - m)
        denom = p_tail.sum(dim=-1, keepdim=True) + p_shared.sum(dim=-1, keepdim=True)
        o_shared = torch.matmul(p_shared.view(kvh, num_rows * group, -1), v_shared)
        o = (torch.matmul(p_tail, v_tail) + o_shared.view(kvh, num_rows, group, head_dim)) / denom
    return o.transpose(0, 1).reshape(num_rows, num_heads, head_dim)
