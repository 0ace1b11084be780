"""int8 linears (kernels/quant.py): the C++ halves against their torch specifications, the
smoothing that must leave the model's function unchanged, and an int8 engine end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench.quantization import TEXT, perplexity
from engine import LLM, EngineConfig, SamplingParams
from kernels import native, quant

needs_native = pytest.mark.skipif(not native.load(), reason="CPU kernels could not be built here")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (16, 1536), (37, 581), (3, 5)])
def test_quantize_rows_matches_torch_exactly(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    x[0, 0] = 100.0  # an outlier sets its row's scale
    q, scales = torch.ops.loragate.quantize_rows(x)
    q_ref, scales_ref = quant.quantize_rows(x)
    assert q.dtype == torch.int8 and torch.equal(q, q_ref) and torch.equal(scales, scales_ref)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_dequantize_mm_matches_torch(dtype: torch.dtype, bias: bool) -> None:
    g = torch.Generator().manual_seed(1)
    acc = torch.randint(-(2**20), 2**20, (9, 100), generator=g, dtype=torch.int32)
    rows, cols = torch.rand(9, generator=g), torch.rand(100, generator=g)
    b = torch.randn(100, generator=g) if bias else None
    out, ref = torch.empty(9, 100, dtype=dtype), torch.empty(9, 100, dtype=dtype)
    torch.ops.loragate.dequantize_mm(acc, rows, cols, b, out)
    quant.dequantize_mm(acc, rows, cols, b, ref)
    torch.testing.assert_close(
        out.float(), ref.float(), rtol=2**-7 if dtype != torch.float32 else 1e-6, atol=0
    )


needs_vnni = pytest.mark.skipif(
    not (native.load() and torch.ops.loragate.int8_linear_available()),
    reason="needs the C++ kernels built for a CPU with AVX-512 VNNI",
)


def _int8_linear(outs: int, ins: int, group: int, bias: bool, seed: int) -> quant.Int8Linear:
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(ins, outs, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(outs, ins, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(outs, generator=g))
    int8 = quant.Int8Linear(linear, group)
    int8.native = True
    int8.pack_for_vnni()
    return int8


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 64, 100])
@pytest.mark.parametrize(
    ("outs", "ins", "group"),
    [
        (16, 16, 16),
        (80, 576, 576),
        (960, 576, 576),
        (48, 1536, 128),
        (576, 1536, 128),
        (32, 64, 16),
    ],
)
def test_int8_linear_matches_its_specification(
    dtype: torch.dtype, rows: int, outs: int, ins: int, group: int
) -> None:
    """The fused C++ linear (quantize, VNNI GEMM over the packed weight, scale back) against
    int8_linear_reference: column counts that leave a partial tile (80 = 5 blocks of 16, 48),
    row counts around the 6-row tile, groups from 16 to a whole row, outliers that set a
    group's scale, and a bias."""
    int8 = _int8_linear(outs, ins, group, bias=outs % 3 == 0, seed=rows * outs + ins)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, ins, generator=g) * 2
    x[:, 0] = 40.0  # the first group of every row gets an outlier
    x[-1, -1] = -40.0
    x = x.to(dtype)
    with torch.inference_mode():
        y = torch.ops.loragate.int8_linear(
            x, int8.packed, int8.col_sums, int8.scales, int8.bias, group
        )
        ref = quant.int8_linear_reference(x, int8.qweight, int8.scales, int8.bias, group)
    assert y.dtype == dtype and y.shape == (rows, outs)
    # The same integer sums and float32 steps; only a fused multiply-add may round differently,
    # which bf16's final rounding can turn into one unit in its last place.
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-2}
    torch.testing.assert_close(y.float(), ref.float(), **tol)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("group", [128, 1536])
