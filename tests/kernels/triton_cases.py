"""Shared helpers of the triton kernel tests: the device, tolerances, random paged steps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention import StepMetadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (rtol, atol) of a kernel in each dtype against its float32 specification on the same
# rounded inputs. Half precision: the kernels round probabilities (attention) or the
# shrunk activations (LoRA) to the dtype before the second GEMM, as the torch versions
# do; bfloat16 also pays the interpreter's fp32->bf16 truncation (toward zero).
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@dataclass
class PagedStep:
    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_tables: list[list[int]]
    slot_mapping: np.ndarray
    num_decode: int
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor  # the step's own K/V, as already written to the cache
    value: torch.Tensor

    def metadata(self, block_size: int) -> StepMetadata:
        """What the plan builders take of the step."""
        return StepMetadata(
            self.query_lens,
            self.seq_lens,
            self.block_tables,
            self.slot_mapping,
            self.num_decode,
            block_size,
        )


def paged_step(
    rows: list[tuple[int, int]],
    *,
    num_decode: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    shared_blocks: int = 0,
) -> PagedStep:
    """A step of (query_len, seq_len) rows over a random cache; rows' blocks are scattered
    at random, the first `shared_blocks` of every decode row the same (a cascade prefix)."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-s // block_size) for _, s in rows) + 4
    num_blocks = need + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    shared = perm[:shared_blocks]
    free = perm[shared_blocks:]
    tables = []
    for i, (_, s) in enumerate(rows):
        n = -(-s // block_size)
        own = shared[: min(n, shared_blocks)] if i < num_decode else []
        take = n - len(own)
        tables.append(own + free[:take])
        free = free[take:]
    shape = (kv_heads, num_blocks, block_size, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    slots = [
        table[pos // block_size] * block_size + pos % block_size
        for (q, s), table in zip(rows, tables, strict=True)
        for pos in range(s - q, s)
    ]
    slot_t = torch.tensor(slots, dtype=torch.long)
    key = key_cache.view(kv_heads, -1, head_dim)[:, slot_t].transpose(0, 1).contiguous()
    value = value_cache.view(kv_heads, -1, head_dim)[:, slot_t].transpose(0, 1).contiguous()
    query = torch.randn(len(slots), heads, head_dim, generator=g).to(dtype)
    return PagedStep(
        query_lens=np.array([q for q, _ in rows], dtype=np.int64),
        seq_lens=np.array([s for _, s in rows], dtype=np.int64),
        block_tables=tables,
        slot_mapping=np.array(slots, dtype=np.int64),
        num_decode=num_decode,
        key_cache=key_cache,
        value_cache=value_cache,
        query=query,
        key=key,
        value=value,
    )
