"""Paged attention: write a step's K/V into the block cache, then attend through block tables.

Cache layout, one pair per layer:

    key_cache[num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block

A step's tokens arrive flattened ("super sequence"), decode rows (one query
token each) first, then prefill rows (one or more query tokens: a prompt chunk,
or a recompute after preemption). `build_plan` turns the step's host-side
metadata into the index tensors every layer reuses, so per-layer work is a few
batched ops: one gather of the step's KV blocks and one SDPA call per group.

This torch version is the specification; a triton kernel with the same
signatures must match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionPlan:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks]
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] bool
    prefill_block_tables: torch.Tensor | None  # [num_prefill, max_blocks]
    prefill_gather: torch.Tensor | None  # [num_prefill, max_q] index into prefill tokens
    prefill_mask: torch.Tensor | None  # [num_prefill, 1, max_q, max_kv] bool
    prefill_scatter: torch.Tensor | None  # [num_prefill_tokens] index into [num_prefill * max_q]


def _pad_block_tables(tables: list[list[int]]) -> np.ndarray:
    width = max(len(t) for t in tables)
    out = np.zeros((len(tables), width), dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


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
    decode_bt = decode_mask = None
    prefill_bt = gather = mask = scatter = None
    if num_decode:
        bt = _pad_block_tables(block_tables[:num_decode])
        key_pos = np.arange(bt.shape[1] * block_size)
        decode_mask = torch.from_numpy(key_pos[None, :] < seq_lens[:num_decode, None])
        decode_mask = decode_mask.view(num_decode, 1, 1, -1).to(device)
        decode_bt = torch.from_numpy(bt).to(device)
    num_prefill = len(query_lens) - num_decode
    if num_prefill:
        q_lens = query_lens[num_decode:]
        s_lens = seq_lens[num_decode:]
        bt = _pad_block_tables(block_tables[num_decode:])
        max_q = int(q_lens.max())
        max_kv = int(s_lens.max())
        q_starts = np.concatenate(([0], np.cumsum(q_lens)[:-1]))
        rows = np.arange(max_q)
        in_range = rows[None, :] < q_lens[:, None]  # [P, max_q]
        # Padding rows read token 0 and attend to key 0: finite, then dropped.
        gather_np = np.where(in_range, q_starts[:, None] + rows[None, :], 0)
        ctx_lens = s_lens - q_lens
        key_pos = np.arange(max_kv)
        causal = key_pos[None, None, :] <= (ctx_lens[:, None, None] + rows[None, :, None])
        mask_np = np.where(in_range[:, :, None], causal, key_pos[None, None, :] == 0)
        scatter_np = (np.arange(num_prefill)[:, None] * max_q + rows[None, :])[in_range]
        prefill_bt = torch.from_numpy(bt).to(device)
        gather = torch.from_numpy(gather_np).to(device)
        mask = torch.from_numpy(mask_np).unsqueeze(1).to(device)
        scatter = torch.from_numpy(scatter_np).to(device)
    return AttentionPlan(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        num_decode=num_decode,
        decode_block_tables=decode_bt,
        decode_mask=decode_mask,
        prefill_block_tables=prefill_bt,
        prefill_gather=gather,
        prefill_mask=mask,
        prefill_scatter=scatter,
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V ([num_tokens, num_kv_heads, head_dim]) at its slot."""
    num_kv_heads, head_dim = key.shape[1:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[rows, num_kv_heads, max_len, head_dim] of each row's context."""
    rows = block_tables.shape[0]
    gathered = cache[block_tables]  # [rows, max_blocks, block_size, kvh, d]
    gathered = gathered.view(rows, -1, *cache.shape[2:])[:, :max_len]
    return gathered.transpose(1, 2)


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
    nd = plan.num_decode
    if nd:
        assert plan.decode_block_tables is not None and plan.decode_mask is not None
        max_len = plan.decode_mask.shape[-1]
        k = _gather_kv(key_cache, plan.decode_block_tables, max_len)
        v = _gather_kv(value_cache, plan.decode_block_tables, max_len)
        q = query[:nd].unsqueeze(2)  # [nd, h, 1, d]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True
        )
        out[:nd] = o.squeeze(2)
    if nd < query.shape[0]:
        assert plan.prefill_block_tables is not None and plan.prefill_mask is not None
        assert plan.prefill_gather is not None and plan.prefill_scatter is not None
        max_kv = plan.prefill_mask.shape[-1]
        k = _gather_kv(key_cache, plan.prefill_block_tables, max_kv)
        v = _gather_kv(value_cache, plan.prefill_block_tables, max_kv)
        q = query[nd:][plan.prefill_gather].transpose(1, 2)  # [p, h, max_q, d]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=plan.prefill_mask, scale=scale, enable_gqa=True
        )
        o = o.transpose(1, 2).reshape(-1, *query.shape[1:])
        out[nd:] = o[plan.prefill_scatter]
    return out
