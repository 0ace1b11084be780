"""The C++ decode attention (kernels/csrc) against its torch specification and a dense
softmax reference: random paged caches, grouped-query heads, shared prefixes, ragged lengths."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernels import cpu_features, native
from kernels.attention import (
    StepMetadata,
    build_native_decode_plan,
    build_plan,
    paged_attention,
)

pytestmark = pytest.mark.skipif(not native.load(), reason="CPU kernels could not be built here")


def _case(
    seed: int,
    lens: list[int],
    shared_tokens: int,
    heads: int = 4,
    kv_heads: int = 2,
    dim: int = 64,
    block_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """A cache holding each row's keys in random blocks; rows share their first
    `shared_tokens // block_size` blocks."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 8
    key_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=g)
    value_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=g)
    free = rng.permutation(num_blocks).tolist()
    shared = [free.pop() for _ in range(shared_tokens // block_size)]
    tables = [shared + [free.pop() for _ in range(-(-n // block_size) - len(shared))] for n in lens]
    query = torch.randn(len(lens), heads, dim, generator=g)
    return query, key_cache, value_cache, tables


def _dense(query, key_cache, value_cache, tables, lens, scale, bf16_probs=False):  # type: ignore[no-untyped-def]
    """Softmax attention in float64. `bf16_probs`: the unnormalized probabilities are
    rounded to bfloat16 before they weigh the values (their sum is not), as flash attention
    and the AVX-512 BF16 kernel do."""
    kv_heads, _, block_size, dim = key_cache.shape
    per_kv = query.shape[1] // kv_heads
    out = torch.empty_like(query)
    for r, (table, n) in enumerate(zip(tables, lens, strict=True)):
        k = key_cache[:, table].reshape(kv_heads, -1, dim)[:, :n]
        v = value_cache[:, table].reshape(kv_heads, -1, dim)[:, :n]
        k, v = k.repeat_interleave(per_kv, 0), v.repeat_interleave(per_kv, 0)
        s = (query[r, :, None, :].double() @ k.double().transpose(1, 2)) * scale
        e = torch.exp(s - s.amax(-1, keepdim=True))
        weights = e.float().bfloat16().double() if bf16_probs else e
        out[r] = ((weights @ v.double()) / e.sum(-1, keepdim=True))[:, 0].float()
    return out


def _bf16_dot_products(dim: int) -> bool:
    """The C++ kernel takes its AVX-512 BF16 path here, for even block sizes
    (kernels/csrc/decode_attention_bf16.h)."""
    return "avx512_bf16" in cpu_features.flags() and dim in (64, 128)


def _attend(query, key_cache, value_cache, tables, lens, native_path):  # type: ignore[no-untyped-def]
    block_size = key_cache.shape[2]
    lens_np = np.array(lens)
    order = np.argsort(lens_np, kind="stable")  # build_plan wants decode rows sorted by length
    slots = np.array([tables[i][(lens[i] - 1) // block_size] * block_size for i in order])
    step = StepMetadata(
        np.ones(len(lens), np.int64),
        lens_np[order],
        [tables[i] for i in order],
        slots,
        len(lens),
        block_size,
    )
    build = build_native_decode_plan if native_path else build_plan
    plan = build(step, torch.device("cpu"))
    scale = query.shape[2] ** -0.5
    unused = torch.empty(0, key_cache.shape[0], key_cache.shape[3])  # no prefill rows
    kv_cache = (key_cache, value_cache)
    out = paged_attention(query[order], unused, unused, kv_cache, plan, scale)
    return out[np.argsort(order)]


@pytest.mark.parametrize(
    ("lens", "shared_tokens", "heads", "kv_heads", "dim"),
    [
        ([1], 0, 4, 2, 64),
        ([5, 16, 17, 33, 100], 0, 4, 2, 64),
        ([40] * 16, 32, 4, 2, 64),  # a shared prefix: the cascade path of both
        ([1030, 1045, 1100, 1300], 1024, 8, 2, 64),
        ([7, 64, 200], 0, 6, 6, 64),  # no grouping of query heads
        ([3, 300], 0, 8, 1, 64),  # every query head on one kv head
        ([9, 50, 130], 16, 4, 2, 128),  # the other register-tiled head size
        ([9, 50, 130], 0, 4, 2, 40),  # any other head size: the generic loops
    ],
)
def test_native_matches_torch_and_dense(
    lens: list[int], shared_tokens: int, heads: int, kv_heads: int, dim: int
) -> None:
    query, key_cache, value_cache, tables = _case(0, lens, shared_tokens, heads, kv_heads, dim)
    ours = _attend(query, key_cache, value_cache, tables, lens, native_path=True)
    spec = _attend(query, key_cache, value_cache, tables, lens, native_path=False)
    dense = _dense(query, key_cache, value_cache, tables, lens, query.shape[2] ** -0.5)
    torch.testing.assert_close(ours, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, spec, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sharpness", [0.01, 8.0, 40.0])
def test_flat_and_peaked_softmax(sharpness: float) -> None:
    """Scores spread over hundreds (exp underflows to 0 for most keys) or nearly equal."""
    lens = [37, 300, 1100]
    query, key_cache, value_cache, tables = _case(2, lens, 0)
    query = query * sharpness
    ours = _attend(query, key_cache, value_cache, tables, lens, native_path=True)
    dense = _dense(query, key_cache, value_cache, tables, lens, query.shape[2] ** -0.5)
    torch.testing.assert_close(ours, dense, rtol=1e-5, atol=1e-5)


def test_strided_query_and_output_slices() -> None:
    """The model passes q as a slice of the fused q|k projection and writes into a slice."""
    lens = [9, 20, 33]
    query, key_cache, value_cache, tables = _case(1, lens, 0)
    wide = torch.randn(len(lens), 6, 64)
    wide[:, :4] = query
    out = torch.zeros(len(lens) + 2, 4, 64)
    torch.ops.loragate.decode_attention(
        wide[:, :4],
        key_cache,
        value_cache,
        None,
        torch.tensor([t + [0] * (3 - len(t)) for t in tables]),
        torch.tensor(lens),
        64**-0.5,
        out[1:-1],
    )
    dense = _dense(query, key_cache, value_cache, tables, lens, 64**-0.5)
    torch.testing.assert_close(out[1:-1], dense, rtol=1e-5, atol=1e-5)
    assert not out[0].any() and not out[-1].any()


@pytest.mark.parametrize(
    ("tables", "lens", "message"),
    [
        ([[0, 99]], [20], "block id out of range"),
        ([[0, -1]], [20], "block id out of range"),
        ([[0, 1]], [40], "does not fit its blocks"),
        ([[0, 1]], [0], "does not fit its blocks"),
    ],
)
def test_bad_tables_are_refused_not_read(
    tables: list[list[int]], lens: list[int], message: str
) -> None:
    cache = torch.zeros(2, 8, 16, 64)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.loragate.decode_attention(
            torch.zeros(1, 4, 64),
            cache,
            cache,
            None,
            torch.tensor(tables),
            torch.tensor(lens),
            1 / math.sqrt(64),
            torch.empty(1, 4, 64),
        )


@pytest.mark.parametrize(
    ("lens", "shared_tokens", "dim", "heads", "kv_heads", "block_size"),
    [
        ([5, 16, 17, 33, 100], 0, 64, 4, 2, 16),
        ([40] * 16, 32, 64, 4, 2, 16),
        ([9, 50, 130], 16, 128, 4, 2, 16),
        ([7, 70], 0, 40, 4, 2, 16),
        ([3, 300, 1031], 0, 64, 8, 1, 16),  # every query head on one kv head, odd lengths
        ([33, 95, 200], 64, 64, 9, 3, 32),  # SmolLM2's heads; blocks of 32: two key tiles each
        ([7, 20], 0, 64, 4, 2, 5),  # an odd block size: the generic loops
        # Behind a shared prefix with a tile of queries or more: AMX's cascade where the CPU
        # has it. W2's shape (16 rows of SmolLM2's heads, behind 256 tokens here); head_dim 128
        # with a prefix of three key tiles (padded to 64 keys) and a row that is all prefix;
        # blocks of 32 and 21 queries (a partial tile).
        ([257 + 7 * i for i in range(16)], 256, 64, 9, 3, 16),
        ([48, 49, 60, 80, 100, 130, 48, 200], 48, 128, 8, 2, 16),
        ([70] * 6 + [33], 32, 64, 6, 2, 32),
    ],
)
def test_bfloat16_computes_in_float32(
    lens: list[int], shared_tokens: int, dim: int, heads: int, kv_heads: int, block_size: int
) -> None:
    """bf16 caches and queries: scores, softmax and the weighted sum in float32, rounded
    once (within one bf16 ulp), where the torch specification rounds every intermediate to
    bf16 and drifts further. With bf16 dot products (AVX-512 BF16) the probabilities that
    weigh the values are bf16, as in flash attention; elsewhere they stay float32."""
    query, key_cache, value_cache, tables = _case(
        3, lens, shared_tokens, heads, kv_heads, dim, block_size
    )
    q, k, v = query.bfloat16(), key_cache.bfloat16(), value_cache.bfloat16()
    ours = _attend(q, k, v, tables, lens, native_path=True)
    assert ours.dtype == torch.bfloat16
    bf16_path = _bf16_dot_products(dim) and block_size % 2 == 0
    dense = _dense(q.float(), k.float(), v.float(), tables, lens, dim**-0.5, bf16_path)
    # A probability whose float32 and float64 values round to neighbouring bf16 numbers moves
    # an output by about p * |v| / 256: a few 1e-6 for a long row, where outputs are ~0.03.
    torch.testing.assert_close(ours.float(), dense, rtol=2**-8, atol=3e-5 if bf16_path else 1e-6)
    spec = _attend(q, k, v, tables, lens, native_path=False)
    torch.testing.assert_close(ours, spec, rtol=2e-2, atol=2e-2)


def test_mixed_dtypes_are_refused() -> None:
    cache = torch.zeros(2, 8, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must all be float32 or all bfloat16"):
        torch.ops.loragate.decode_attention(
            torch.zeros(1, 4, 64),
            cache,
            cache,
            None,
            torch.tensor([[0]]),
            torch.tensor([3]),
            0.125,
            torch.empty(1, 4, 64),
        )
