"""Paged attention: write a step's K/V into the block cache, then attend through block tables.

Cache layout, one pair per layer, KV heads outermost so that gathering a
sequence's blocks yields a contiguous [kv_heads, tokens, head_dim] run per
head, ready for a batched matmul with no further copy:

    key_cache[num_kv_heads, num_blocks, block_size, head_dim]
    slot = block_id * block_size + offset_in_block

A step's tokens arrive flattened ("super sequence"), decode rows (one query
token each) first, then prefill rows (a prompt chunk, or a recompute after
preemption). A plan builder turns the step's host-side metadata (`StepMetadata`) into the
index tensors every layer reuses: one builder per kind of kernels, which each backend
(kernels/backend.py) chooses once, at its construction.

Decode rows are attended in a few groups of similar length (padding a row to
the group's longest costs a copy of K/V it does not need), one batched matmul
per group and phase. When a group's rows share leading blocks (a common system
prompt, n > 1 samples, a few-shot prefix) the shared blocks are gathered once
and attended by every query in a single GEMM ("cascade" attention); each
row's own tail is attended separately and the two parts are merged in one
softmax. Prefill rows with no cached context (a fresh prompt, or its first
chunk) read their keys and values from the step itself, and consecutive ones
of one length share one batched causal SDPA (a burst of same-length prompts is
one call per layer). Rows with cached context are attended one at a time with
SDPA over their gathered blocks: padding them together would waste more than
the loop costs.

This torch version (`build_plan`, `paged_attention`) is the specification; the C++ and
triton kernels must match it. The C++ kernels read a plan whose decode rows are one group
(`build_native_decode_plan`) and, where they attend prompts too, whose prefill rows are
theirs (`build_native_plan`). The triton kernels take a plan of their own
(`build_triton_plan`): no groups, no masks, only `PagedMetadata`, the step's block tables
and lengths for every row, which the kernels read in place. A plan is built for one path;
the CPU paths never build the triton one's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """A step's attention rows as the model runner laid them out, on the host: rows
    [0, num_decode) decode (query_len 1 each, sorted by seq_len where the kernels group rows
    of similar length), the rest prefills."""

    query_lens: np.ndarray  # [rows]
    seq_lens: np.ndarray  # [rows]: keys each row attends, its queries included
    block_tables: list[list[int]]  # each row's blocks
    slot_mapping: np.ndarray  # [num_tokens]: where each token's K/V is written
    num_decode: int
    block_size: int


@dataclass(slots=True)
class PrefillRow:
    query_start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)]
    mask: torch.Tensor  # [query_len, seq_len] bool: causal, shifted by the cached context


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows [row_start, row_end) of the step, attended together."""

    row_start: int
    row_end: int
    shared_block_ids: torch.Tensor | None  # [num_shared] blocks every row of the group starts with
    block_tables: torch.Tensor  # [rows, max_tail_blocks]: each row's blocks after the shared ones
    # The torch path's [1, rows, 1, max_tail_blocks * block_size] bool (key within the row);
    # the C++ kernel's [rows] int64 lengths, shared blocks included. Each only for its path.
    mask: torch.Tensor | None
    seq_lens: torch.Tensor | None


@dataclass(slots=True)
class FreshPrefills:
    """Consecutive prefill rows with no cached context and one query length: their keys and
    values are the step's own, so they are attended together, straight from the step's
    K/V (nothing gathered from the cache), in one batched causal SDPA."""

    query_start: int
    num_rows: int
    query_len: int

    @property
    def end(self) -> int:
        return self.query_start + self.num_rows * self.query_len


@dataclass(slots=True)
class PagedMetadata:
    """Every attention row of the step for the triton kernels: decode rows (one query
    token each) first, then prefill rows, as in the step's tokens."""

    block_tables: torch.Tensor  # [rows, max_blocks] int32, zero-padded
    seq_lens: torch.Tensor  # [rows] int32: keys each row attends, its queries included
    query_start_loc: torch.Tensor  # [rows + 1] int32: row r's queries are tokens [r], [r + 1])
    num_decode: int
    num_rows: int
    max_decode_seq_len: int  # host ints: they size the kernels' grids
    max_prefill_query_len: int


