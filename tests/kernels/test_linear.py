"""Prepacked linears (oneDNN's layout and our panels) against nn.Linear, the choice between
them, and the swap inside a model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_features, linear, native

needs_onednn = pytest.mark.skipif(not linear.available(), reason="no oneDNN in this torch build")
needs_kernels = pytest.mark.skipif(not native.load(), reason="CPU kernels not built")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_matches_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    plain = nn.Linear(256, 384, bias=bias)
    packed = linear.OneDNNLinear.reorder(plain)
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 16, 131, 300])
@pytest.mark.parametrize(("inputs", "outputs"), [(256, 384), (250, 1000), (64, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_panels_match_linear(rows: int, inputs: int, outputs: int, bias: bool) -> None:
    """Every tail the kernel has: rows not a multiple of six (and past its 128-row block),
    outputs not a multiple of a 16-column panel (1,000 = 62 panels + 8), fewer outputs than
    one panel."""
    torch.manual_seed(rows * 7 + outputs)
    plain = nn.Linear(inputs, outputs, bias=bias)
    packed = linear.PanelLinear.reorder(plain)
    assert packed.packed.shape == (-(-outputs // 16), inputs, 16)
    x = torch.randn(rows, inputs)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_panels_keep_leading_dimensions_and_read_strided_input() -> None:
    plain = nn.Linear(32, 48)
    packed = linear.PanelLinear.reorder(plain)
    x = torch.randn(3, 5, 64)[..., ::2]  # not contiguous
    with torch.inference_mode():
        out = packed(x)
        assert out.shape == (3, 5, 48)
        torch.testing.assert_close(out, plain(x), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_panels_refuse_mismatched_shapes() -> None:
    packed = linear.PanelLinear.reorder(nn.Linear(32, 48))
    with pytest.raises(RuntimeError, match="in_features"):
        packed(torch.randn(2, 31))
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.loragate.panel_linear(torch.randn(2, 32), packed.packed, None, 64)


@needs_kernels
def test_panels_round_trip_through_bytes() -> None:
    """What the weights cache writes and maps back (engine/checkpoints/weights_cache.py)."""
    plain = nn.Linear(40, 20, bias=False)
    packed = linear.PanelLinear.reorder(plain)
    data, descriptor = packed.to_bytes()
    assert descriptor is None
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    again = linear.PanelLinear(
        linear.PanelLinear.from_bytes(raw, (20, 40), torch.float32, None), None, (20, 40)
    )
    x = torch.randn(3, 40)
    with torch.inference_mode():
        torch.testing.assert_close(again(x), plain(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="panels"):
        linear.PanelLinear.from_bytes(raw[:-4], (20, 40), torch.float32, None)


@needs_kernels
@pytest.mark.parametrize("rows", [0, 1, 6, 7, 16, 131])
@pytest.mark.parametrize(("inputs", "units"), [(256, 512), (33, 24), (40, 8)])
def test_gate_up_panels_give_gate_up_and_its_activation(rows: int, inputs: int, units: int) -> None:
    """[gate | up] in order, for a LoRA to add to, and silu(gate) * up in one pass, each
    against nn.Linear and torch's silu."""
    torch.manual_seed(rows + units)
    plain = nn.Linear(inputs, 2 * units, bias=False)
    packed = linear.GateUpPanelLinear.reorder(plain)
    assert isinstance(packed, linear.GateUpPanelLinear)
    x = torch.randn(rows, inputs)
    with torch.inference_mode():
        expected = plain(x)
        torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)
        gate, up = expected.split(units, dim=-1)
        silu_mul = packed.silu_mul(x)
        assert silu_mul.shape == (rows, units)
        torch.testing.assert_close(silu_mul, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_gate_up_panels_fall_back_to_panels_where_they_cannot_pair() -> None:
    """A bias, or outputs not two multiples of eight: plain panels, [gate | up] all the same."""
    for plain in (nn.Linear(16, 32, bias=True), nn.Linear(16, 20, bias=False)):
        packed = linear.GateUpPanelLinear.reorder(plain)
        assert type(packed) is linear.PanelLinear
        x = torch.randn(3, 16)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.skipif(not linear.native_bf16(), reason="no bf16 dot products on this CPU")
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_onednn_bfloat16_matches_linear(rows: int) -> None:
    """oneDNN accumulates in float32 and rounds once, as torch's bf16 GEMM does; only the
    summation order differs, so results agree to a bf16 rounding step."""
    torch.manual_seed(rows)
    plain = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    packed = linear.OneDNNLinear.reorder(plain)
    x = torch.randn(rows, 576).bfloat16()
    with torch.inference_mode():
        ours, theirs = packed(x), plain(x)
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2**-7, atol=2e-2)


def test_packer_follows_the_build() -> None:
    """Panels for float32 exactly where the kernels were built for AVX2 without AVX-512;
    bfloat16 never (oneDNN's where it is native, else none)."""
    panels = native.load() and bool(torch.ops.loragate.panel_linear_preferred())
    if native.load():
        # The build's flags decide, and a processor held to AVX2 builds without AVX-512.
        wide = any(f.startswith("avx512") for f in cpu_features.flags())
        assert panels == ({"avx2", "fma"} <= cpu_features.flags() and not wide)
    expected = linear.PanelLinear if panels else linear.OneDNNLinear
    assert linear.packer(torch.float32) is (expected if panels or linear.available() else None)
    bf16 = linear.packer(torch.bfloat16)
    assert bf16 is (linear.OneDNNLinear if linear.native_bf16() else None)
    assert linear.packer(torch.float16) is None


@needs_onednn
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
        assert isinstance(model["head"], linear.packer(torch.float32) or type(None))
        # bf16 only where the CPU computes it natively; float16 never (emulated on CPUs)
        assert isinstance(model["bf16"], linear.OneDNNLinear if bf16 else nn.Linear)
        assert isinstance(model["fp16"], nn.Linear)
        assert model["embed"].weight.shape == (50, 16)
        torch.testing.assert_close(model["head"](model["block"](x)), expected)


@needs_kernels
def test_prepack_packs_a_fused_gate_up_projection_as_gate_up_panels() -> None:
    mlp = nn.ModuleDict(
        {"gate_up_proj": nn.Linear(16, 64, bias=False), "down_proj": nn.Linear(32, 16)}
    )
    assert linear.prepack(mlp) == 2
    panels = linear.packer(torch.float32) is linear.PanelLinear
    gate_up = linear.GateUpPanelLinear if panels else linear.OneDNNLinear
    assert type(mlp["gate_up_proj"]) is gate_up
    assert type(mlp["down_proj"]) is (linear.PanelLinear if panels else linear.OneDNNLinear)