def test_the_gated_linear_is_the_linear_of_silu_gate_times_up(
    dtype: torch.dtype, rows: int, group: int
) -> None:
    """down_proj's fused input: silu(gate) * up computed while quantizing, rounded as torch's
    two ops round it. Only our exp's last float bits (within 2 ulp of expf, and compiled for
    this processor) may move a bf16 rounding, and so, rarely, one quantization step of one
    input."""
    int8 = _int8_linear(576, 1536, group, bias=False, seed=rows)
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 3).to(dtype)
    gate_up[0, 0] = -100.0  # silu's e^100 overflows: a signed 0, as torch's
    gate, up = gate_up.split(1536, dim=-1)
    with torch.inference_mode():
        fused = int8.forward_gated(gate_up)
        unfused = int8(F.silu(gate) * up)
    assert fused.dtype == dtype and fused.shape == (rows, 576)
    # Where an input does land on the other side of a rounding, the output moves by at most one
    # quantization step of that input times the largest weight it meets.
    h = (F.silu(gate.float()) * up.float()).view(rows, -1, group)
    step = h.abs().amax(dim=2).amax(dim=1) / 127
    weights = (int8.qweight.float().view(576, -1, group) * int8.scales.t()[:, :, None]).abs()
    bound = 2e-2 + 2**-7 * unfused.float().abs() + step[:, None] * weights.amax()
    assert ((fused.float() - unfused.float()).abs() <= bound).all()
    with pytest.raises(RuntimeError, match="twice the weight's"):
        torch.ops.loragate.int8_linear(
            gate.contiguous(), int8.packed, int8.col_sums, int8.scales, None, group, True
        )


def test_the_gated_linear_without_the_cpp_kernel_is_torch_then_the_linear() -> None:
    int8 = quant.Int8Linear(nn.Linear(256, 64), 128)
    gate_up = torch.randn(5, 512)
    gate, up = gate_up.split(256, dim=-1)
    with torch.inference_mode():
        assert torch.equal(int8.forward_gated(gate_up), int8(F.silu(gate) * up))


@needs_vnni
def test_int8_linear_refuses_what_it_cannot_compute() -> None:
    int8 = _int8_linear(32, 64, 16, bias=False, seed=0)
    op = torch.ops.loragate.int8_linear
    with pytest.raises(RuntimeError, match="width"):
        op(torch.randn(2, 48), int8.packed, int8.col_sums, int8.scales, None, 16)
    with pytest.raises(RuntimeError, match="group"):
        op(torch.randn(2, 64), int8.packed, int8.col_sums, int8.scales, None, 24)
    with pytest.raises(RuntimeError, match="column sums"):
        op(torch.randn(2, 64), int8.packed, int8.col_sums, int8.scales, None, 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.randn(2, 64).half(), int8.packed, int8.col_sums, int8.scales, None, 16)
    empty = op(torch.randn(0, 64), int8.packed, int8.col_sums, int8.scales, None, 16)
    assert empty.shape == (0, 32)


