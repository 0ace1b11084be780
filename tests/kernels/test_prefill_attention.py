"""The C++ bf16 prefill attention (kernels/csrc/prefill_attention.cpp) against a float64 dense
reference and the torch specification: fresh prompts, chunks after cached context, rows that
share leading blocks, grouped-query heads, ragged chunk lengths, both head sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import native
from kernels.attention import (
    StepMetadata,
    build_native_decode_plan,
    build_native_plan,
    paged_attention,
)

pytestmark = pytest.mark.skipif(
    not native.prefill_attention_available(torch.bfloat16, 64, 16),
    reason="needs the C++ kernels built for a CPU with AVX-512 BF16",
)


def _case(  # type: ignore[no-untyped-def]
    seed: int,
    rows: list[tuple[int, int]],
    shared_tokens: int,
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
):
    """rows: (query_len, seq_len) per prefill row; rows share their first
    shared_tokens // block_size blocks. Unused cache slots hold NaN: nothing may read them."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for _, s in rows) + 4
    key_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=g).bfloat16()
    value_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=g).bfloat16()
    free = torch.randperm(num_blocks, generator=g).tolist()
    shared = [free.pop() for _ in range(shared_tokens // block_size)]
    tables = [
        shared + [free.pop() for _ in range(-(-s // block_size) - len(shared))] for _, s in rows
    ]
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for (_, s), table in zip(rows, tables, strict=True):
        for pos in range(s):
            used[table[pos // block_size], pos % block_size] = True
    key_cache[:, ~used] = float("nan")
    value_cache[:, ~used] = float("nan")
    tokens = sum(q for q, _ in rows)
    query = torch.randn(tokens, heads, dim, generator=g).bfloat16()
    return query, key_cache, value_cache, tables


def _own_kv(cache, rows, tables, block_size):  # type: ignore[no-untyped-def]
    """The step's own keys or values ([tokens, kv_heads, dim]), as the model passes them."""
    out = [
        cache[:, table[pos // block_size], pos % block_size]
        for (q, s), table in zip(rows, tables, strict=True)
        for pos in range(s - q, s)
    ]
    return torch.stack(out)


def _dense(query, key_cache, value_cache, rows, tables):  # type: ignore[no-untyped-def]
    """float64 causal attention; the unnormalized probabilities that weigh the values are
    rounded to bf16 (not their sum), as the kernel and flash attention do."""
    kv_heads, _, _, dim = key_cache.shape
    per_kv = query.shape[1] // kv_heads
    out = torch.empty(query.shape, dtype=torch.float32)
    start = 0
    for (q_len, s_len), table in zip(rows, tables, strict=True):
        k = key_cache[:, table].reshape(kv_heads, -1, dim)[:, :s_len].double()
        v = value_cache[:, table].reshape(kv_heads, -1, dim)[:, :s_len].double()
        k, v = k.repeat_interleave(per_kv, 0), v.repeat_interleave(per_kv, 0)
        q = query[start : start + q_len].double().transpose(0, 1)
        s = q @ k.transpose(1, 2) * dim**-0.5
        visible = torch.arange(s_len)[None, :] <= torch.arange(q_len)[:, None] + (s_len - q_len)
        s = s.masked_fill(~visible, float("-inf"))
        e = torch.exp(s - s.amax(-1, keepdim=True))
        o = (e.float().bfloat16().double() @ v) / e.sum(-1, keepdim=True)
        out[start : start + q_len] = o.transpose(0, 1).float()
        start += q_len
    return out


def _assert_one_rounding_off(ours: torch.Tensor, dense: torch.Tensor) -> None:
    """Elementwise within a bf16 step of the output, or of a probability that rounded the
    other way (p * |v| / 256: up to ~1e-3 where a query sees few keys); on average as close
    as rounding the exact result to bf16 once."""
    torch.testing.assert_close(ours.float(), dense, rtol=2**-8, atol=2e-3)
    error = (ours.float() - dense).abs().mean()
    rounding = (dense.bfloat16().float() - dense).abs().mean()
    assert error <= 1.25 * rounding, (error, rounding)


def _attend(query, key_cache, value_cache, rows, tables, native_prefill):  # type: ignore[no-untyped-def]
    block_size = key_cache.shape[2]
    step = StepMetadata(
        np.array([q for q, _ in rows]),
        np.array([s for _, s in rows]),
        tables,
        np.zeros(query.shape[0], np.int64),
        0,
        block_size,
    )
    build = build_native_plan if native_prefill else build_native_decode_plan
    plan = build(step, torch.device("cpu"))
    assert (plan.native_prefills is not None) == native_prefill
    key = _own_kv(key_cache, rows, tables, block_size)
    value = _own_kv(value_cache, rows, tables, block_size)
    kv_cache = (key_cache, value_cache)
    return paged_attention(query, key, value, kv_cache, plan, query.shape[2] ** -0.5)


@pytest.mark.parametrize(
    ("rows", "shared_tokens", "heads", "kv_heads", "dim", "block_size"),
    [
        ([(16, 16)], 0, 4, 2, 64, 16),  # one fresh prompt of one block
        ([(128, 128), (7, 7), (1, 1), (33, 33)], 0, 9, 3, 64, 16),  # fresh, ragged, SmolLM2 heads
        ([(128, 1152)] * 3, 1024, 9, 3, 64, 16),  # chunks behind one shared cached prefix
        ([(5, 40), (17, 300), (1, 65), (40, 40)], 0, 8, 1, 64, 16),  # mid-sequence chunks, GQA 8
        ([(20, 100), (64, 64)], 32, 4, 4, 64, 32),  # no grouping; blocks of 32
        ([(19, 83), (48, 48)], 16, 8, 2, 128, 16),  # head_dim 128
    ],
)
def test_matches_dense_and_torch(
    rows: list[tuple[int, int]],
    shared_tokens: int,
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
) -> None:
    query, key_cache, value_cache, tables = _case(
        0, rows, shared_tokens, heads, kv_heads, dim, block_size
    )
    ours = _attend(query, key_cache, value_cache, rows, tables, native_prefill=True)
    assert ours.dtype == torch.bfloat16 and not ours.isnan().any()
    dense = _dense(query, key_cache, value_cache, rows, tables)
    _assert_one_rounding_off(ours, dense)
    spec = _attend(query, key_cache, value_cache, rows, tables, native_prefill=False)
    torch.testing.assert_close(ours, spec, rtol=2e-2, atol=2e-2)


def test_strided_query_and_output() -> None:
    """The model passes q as a slice of the fused projection; out may be a slice too."""
    rows = [(20, 50)]
    query, key_cache, value_cache, tables = _case(1, rows, 0, 4, 2, 64, 16)
    wide = torch.zeros(20, 6, 64, dtype=torch.bfloat16)
    wide[:, :4] = query
    out = torch.zeros(22, 4, 64, dtype=torch.bfloat16)
    torch.ops.loragate.prefill_attention(
        wide[:, :4],
        key_cache,
        value_cache,
        torch.tensor([tables[0]]),
        torch.tensor([[0, 20, 50]]),
        64**-0.5,
        out[1:-1],
    )
    _assert_one_rounding_off(out[1:-1], _dense(query, key_cache, value_cache, rows, tables))
    assert not out[0].any() and not out[-1].any()


@pytest.mark.parametrize(
    ("table", "meta", "message"),
    [
        ([0, 99], [0, 4, 20], "block id out of range"),
        ([0, -1], [0, 4, 20], "block id out of range"),
        ([0, 1], [0, 4, 40], "do not fit"),  # longer than its blocks
        ([0, 1], [0, 8, 20], "do not fit"),  # more queries than the tensor has
        ([0, 1], [0, 4, 3], "do not fit"),  # fewer keys than queries
    ],
)
def test_bad_rows_are_refused_not_read(table: list[int], meta: list[int], message: str) -> None:
    cache = torch.zeros(2, 8, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.loragate.prefill_attention(
            torch.zeros(4, 4, 64, dtype=torch.bfloat16),
            cache,
            cache,
            torch.tensor([table]),
            torch.tensor([meta]),
            0.125,
            torch.empty(4, 4, 64, dtype=torch.bfloat16),
        )


def test_unsupported_caches_are_refused_and_reported() -> None:
    assert not native.prefill_attention_available(torch.float32, 64, 16)
    assert not native.prefill_attention_available(torch.bfloat16, 80, 16)
    assert not native.prefill_attention_available(torch.bfloat16, 64, 8)
    cache = torch.zeros(2, 8, 16, 64)
    with pytest.raises(RuntimeError, match="bfloat16 caches"):
        torch.ops.loragate.prefill_attention(
            torch.zeros(4, 4, 64),
            cache,
            cache,
            torch.tensor([[0]]),
            torch.tensor([[0, 4, 4]]),
            0.125,
            torch.empty(4, 4, 64),
        )