@dataclass(slots=True)
class NativePrefills:
    """Every prefill row of the step, for the C++ kernel (kernels/csrc/prefill_attention.cpp),
    which reads each row's keys and values in place through its block table."""

    block_tables: torch.Tensor  # [rows, max_blocks] int64
    meta: torch.Tensor  # [rows, 3] int64: query_start, query_len, seq_len


# The C++ prefill kernel scores keys sixteen at a time: blocks must hold a multiple of that.
NATIVE_PREFILL_BLOCK_MULTIPLE = 16


@dataclass(slots=True)
class AttentionPlan:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode: int
    decode_groups: list[DecodeGroup]
    prefill_rows: list[PrefillRow]  # rows attending to cached context, one at a time
    fresh_prefills: list[FreshPrefills]
    # Decode groups go to the C++ kernel (kernels.native), which reads blocks in place.
    native: bool = False
    # Set (and nothing else but slot_mapping) for the triton kernels.
    paged: PagedMetadata | None = None
    # Set instead of prefill_rows and fresh_prefills when the C++ prefill kernel runs them.
    native_prefills: NativePrefills | None = None


# A decode group's fixed cost, in padded key slots: splitting rows into
# groups of similar length pays off only when it saves more padding than this.
_GROUP_COST_SLOTS = 2048


def build_plan(step: StepMetadata, device: torch.device) -> AttentionPlan:
    """The torch specification's plan: decode rows in groups of similar length, each with
    the blocks its rows share and a mask over the tails; prefill rows attended by SDPA."""
    groups = []
    if step.num_decode:
        bt, lens = _decode_tables(step)
        for start, end in _split_by_length(lens):
            groups.append(
                _masked_group(bt[start:end], lens[start:end], start, step.block_size, device)
            )
    prefill_rows, fresh = _torch_prefills(step, device)
    return AttentionPlan(
        slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
        num_decode=step.num_decode,
        decode_groups=groups,
        prefill_rows=prefill_rows,
        fresh_prefills=fresh,
    )


def build_native_decode_plan(step: StepMetadata, device: torch.device) -> AttentionPlan:
    """The decode rows for the C++ kernel, which pads nothing, so they are one group (one
    pass over a shared prefix); the prefill rows as `build_plan` makes them."""
    prefill_rows, fresh = _torch_prefills(step, device)
    return AttentionPlan(
        slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
        num_decode=step.num_decode,
        decode_groups=_native_groups(step, device),
        prefill_rows=prefill_rows,
        fresh_prefills=fresh,
        native=True,
    )


def build_native_plan(step: StepMetadata, device: torch.device) -> AttentionPlan:
    """Every row for the C++ kernels, the prefill rows too (bf16 caches with bf16 dot
    products, which the caller checked: kernels.native.prefill_attention_available) where
    blocks hold a multiple of NATIVE_PREFILL_BLOCK_MULTIPLE tokens; elsewhere
    `build_native_decode_plan`."""
    if step.block_size % NATIVE_PREFILL_BLOCK_MULTIPLE:
        return build_native_decode_plan(step, device)
    return AttentionPlan(
        slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
        num_decode=step.num_decode,
        decode_groups=_native_groups(step, device),
        prefill_rows=[],
        fresh_prefills=[],
        native=True,
        native_prefills=_native_prefills(step, device),
    )


def build_triton_plan(step: StepMetadata, device: torch.device) -> AttentionPlan:
    """Only the triton kernels' metadata: every row's block table and lengths."""
    return AttentionPlan(
        slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
        num_decode=step.num_decode,
        decode_groups=[],
        prefill_rows=[],
        fresh_prefills=[],
        paged=_paged_metadata(step, device),
    )


