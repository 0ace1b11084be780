"""The C++ rotary and KV write (kernels/csrc/layer_ops.cpp) against the torch path they
replace: `apply_rope` and `kernels.attention.write_kv`."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from engine.models.llama import RotaryEmbedding
from kernels import native
from kernels.attention import write_kv
from kernels.torch_backend import apply_rope, rope_rows

pytestmark = pytest.mark.skipif(not native.load(), reason="CPU kernels could not be built here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 36])
def test_rotary_is_the_torch_path_bit_for_bit(dtype: torch.dtype, head_dim: int) -> None:
    """In place in qkv (q and k heads; v untouched), each product and the sum rounded as
    torch's three ops round them. 36: a half of 18 leaves a tail past the 8-lane loop."""
    heads, kv_heads, n = 4, 2, 7
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
    )
    tables = RotaryEmbedding(config, head_dim, 512)
    g = torch.Generator().manual_seed(head_dim)
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype)
    positions = torch.tensor([0, 1, 17, 63, 64, 300, 511])
    rope = rope_rows(positions, tables.cos, tables.signed_sin, dtype)
    width = (heads + kv_heads) * head_dim
    expected = apply_rope(qkv[:, :width].view(n, -1, head_dim), rope)
    values = qkv[:, width:].clone()
    torch.ops.loragate.rotary_(qkv[:, :width].view(n, -1, head_dim), *rope)
    assert torch.equal(qkv[:, :width].view(n, -1, head_dim), expected)
    assert torch.equal(qkv[:, width:], values)


def test_rotary_refuses_what_it_cannot_rotate() -> None:
    x = torch.randn(3, 2, 64)
    cos = sin = torch.randn(3, 1, 64)
    with pytest.raises(RuntimeError, match="heads contiguous"):
        torch.ops.loragate.rotary_(x.transpose(0, 1), cos, sin)
    with pytest.raises(RuntimeError, match="cos and signed sin"):
        torch.ops.loragate.rotary_(x, cos[:2], sin[:2])
    with pytest.raises(RuntimeError, match="cos and signed sin"):
        torch.ops.loragate.rotary_(x, cos.bfloat16(), sin.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_scatters_exactly_like_the_torch_path(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    kvh, blocks, block_size, head_dim, n = 3, 6, 4, 64, 9
    # The engine's k and v are strided views of qkv: rows of q + k + v heads.
    qkv = torch.randn(n, 2 + 2 * kvh, head_dim, generator=g).to(dtype)
    key, value = qkv[:, 2 : 2 + kvh], qkv[:, 2 + kvh :]
    slots = torch.randperm(blocks * block_size, generator=g)[:n]
    ref = [torch.randn(kvh, blocks, block_size, head_dim, generator=g).to(dtype) for _ in "kv"]
    mine = [c.clone() for c in ref]
    write_kv(key, value, *ref, slots)
    torch.ops.loragate.write_kv(key, value, *mine, slots)
    assert torch.equal(mine[0], ref[0]) and torch.equal(mine[1], ref[1])


def test_write_kv_refuses_a_slot_outside_the_cache() -> None:
    caches = [torch.zeros(1, 2, 2, 64) for _ in "kv"]
    before = [c.clone() for c in caches]
    kv = torch.ones(2, 1, 64)
    for bad in (4, -1):
        with pytest.raises(RuntimeError, match="outside the cache"):
            torch.ops.loragate.write_kv(kv, kv, *caches, torch.tensor([1, bad]))
    # Slots are checked before anything is written.
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])
    with pytest.raises(RuntimeError, match="cache's dtype"):
        torch.ops.loragate.write_kv(kv.bfloat16(), kv.bfloat16(), *caches, torch.tensor([0, 1]))
