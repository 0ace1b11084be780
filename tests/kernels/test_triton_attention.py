"""The triton paged attention (decode split-K, prefill/extend) against the torch
specification, `kernels.attention.paged_attention`, through both kinds of plan."""

from __future__ import annotations

import pytest
import torch
from triton_cases import DEVICE, TOLERANCE, paged_step

from kernels.attention import PagedMetadata, build_plan, build_triton_plan, paged_attention
from kernels.triton import ops
from kernels.triton.decode_attention import decode_attention


def spec(step, block_size: int, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The torch specification in float32 on the step's (rounded) inputs."""
    plan = build_plan(step.metadata(block_size), torch.device("cpu"))
    f = torch.float32
    return paged_attention(
        step.query.to(f),
        step.key.to(f),
        step.value.to(f),
        (step.key_cache.to(f), step.value_cache.to(f)),
        plan,
        scale,
    )


def triton_attention(step, block_size: int, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
    plan = build_triton_plan(step.metadata(block_size), DEVICE)
    assert plan.paged is not None and not plan.decode_groups and not plan.prefill_rows
    out = ops.paged_attention(step.query.to(DEVICE), poisoned(step, block_size), plan.paged, scale)
    return out.cpu().float()


def poisoned(step, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The caches on the device with NaN in every slot no row may read (blocks in no table,
    the slots of a row's last block past its length): a kernel that reads one fails."""
    kvh, num_blocks, _, head_dim = step.key_cache.shape
    readable = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for table, seq_len in zip(step.block_tables, step.seq_lens.tolist(), strict=True):
        pos = torch.arange(seq_len)
        readable[
            torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
        ] = True
    caches = []
    for cache in (step.key_cache, step.value_cache):
        c = cache.clone().view(kvh, -1, head_dim)
        c[:, ~readable] = float("nan")
        caches.append(c.view(cache.shape).to(DEVICE))
    return caches[0], caches[1]


# Decode lengths at, just past and just short of block boundaries, and a one-token row.
DECODE_LENS = [1, 16, 17, 31, 48, 5]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype"),
    [
        (2, 2, 64, torch.float32),  # MHA
        (8, 2, 80, torch.float32),  # GQA 4, head_dim not a power of two
        (8, 1, 128, torch.float16),  # GQA 8
        (4, 1, 64, torch.bfloat16),
    ],
)
def test_decode_matches_the_specification(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    rows = [(1, s) for s in DECODE_LENS]
    step = paged_step(
        rows,
        num_decode=len(rows),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        seed=heads * head_dim,
    )
    scale = head_dim**-0.5
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(
        triton_attention(step, 16, scale), spec(step, 16, scale), rtol=rtol, atol=atol
    )


@pytest.mark.parametrize("num_splits", [1, 3])
def test_split_k_merges_to_the_same_result(num_splits: int) -> None:
    """Long rows cut into key ranges (some empty for the shorter rows), then merged."""
    rows = [(1, 100), (1, 7), (1, 64)]
    step = paged_step(
        rows,
        num_decode=3,
        heads=4,
        kv_heads=2,
        head_dim=64,
        block_size=8,
        dtype=torch.float32,
        seed=7,
    )
    plan = build_triton_plan(step.metadata(8), DEVICE)
    assert plan.paged is not None and plan.paged.max_decode_seq_len == 100
    out = torch.zeros(step.query.shape, device=DEVICE)
    decode_attention(
        step.query.to(DEVICE), poisoned(step, 8), plan.paged, 0.125, out, num_splits=num_splits
    )
    torch.testing.assert_close(out.cpu(), spec(step, 8, 0.125), rtol=2e-5, atol=2e-5)


def test_decode_rows_sharing_leading_blocks() -> None:
    """The cascade case: the torch plan attends the shared blocks once for the group, the
    triton kernel reads them through every row's own table; the results agree."""
    rows = [(1, 40), (1, 45), (1, 38), (1, 64)]
    step = paged_step(
        rows,
        num_decode=4,
        heads=4,
        kv_heads=1,
        head_dim=64,
        block_size=8,
        dtype=torch.float32,
        seed=3,
        shared_blocks=4,
    )
    plan = build_plan(step.metadata(8), torch.device("cpu"))
    assert plan.decode_groups[0].shared_block_ids is not None  # the spec does take the cascade
    torch.testing.assert_close(
        triton_attention(step, 8, 0.125), spec(step, 8, 0.125), rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype", "block_size"),
    [
        (4, 4, 64, torch.float32, 16),
        (8, 2, 80, torch.float16, 16),
        (8, 1, 64, torch.bfloat16, 8),
        (8, 2, 128, torch.float32, 16),
        (4, 2, 64, torch.float32, 1),  # one token per block
    ],
)
def test_a_mixed_step_matches_the_specification(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
) -> None:
    """Decode rows, then prefills: a fresh prompt, a chunk after cached context (a later
    chunk, a prefix-cache hit, a recompute), a one-token chunk, and an empty row."""
    rows = [
        (1, 9),
        (1, 33),  # decode
        (20, 20),  # fresh prompt across block boundaries
        (7, 23),  # a chunk starting mid-sequence, mid-block
        (1, 17),  # a one-token chunk after context
        (0, 16),  # nothing to attend this step
        (16, 48),  # a chunk aligned with blocks
    ]
    step = paged_step(
        rows,
        num_decode=2,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=block_size + head_dim,
    )
    scale = head_dim**-0.5
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(
        triton_attention(step, block_size, scale),
        spec(step, block_size, scale),
        rtol=rtol,
        atol=atol,
    )


def test_launchers_refuse_what_they_would_misread() -> None:
    step = paged_step(
        [(1, 5)],
        num_decode=1,
        heads=3,
        kv_heads=2,
        head_dim=64,
        block_size=8,
        dtype=torch.float32,
        seed=0,
    )
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    starts = torch.tensor([0, 1], dtype=torch.int32)

    def one_row(tables: torch.Tensor, max_seq_len: int) -> PagedMetadata:
        return PagedMetadata(tables, lens, starts, 1, 1, max_seq_len, 0)

    caches = (step.key_cache, step.value_cache)
    with pytest.raises(ValueError, match="do not group"):
        decode_attention(step.query, caches, one_row(tables, 5), 1.0, torch.empty_like(step.query))
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="int32 or int64"):
        decode_attention(q, caches, one_row(tables.float(), 5), 1.0, q)
    with pytest.raises(ValueError, match="exceeds the tables"):
        decode_attention(q, caches, one_row(tables, 9), 1.0, q)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        decode_attention(
            q.transpose(1, 2).contiguous().transpose(1, 2), caches, one_row(tables, 5), 1.0, q
        )
