"""The C++ RMSNorm kernels against torch's: alone, fused with the residual add, and refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import native

pytestmark = pytest.mark.skipif(not native.load(), reason="CPU kernels could not be built here")


@pytest.mark.parametrize(("rows", "hidden"), [(1, 256), (16, 256), (300, 576), (3, 40)])
def test_rms_norm_matches_torch(rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, hidden, generator=g) * 3, torch.randn(hidden, generator=g)
    out = torch.empty_like(x)
    torch.ops.loragate.rms_norm(x, weight, 1e-5, out)
    torch.testing.assert_close(out, F.rms_norm(x, (hidden,), weight, 1e-5), rtol=2e-6, atol=2e-6)


def test_add_rms_norm_updates_the_residual_in_place() -> None:
    g = torch.Generator().manual_seed(0)
    residual, delta = torch.randn(16, 256, generator=g), torch.randn(16, 256, generator=g)
    weight = torch.randn(256, generator=g)
    expected_sum = residual + delta
    out = torch.empty_like(residual)
    torch.ops.loragate.add_rms_norm(residual, delta, weight, 1e-6, out)
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(
        out, F.rms_norm(expected_sum, (256,), weight, 1e-6), rtol=2e-6, atol=2e-6
    )


def test_shapes_and_dtypes_are_checked() -> None:
    x, weight = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="weight must be \\[hidden\\] in the input"):
        torch.ops.loragate.rms_norm(x, torch.randn(7), 1e-5, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 contiguous"):
        torch.ops.loragate.rms_norm(x.double(), weight, 1e-5, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 contiguous"):
        torch.ops.loragate.rms_norm(x.t(), torch.randn(4), 1e-5, torch.empty(8, 4))
    with pytest.raises(RuntimeError, match="shapes differ"):
        torch.ops.loragate.add_rms_norm(x, torch.randn(3, 8), weight, 1e-5, torch.empty_like(x))


def _hf_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm on bf16: float32 statistics, rounded, times the bf16 weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(torch.bfloat16)


@pytest.mark.parametrize(("rows", "hidden"), [(1, 256), (16, 576), (5, 40)])
def test_bfloat16_matches_hf_to_one_ulp(rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=g) * 3).bfloat16()
    weight = torch.randn(hidden, generator=g).bfloat16()
    out = torch.empty_like(x)
    torch.ops.loragate.rms_norm(x, weight, 1e-5, out)
    expected = _hf_bf16(x, weight, 1e-5)
    # Only the sum of squares' order differs: a rounding boundary may fall either side.
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=0)
    assert (out == expected).float().mean() > 0.97


def test_bfloat16_residual_add_rounds_as_torch() -> None:
    g = torch.Generator().manual_seed(1)
    residual = torch.randn(16, 576, generator=g).bfloat16()
    delta = torch.randn(16, 576, generator=g).bfloat16()
    weight = torch.randn(576, generator=g).bfloat16()
    expected_sum = residual + delta
    out = torch.empty_like(residual)
    torch.ops.loragate.add_rms_norm(residual, delta, weight, 1e-6, out)
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(
        out.float(), _hf_bf16(expected_sum, weight, 1e-6).float(), rtol=2**-7, atol=0
    )
