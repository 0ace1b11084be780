"""int8 linears (kernels/quant.py): the C++ halves against their torch specifications, the
smoothing that must leave the model's function unchanged, and an int8 engine end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
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
    not (native.load() and torch.ops.loragate.int8_mm_available()),
    reason="needs the C++ kernels built for a CPU with AVX-512 VNNI",
)


@needs_vnni
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])
@pytest.mark.parametrize(("outs", "ins"), [(16, 4), (80, 576), (960, 576), (3072, 576), (48, 1536)])
def test_packed_int8_gemm_equals_torch_int_mm(rows: int, outs: int, ins: int) -> None:
    """Integer sums are exact: the packed VNNI GEMM must be torch._int_mm bit for bit, extreme
    values (-128 and 127 activations, whose sign flip is the unsigned trick's edge) included."""
    g = torch.Generator().manual_seed(rows * outs + ins)
    x = torch.randint(-128, 128, (rows, ins), generator=g, dtype=torch.int8)
    x[0, : min(ins, 8)] = torch.tensor([-128, 127] * 4, dtype=torch.int8)[: min(ins, 8)]
    linear = quant.Int8Linear(nn.Linear(ins, outs, bias=False))
    linear.qweight = torch.randint(-127, 128, (outs, ins), generator=g, dtype=torch.int8)
    linear.pack_for_vnni()
    acc = torch.ops.loragate.int8_mm_packed(x, linear.packed, linear.col_sums)
    assert torch.equal(acc, torch._int_mm(x, linear.qweight.t()))
    assert torch.equal(acc, x.int() @ linear.qweight.int().t())


@needs_vnni
def test_int8_linear_takes_the_packed_gemm_for_decode_rows_only() -> None:
    torch.manual_seed(0)
    linear = quant.Int8Linear(nn.Linear(576, 960, bias=True))
    quant.use_native(nn.Sequential(linear), True)
    assert linear.packed is not None
    with torch.inference_mode():
        for rows in (16, quant.VNNI_MAX_ROWS + 1):
            x = torch.randn(rows, 576)
            packed = linear(x)
            linear.packed, saved = None, linear.packed
            plain = linear(x)
            linear.packed = saved
            assert torch.equal(packed, plain)
    quant.use_native(nn.Sequential(linear), False)
    assert linear.packed is None


@pytest.mark.parametrize("use_native", [False, True])
def test_an_int8_linear_approximates_the_linear(use_native: bool) -> None:
    if use_native and not native.load():
        pytest.skip("CPU kernels could not be built here")
    torch.manual_seed(0)
    linear = nn.Linear(576, 960, bias=True)
    int8 = quant.Int8Linear(linear)
    int8.native = use_native
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
    assert not isinstance(layer.mlp.down_proj, quant.Int8Linear)  # kept: see PROJECTIONS
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
def test_smollm2_perplexity_stays_close_to_bf16(smollm2_dir: Path) -> None:
    """The quality gate: within 2 % of bf16 (+0.4 % when int8 landed; +11 % unsmoothed)."""
    values = {}
    for method in (None, "int8"):
        llm = LLM(
            str(smollm2_dir),
            dtype="bfloat16",
            quantization=method,
            kv_cache_memory=128 << 20,
            max_model_len=1024,
        )
        ids = llm.tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
        values[method] = perplexity(llm, ids)
    assert math.isfinite(values["int8"])
    assert values["int8"] / values[None] - 1 < 0.02, values
