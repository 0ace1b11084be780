"""The triton KV write, fused RMSNorm and rotary kernels against their torch specifications:
`kernels.attention.write_kv`, `engine.models.llama.RMSNorm` on the torch kernels and
`apply_rope`."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from triton_cases import DEVICE

from engine.models.llama import RMSNorm, RotaryEmbedding
from kernels.attention import write_kv
from kernels.torch_backend import TorchKernels, apply_rope, rope_rows
from kernels.triton.kv_write import write_kv as triton_write_kv
from kernels.triton.rms_norm import add_rms_norm, rms_norm
from kernels.triton.rotary import rotary_

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_scatters_exactly_like_the_specification(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    kvh, blocks, block_size, head_dim = 2, 6, 4, 80
    key = torch.randn(9, kvh, head_dim, generator=g).to(dtype)
    # The engine's k is a strided view of qkv: rows of q + k + v heads.
    qkv = torch.randn(9, 5, head_dim, generator=g).to(dtype)
    qkv[:, 1:3] = key
    value = torch.randn(9, kvh, head_dim, generator=g).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=g)[:9]
    ref = [torch.zeros(kvh, blocks, block_size, head_dim, dtype=dtype) for _ in range(2)]
    write_kv(key, value, *ref, slots)
    caches = [torch.zeros(kvh, blocks, block_size, head_dim, dtype=dtype, device=DEVICE)] * 1
    caches.append(torch.zeros_like(caches[0]))
    triton_write_kv(qkv[:, 1:3].to(DEVICE), value.to(DEVICE), *caches, slots.to(DEVICE))
    assert torch.equal(caches[0].cpu(), ref[0]) and torch.equal(caches[1].cpu(), ref[1])


def test_kv_write_skips_padding_slots() -> None:
    cache = torch.zeros(1, 2, 2, 64, device=DEVICE)
    other = torch.zeros_like(cache)
    kv = torch.ones(2, 1, 64, device=DEVICE)
    triton_write_kv(kv, kv, cache, other, torch.tensor([3, -1], device=DEVICE))
    assert cache.sum().item() == 64 and cache[0, 1, 1].eq(1).all()


# Half precision: the kernel rounds as the specification does; only the order of the sum
# of squares differs, so outputs agree to one unit in the last place (bfloat16 under the
# interpreter: two, as it truncates float32 to bfloat16).
NORM_TOLERANCE = {
    torch.float32: (2e-6, 2e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 256), (5, 80), (0, 64)])
def test_rms_norm_with_and_without_the_residual_add(
    dtype: torch.dtype, rows: int, hidden: int
) -> None:
    g = torch.Generator().manual_seed(rows + hidden)
    norm = RMSNorm(hidden, 1e-5, TorchKernels(torch.device("cpu"))).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=g).to(dtype)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    rtol, atol = NORM_TOLERANCE[dtype]
    weight = norm.weight.data.to(DEVICE)
    with torch.no_grad():
        expected = norm(x)
        torch.testing.assert_close(
            rms_norm(x.to(DEVICE), weight, 1e-5).cpu(), expected, rtol=rtol, atol=atol
        )
        residual = x.clone()
        expected = norm.add_forward(residual, delta)
    mine = x.to(DEVICE)
    out = add_rms_norm(mine, delta.to(DEVICE), weight, 1e-5)
    # The residual add is one rounding in either: equal but for the interpreter's bf16.
    sum_tol = (0.0, 0.0) if dtype != torch.bfloat16 else (8e-3, 1e-2)
    torch.testing.assert_close(mine.cpu(), residual, rtol=sum_tol[0], atol=sum_tol[1])
    torch.testing.assert_close(out.cpu(), expected, rtol=rtol, atol=atol)


ROPE_SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
@pytest.mark.parametrize(("head_dim", "dtype"), [(64, torch.float32), (80, torch.bfloat16)])
def test_rotary_over_the_fused_qk_heads(scaling: str, head_dim: int, dtype: torch.dtype) -> None:
    """Every rope type the model supports, through its own tables, in place in qkv."""
    heads, kv_heads = 4, 2
    rope = ROPE_SCALINGS[scaling]
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        **({"rope_scaling": dict(rope)} if rope else {}),
    )
    tables = RotaryEmbedding(config, head_dim, 256)
    g = torch.Generator().manual_seed(head_dim)
    n = 6
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 17, 63, 64, 255])
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(n, -1, head_dim)
    expected = apply_rope(qk, rope_rows(positions, tables.cos, tables.signed_sin, dtype))
    mine = qkv.to(DEVICE)
    mine_qk = mine[:, : (heads + kv_heads) * head_dim].view(n, -1, head_dim)
    rotary_(mine_qk, positions.to(DEVICE), tables.cos.to(DEVICE), tables.signed_sin.to(DEVICE))
    # bfloat16: three roundings (two products, their sum), each toward zero under the
    # interpreter; with |x| up to ~4 that is two units in the last place of the products.
    tol = (0.0, 0.0) if dtype == torch.float32 else (1.6e-2, 3.2e-2)
    torch.testing.assert_close(mine_qk.cpu(), expected, rtol=tol[0], atol=tol[1])
    assert torch.equal(
        mine[:, (heads + kv_heads) * head_dim :].cpu(), qkv[:, (heads + kv_heads) * head_dim :]
    )


def test_launchers_check_shapes_and_dtypes() -> None:
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        rms_norm(x.double(), torch.ones(8, device=DEVICE, dtype=torch.float64), 1e-5)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        rms_norm(x.t(), torch.ones(2, device=DEVICE), 1e-5)
    tables = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="tables must be float32"):
        rotary_(
            x.view(2, 1, 8),
            torch.zeros(2, dtype=torch.long, device=DEVICE),
            tables.half(),
            tables.half(),
        )
    with pytest.raises(ValueError, match="one slot per token"):
        cache = torch.zeros(1, 2, 2, 8, device=DEVICE)
        triton_write_kv(
            x.view(2, 1, 8),
            x.view(2, 1, 8),
            cache,
            cache.clone(),
            torch.zeros(3, dtype=torch.long, device=DEVICE),
        )