def _torch_prefills(
    step: StepMetadata, device: torch.device
) -> tuple[list[PrefillRow], list[FreshPrefills]]:
    """The prefill rows for SDPA: those with cached context one at a time over their gathered
    blocks, the fresh ones batched by length straight from the step's K/V."""
    query_lens, seq_lens, block_size = step.query_lens, step.seq_lens, step.block_size
    prefill_rows: list[PrefillRow] = []
    fresh: list[FreshPrefills] = []
    query_start = int(query_lens[: step.num_decode].sum())
    for i in range(step.num_decode, len(query_lens)):
        q_len, s_len = int(query_lens[i]), int(seq_lens[i])
        if s_len == q_len:  # no cached context
            last = fresh[-1] if fresh else None
            if last and last.query_len == q_len and last.end == query_start:
                last.num_rows += 1
            else:
                fresh.append(FreshPrefills(query_start, 1, q_len))
            query_start += q_len
            continue
        num_blocks = -(-s_len // block_size)
        ids = torch.tensor(step.block_tables[i][:num_blocks], dtype=torch.long, device=device)
        ctx = s_len - q_len
        rows = torch.arange(q_len, device=device)[:, None]
        mask = torch.arange(s_len, device=device)[None, :] <= rows + ctx
        prefill_rows.append(PrefillRow(query_start, q_len, s_len, ids, mask))
        query_start += q_len
    return prefill_rows, fresh


def _native_prefills(step: StepMetadata, device: torch.device) -> NativePrefills | None:
    query_lens, seq_lens, num_decode = step.query_lens, step.seq_lens, step.num_decode
    block_tables = step.block_tables
    rows = len(query_lens) - num_decode
    if rows == 0:
        return None
    width = max(len(t) for t in block_tables[num_decode:])
    # One host buffer, one copy: the block tables, then each row's (start, length, seq_len).
    host = np.zeros(rows * (width + 3), np.int64)
    tables = host[: rows * width].reshape(rows, width)
    for i, table in enumerate(block_tables[num_decode:]):
        tables[i, : len(table)] = table
    meta = host[rows * width :].reshape(rows, 3)
    meta[:, 1] = query_lens[num_decode:]
    meta[:, 0] = np.cumsum(meta[:, 1]) - meta[:, 1] + int(query_lens[:num_decode].sum())
    meta[:, 2] = seq_lens[num_decode:]
    dev = torch.from_numpy(host).to(device)
    return NativePrefills(dev[: rows * width].view(rows, width), dev[rows * width :].view(rows, 3))


def _paged_metadata(step: StepMetadata, device: torch.device) -> PagedMetadata:
    query_lens, seq_lens, num_decode = step.query_lens, step.seq_lens, step.num_decode
    block_tables = step.block_tables
    rows = len(query_lens)
    # One host buffer, one copy to the device: tables, then lengths, then query offsets.
    width = max((len(t) for t in block_tables[:rows]), default=0) or 1
    host = np.zeros(rows * width + 2 * rows + 1, np.int32)
    tables = host[: rows * width].reshape(rows, width)
    for i, table in enumerate(block_tables[:rows]):
        tables[i, : len(table)] = table
    host[rows * width : rows * width + rows] = seq_lens[:rows]
    np.cumsum(query_lens, out=host[rows * width + rows + 1 :])
    dev = torch.from_numpy(host).to(device)
    return PagedMetadata(
        block_tables=dev[: rows * width].view(rows, width),
        seq_lens=dev[rows * width : rows * width + rows],
        query_start_loc=dev[rows * width + rows :],
        num_decode=num_decode,
        num_rows=rows,
        max_decode_seq_len=int(seq_lens[:num_decode].max()) if num_decode else 0,
        max_prefill_query_len=int(query_lens[num_decode:].max()) if rows > num_decode else 0,
    )


def _split_by_length(lens: np.ndarray) -> list[tuple[int, int]]:
    """Split length-sorted rows into 1, 2 or 4 even groups, whichever pads least."""
    n = len(lens)
    best: list[tuple[int, int]] = [(0, n)]
    best_cost = n * int(lens.max())
    for k in (2, 4):
        if n < 4 * k:
            break
        bounds = np.linspace(0, n, k + 1).astype(int)
        spans = list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))
        cost = sum((e - s) * int(lens[s:e].max()) for s, e in spans) + k * _GROUP_COST_SLOTS
        if cost < best_cost:
            best, best_cost = spans, cost
    return best