def test_every_projection_is_quantized_in_groups_where_they_divide_its_width() -> None:
    mlp = nn.Module()
    mlp.gate_up_proj, mlp.down_proj = nn.Linear(576, 3072), nn.Linear(1536, 576)
    odd = nn.Module()
    odd.down_proj = nn.Linear(200, 64)  # 64 does not divide 200: per channel and token
    root = nn.Sequential(mlp, odd)
    assert quant.quantize(root) == 3
    assert mlp.gate_up_proj.group == mlp.down_proj.group == quant.GROUP
    assert mlp.down_proj.scales.shape == (1536 // quant.GROUP, 576)
    assert odd.down_proj.group == 200 and odd.down_proj.scales.shape == (1, 64)


def test_weights_are_quantized_in_the_activations_groups() -> None:
    """A group of small weights keeps its own scale: a large weight elsewhere in the row does
    not flatten it to zero, as one scale per output row would."""
    linear = nn.Linear(128, 16, bias=False)
    with torch.no_grad():
        linear.weight.fill_(0.01)
        linear.weight[:, 64:] = 10.0
    int8 = quant.Int8Linear(linear, 64)
    assert torch.equal(int8.qweight, torch.full((16, 128), 127, dtype=torch.int8))
    expected_scales = torch.tensor([[0.01 / 127], [10.0 / 127]]).expand(2, 16)
    torch.testing.assert_close(int8.scales, expected_scales)
    x = torch.ones(1, 128)
    torch.testing.assert_close(int8(x), linear(x), rtol=1e-5, atol=0)


@needs_vnni
def test_use_native_packs_the_weights_it_can_and_drops_them_when_disabled() -> None:
    fits, odd = quant.Int8Linear(nn.Linear(576, 960)), quant.Int8Linear(nn.Linear(20, 960))
    root = nn.Sequential(fits, odd)
    quant.use_native(root, True)
    assert fits.packed is not None and fits.col_sums is not None and fits.native
    assert odd.packed is None and odd.native  # 20 inputs: not a multiple of 16
    with torch.inference_mode():
        x = torch.randn(3, 20)
        torch.testing.assert_close(
            odd(x), quant.int8_linear_reference(x, odd.qweight, odd.scales, odd.bias, 20)
        )
    quant.use_native(root, False)
    assert fits.packed is None and not fits.native


@pytest.mark.parametrize("use_native", [False, True])
@pytest.mark.parametrize("group", [None, 64])
def test_an_int8_linear_approximates_the_linear(use_native: bool, group: int | None) -> None:
    if use_native and not native.load():
        pytest.skip("CPU kernels could not be built here")
    torch.manual_seed(0)
    linear = nn.Linear(576, 960, bias=True)
    int8 = quant.Int8Linear(linear, group)
    quant.use_native(nn.Sequential(int8), use_native)
    x = torch.randn(2, 8, 576)
    with torch.inference_mode():
        y, ref = int8(x), linear(x)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    # Two roundings to 8 bits: within a couple of percent of the output's scale.
    assert (y - ref).norm() / ref.norm() < 0.02


def _hidden(llm: LLM, ids: list[int]) -> torch.Tensor:
    return llm.engine.runner.forward_prompt(ids).float()


def test_smoothing_leaves_the_function_unchanged(demo_model_dir: Path) -> None:
    llm = LLM(str(demo_model_dir), kv_cache_memory=16 << 20, dtype="float32", cpu_kernels=False)
    runner = llm.engine.runner
    ids = list(range(100, 180))
    before = _hidden(llm, ids)
    ranges = quant.activation_ranges(runner.model, runner.forward_prompt, [ids, ids[:20]])
    assert set(ranges) == {
        f"layers.{i}.{part}"
        for i in range(runner.num_layers)
        for part in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj")
    }
    quant.smooth(runner.model, ranges)
    torch.testing.assert_close(_hidden(llm, ids), before, rtol=1e-4, atol=1e-4)


def test_an_int8_engine_generates_and_frees_every_block(demo_model_dir: Path) -> None:
    reference = LLM(str(demo_model_dir), kv_cache_memory=16 << 20, dtype="float32")
    llm = LLM(str(demo_model_dir), kv_cache_memory=16 << 20, dtype="float32", quantization="int8")
    layer = llm.engine.runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, quant.Int8Linear)
    assert isinstance(layer.mlp.down_proj, quant.Int8Linear)
    assert layer.mlp.down_proj.group == quant.GROUP
    ids = list(range(300, 364))
    similarity = torch.cosine_similarity(_hidden(llm, ids), _hidden(reference, ids), dim=-1)
    assert similarity.min() > 0.95
    outs = llm.generate(
        [ids, [5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_only_int8_is_accepted() -> None:
    with pytest.raises(ValueError, match="quantization must be int8"):
        EngineConfig(model="m", quantization="int4")


@pytest.mark.smollm2
def test_smollm2_perplexity_stays_close_to_float32(smollm2_dir: Path) -> None:
    """The quality gate, against float32: the one reference every processor computes alike to
    within rounding (bf16's GEMMs round as the processor's kernels round: AMX, AVX-512 BF16 or
    emulated). Measured over bench/data/perplexity.txt (4,851 tokens), on an AMD EPYC with
    AVX-512 BF16 and VNNI: bf16 +0.03 %, int8 +0.80 % (+0.52 % computing in float32). The
    text's first 1,212 tokens alone, the former gate, moved int8 by 1.5 % with rounding-level
    changes (+1.75 % here, +3.25 % on an Intel Xeon with AMX, with the earlier scheme)."""
    values = {}
    for dtype, method in (("float32", None), ("bfloat16", None), ("bfloat16", "int8")):
        llm = LLM(
            str(smollm2_dir),
            dtype=dtype,
            quantization=method,
            kv_cache_memory=128 << 20,
            max_model_len=1024,
        )
        ids = llm.tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
        values[method or dtype] = perplexity(llm, ids)
        del llm
    assert all(math.isfinite(v) for v in values.values()), values
    assert values["bfloat16"] / values["float32"] - 1 < 0.01, values
    assert values["int8"] / values["float32"] - 1 < 0.02, values
