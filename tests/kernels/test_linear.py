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
    packed = linear.PrepackedLinear(plain)
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)


def test_prepack_swaps_float32_linears_and_keeps_tied_weights() -> None:
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(50, 16),
            "block": nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)),
            "bf16": nn.Linear(16, 16).to(torch.bfloat16),
            "head": nn.Linear(16, 50, bias=False),
        }
    )
    model["head"].weight = model["embed"].weight  # tied, as tie_word_embeddings does
    x = torch.randn(4, 16)
    with torch.inference_mode():
        expected = model["head"](model["block"](x))
        assert linear.prepack(model) == 3
        assert isinstance(model["head"], linear.PrepackedLinear)
        assert isinstance(model["bf16"], nn.Linear)  # not float32: left alone
        assert model["embed"].weight.shape == (50, 16)
        torch.testing.assert_close(model["head"](model["block"](x)), expected)
