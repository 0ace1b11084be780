"""The triton multi-LoRA shrink/expand against the torch specification (`kernels.lora`),
over the engine's own slot stacks: fused q/k/v and gate/up, adapters of different ranks
and module sets, rows under no adapter, prefill segments and scattered decode tokens."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from triton_cases import DEVICE, TOLERANCE

from engine.lora.manager import LoRAConfig, LoRAManager
from engine.lora.types import (
    DOWN,
    GATE_UP,
    O_PROJ,
    QKV,
    LoRARequest,
    LoRAWeights,
    llama_fused_targets,
)
from kernels import dispatch
from kernels.lora import LoRAGroup, SlotRows, add_lora
from kernels.torch_backend import TorchKernels
from kernels.triton.lora_shrink_expand import add_lora as triton_add_lora
from kernels.triton.lora_shrink_expand import dense_layout, lora_batch
from kernels.triton_backend import TritonKernels, TritonLoRAStep

CONFIG = SimpleNamespace(
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64, intermediate_size=96
)
LAYERS = 2
# (rank, modules): rank 16 everywhere, rank 4 on q and v only, rank 8 on the MLP only.
ADAPTERS = [
    (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (4, ("q_proj", "v_proj")),
    (8, ("gate_proj", "up_proj", "down_proj")),
]


def weights(index: int) -> LoRAWeights:
    rank, modules = ADAPTERS[index]
    g = torch.Generator().manual_seed(index)
    sizes = {}
    for target in llama_fused_targets(CONFIG):
        for name, start, end in target.modules:
            sizes[name] = (target.in_features, end - start)
    layers = [
        {
            m: (
                torch.randn(rank, sizes[m][0], generator=g),
                torch.randn(sizes[m][1], rank, generator=g),
            )
            for m in modules
        }
        for _ in range(LAYERS)
    ]
    return LoRAWeights(f"adapter-{index}", rank, 0.5, layers)


def manager(dtype: torch.dtype, kernels: TorchKernels | TritonKernels) -> LoRAManager:
    m = LoRAManager(
        llama_fused_targets(CONFIG),
        LAYERS,
        LoRAConfig(max_loras=4, max_lora_rank=16, max_cpu_loras=4),
        loader=lambda request: weights(int(request.name)),
        kernels=kernels,
        dtype=dtype,
    )
    for i in range(len(ADAPTERS)):
        m.load_now(LoRARequest(str(i), "", f"adapter-{i}"))
    return m


# A decode step (scattered tokens of every adapter and the base), and a mixed one: decode
# tokens, then prefill segments of one adapter each, one of them long.
STEPS = {
    "decode": [0, -1, 2, 1, 1, 0, -1, 2, 0],
    "mixed": [1, -1, 0, *[2] * 21, *[-1] * 3, *[0] * 5, *[1] * 2],
    "all-base": [-1, -1],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", list(STEPS))
def test_every_fused_target_matches_the_specification(dtype: torch.dtype, step: str) -> None:
    slots = np.array(STEPS[step], dtype=np.int64)
    reference = manager(dtype, TorchKernels(torch.device("cpu")))
    mine = manager(dtype, TritonKernels(dispatch.triton_ops(DEVICE), DEVICE))
    # What the triton kernels must never read is poisoned: rows past a slot's width, and the
    # blocks of B outside each module's own columns (zero in the engine's fused stacks).
    for pool in [*mine.pool.pool_a, *mine.pool.pool_b]:
        pool.masked_fill_(pool == 0, float("nan"))
    ref_step, my_step = reference.step_context(slots), mine.step_context(slots)
    if step == "all-base":
        assert ref_step is None and my_step is None
        return
    assert ref_step is not None and isinstance(my_step, TritonLoRAStep)
    g = torch.Generator().manual_seed(len(slots))
    rtol, _ = TOLERANCE[dtype]
    for target in (QKV, O_PROJ, GATE_UP, DOWN):
        spec = llama_fused_targets(CONFIG)[target]
        x = torch.randn(len(slots), spec.in_features, generator=g).to(dtype)
        y = torch.randn(len(slots), spec.out_features, generator=g).to(dtype)
        expected = y.clone()
        ref_step.apply(1, target, x, expected)  # the torch path in the same dtype
        out = y.to(DEVICE)
        my_step.apply(1, target, x.to(DEVICE), out)
        # Rows under no adapter are untouched, bit for bit.
        base = torch.from_numpy(slots < 0)
        assert torch.equal(out.cpu()[base], y[base])
        # Both round the shrunk activations to the dtype; the error scales with the update.
        scale = float(expected.float().abs().max())
        torch.testing.assert_close(out.cpu(), expected, rtol=rtol, atol=rtol * scale)


def test_grouping_of_a_step() -> None:
    batch = lora_batch(torch.tensor([2, -1, 0, 2, 2, -1, 0]), torch.device("cpu"))
    assert batch is not None
    assert batch.order.tolist() == [2, 6, 0, 3, 4]
    assert batch.starts.tolist() == [0, 2, 5] and batch.slots.tolist() == [0, 2]
    assert batch.max_segment_len == 3 and batch.num_segments == 2
    assert lora_batch(torch.tensor([-1, -1]), torch.device("cpu")) is None


def test_widths_bound_what_is_read() -> None:
    """Rows past a slot's width are never read: garbage there changes nothing."""
    g = torch.Generator().manual_seed(0)
    # A pool of 32 rows: slot 0 at rows 16..20, slot 1 (width 0) at row 0.
    a, b = torch.randn(32, 32, generator=g), torch.randn(32, 48, generator=g)
    x, y = torch.randn(5, 32, generator=g), torch.zeros(5, 48)
    offsets, widths = [16, 0], [4, 0]
    expected = y.clone()
    groups = [LoRAGroup(0, slice(0, 3)), LoRAGroup(1, slice(3, 5))]
    add_lora(expected, x, a, b, groups, SlotRows(offsets, widths))
    batch = lora_batch(torch.tensor([0, 0, 0, 1, 1]), DEVICE)
    assert batch is not None
    out = y.to(DEVICE)
    a[:16] = b[:16] = a[20:] = b[20:] = float("nan")  # every row but slot 0's
    layout = dense_layout(offsets, widths, 48, DEVICE)
    triton_add_lora(out, x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), layout, batch)
    torch.testing.assert_close(out.cpu(), expected, rtol=2e-5, atol=2e-5)
    assert out[3:].eq(0).all()