def _decode_tables(step: StepMetadata) -> tuple[np.ndarray, np.ndarray]:
    """The decode rows' block tables, zero-padded ([num_decode, max_blocks] int64), and
    their lengths."""
    tables = step.block_tables[: step.num_decode]
    bt = np.zeros((step.num_decode, max(len(t) for t in tables)), np.int64)
    for i, table in enumerate(tables):
        bt[i, : len(table)] = table
    return bt, step.seq_lens[: step.num_decode]


def _cascade(
    bt: np.ndarray, lens: np.ndarray, block_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """A group's blocks: those every row starts with (None: none), each row's blocks after
    them ([rows, max_tail_blocks]), and how many those shared blocks are."""
    num_shared = 0
    if len(lens) > 1:
        same = (bt == bt[0]).all(axis=0)
        num_shared = int(same.argmin()) if not same.all() else bt.shape[1]
        # Every row keeps at least its own last token in the tail.
        num_shared = min(num_shared, int((lens.min() - 1) // block_size))
    shared = torch.from_numpy(bt[0, :num_shared].copy()).to(device) if num_shared else None
    tail_blocks = int(-(-lens.max() // block_size)) - num_shared
    tables = torch.from_numpy(bt[:, num_shared : num_shared + tail_blocks].copy()).to(device)
    return shared, tables, num_shared


def _masked_group(
    bt: np.ndarray, lens: np.ndarray, row_start: int, block_size: int, device: torch.device
) -> DecodeGroup:
    """Rows [row_start, row_start + len(lens)) for the torch path: a mask over the tails."""
    rows = len(lens)
    shared, tables, num_shared = _cascade(bt, lens, block_size, device)
    key_pos = np.arange(tables.shape[1] * block_size) + num_shared * block_size
    mask = torch.from_numpy(key_pos[None, :] < lens[:, None]).view(1, rows, 1, -1).to(device)
    return DecodeGroup(row_start, row_start + rows, shared, tables, mask, None)


def _native_groups(step: StepMetadata, device: torch.device) -> list[DecodeGroup]:
    """Every decode row in one group for the C++ kernel, which reads each row's length."""
    if not step.num_decode:
        return []
    bt, lens = _decode_tables(step)
    shared, tables, _ = _cascade(bt, lens, step.block_size, device)
    seq_lens = torch.from_numpy(lens.astype(np.int64, copy=True)).to(device)
    return [DecodeGroup(0, step.num_decode, shared, tables, None, seq_lens)]


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
    """[kv_heads, *block_ids.shape[:-1], num_blocks * block_size, head_dim], contiguous.

    A row gather (embedding) over the cache seen as [kv_heads * num_blocks, block]
    rows: several times faster on the CPU than advanced indexing on dim 1.
    """
    kvh, num_blocks, block_size, head_dim = cache.shape
    offsets = torch.arange(0, kvh * num_blocks, num_blocks, device=block_ids.device)
    ids = block_ids.unsqueeze(0) + offsets.view(kvh, *([1] * block_ids.dim()))
    rows = F.embedding(ids, cache.view(kvh * num_blocks, block_size * head_dim))
    return rows.view(kvh, *block_ids.shape[:-1], block_ids.shape[-1] * block_size, head_dim)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each query token over its sequence's cached K/V.

    query: [num_tokens, num_heads, head_dim]; returns the same shape. key/value: the step's
    own [num_tokens, num_kv_heads, head_dim], which must also be in the cache already
    (`write_kv`): fresh prefills read them directly, everything else from the cache.
    """
    key_cache, value_cache = kv_cache
    out = torch.empty_like(query)
    for group in plan.decode_groups:
        if plan.native:
            torch.ops.loragate.decode_attention(
                query[group.row_start : group.row_end],
                key_cache,
                value_cache,
                group.shared_block_ids,
                group.block_tables,
                group.seq_lens,
                scale,
                out[group.row_start : group.row_end],
            )
            continue
        out[group.row_start : group.row_end] = _decode_attention(
            query[group.row_start : group.row_end], key_cache, value_cache, group, scale
        )
    if plan.native_prefills is not None:
        torch.ops.loragate.prefill_attention(
            query,
            key_cache,
            value_cache,
            plan.native_prefills.block_tables,
            plan.native_prefills.meta,
            scale,
            out,
        )
    for batch in plan.fresh_prefills:
        rows = slice(batch.query_start, batch.end)
        shape = (batch.num_rows, batch.query_len, -1, query.shape[-1])
        o = F.scaled_dot_product_attention(
            query[rows].reshape(shape).transpose(1, 2),
            key[rows].reshape(shape).transpose(1, 2),
            value[rows].reshape(shape).transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o.transpose(1, 2).reshape(-1, *query.shape[1:])
    for row in plan.prefill_rows:
        q = query[row.query_start : row.query_start + row.query_len].transpose(0, 1).unsqueeze(0)
        k = _gather(key_cache, row.block_ids)[:, : row.seq_len].unsqueeze(0)
        v = _gather(value_cache, row.block_ids)[:, : row.seq_len].unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=row.mask, scale=scale, enable_gqa=True
        )
        out[row.query_start : row.query_start + row.query_len] = o[0].transpose(0, 1)
    return out


def _decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
) -> torch.Tensor:
    """One query per row; the softmax spans the shared blocks and each row's tail."""
    num_rows, num_heads, head_dim = query.shape
    kvh = key_cache.shape[0]
    heads_per_kv = num_heads // kvh
    # Heads h*heads_per_kv .. (h+1)*heads_per_kv-1 read KV head h, as in HF's repeat_kv.
    q = (
        (query * scale).view(num_rows, kvh, heads_per_kv, head_dim).transpose(0, 1)
    )  # [kvh, D, G, d]

    k_tail = _gather(key_cache, group.block_tables)  # [kvh, D, L, d]
    v_tail = _gather(value_cache, group.block_tables)
    s_tail = torch.matmul(q, k_tail.transpose(-1, -2))  # [kvh, D, G, L]
    assert group.mask is not None, "a plan built for the C++ kernel"
    s_tail = s_tail.masked_fill_(~group.mask, float("-inf"))
    m = s_tail.amax(dim=-1, keepdim=True)

    if group.shared_block_ids is None:
        p_tail = torch.exp_(s_tail - m)
        o = torch.matmul(p_tail, v_tail) / p_tail.sum(dim=-1, keepdim=True)
    else:
        k_shared = _gather(key_cache, group.shared_block_ids)  # [kvh, S, d]
        v_shared = _gather(value_cache, group.shared_block_ids)
        s_shared = torch.matmul(
            q.reshape(kvh, num_rows * heads_per_kv, head_dim), k_shared.transpose(-1, -2)
        )
        s_shared = s_shared.view(kvh, num_rows, heads_per_kv, -1)
        m = torch.maximum(m, s_shared.amax(dim=-1, keepdim=True))
        p_tail = torch.exp_(s_tail - m)
        p_shared = torch.exp_(s_shared - m)
        denom = p_tail.sum(dim=-1, keepdim=True) + p_shared.sum(dim=-1, keepdim=True)
        o_shared = torch.matmul(p_shared.view(kvh, num_rows * heads_per_kv, -1), v_shared)
        o = (
            torch.matmul(p_tail, v_tail) + o_shared.view(kvh, num_rows, heads_per_kv, head_dim)
        ) / denom
    return o.transpose(0, 1).reshape(num_rows, num_heads, head_dim)
