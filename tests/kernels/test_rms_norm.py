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
    with pytest.raises(RuntimeError, match="weight must be float32"):
        torch.ops.loragate.rms_norm(x, torch.randn(7), 1e-5, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="float32 contiguous"):
        torch.ops.loragate.rms_norm(x.double(), weight, 1e-5, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="float32 contiguous"):
        torch.ops.loragate.rms_norm(x.t(), torch.randn(4), 1e-5, torch.empty(8, 4))
    with pytest.raises(RuntimeError, match="shapes differ"):
        torch.ops.loragate.add_rms_norm(x, torch.randn(3, 8), weight, 1e-5, torch.empty_like(x))
