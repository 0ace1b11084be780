"""Prepacked (oneDNN) linears against nn.Linear, and the swap inside a model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import linear

pytestmark = pytest.mark.skipif(not linear.available(), reason="no oneDNN in this torch build")


@pytest.mark.parametrize("rows", [1, 7, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_matches_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    plain = nn.Linear(256, 384, bias=bias)
    packed = linear.PrepackedLinear.reorder(plain)
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not linear.native_bf16(), reason="no bf16 dot products on this CPU")
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_prepacked_bfloat16_matches_linear(rows: int) -> None:
    """oneDNN accumulates in float32 and rounds once, as torch's bf16 GEMM does; only the
    summation order differs, so results agree to a bf16 rounding step."""
    torch.manual_seed(rows)
    plain = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    packed = linear.PrepackedLinear.reorder(plain)
    x = torch.randn(rows, 576).bfloat16()
    with torch.inference_mode():
        ours, theirs = packed(x), plain(x)
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2**-7, atol=2e-2)


def test_prepack_swaps_native_linears_and_keeps_tied_weights() -> None:
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(50, 16),
            "block": nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)),
            "bf16": nn.Linear(16, 16).to(torch.bfloat16),
            "fp16": nn.Linear(16, 16).to(torch.float16),
            "head": nn.Linear(16, 50, bias=False),
        }
    )
    model["head"].weight = model["embed"].weight  # tied, as tie_word_embeddings does
    x = torch.randn(4, 16)
    with torch.inference_mode():
        expected = model["head"](model["block"](x))
        bf16 = linear.native_bf16()
        assert linear.prepack(model) == 3 + bf16
        assert isinstance(model["head"], linear.PrepackedLinear)
        # bf16 only where the CPU computes it natively; float16 never (emulated on CPUs)
        assert isinstance(model["bf16"], linear.PrepackedLinear if bf16 else nn.Linear)
        assert isinstance(model["fp16"], nn.Linear)
        assert model["embed"].weight.shape == (50, 16)
        torch.testing.assert_close(model["head"](model["block"](x)), expected)
