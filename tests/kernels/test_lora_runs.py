"""The C++ multi-LoRA op against kernels/lora.py's grouped specification."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from kernels.lora import LoRAGroup, add_lora

pytestmark = pytest.mark.skipif(not native.load(), reason="CPU kernels could not be built here")

# A fused target of three modules (q/k/v-like): output columns 0:64, 64:96, 96:128.
COLUMNS = [(0, 64), (64, 96), (96, 128)]


def _stacks(
    ranks: list[int], modules: list[list[int]], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Slot stacks as LoRAManager installs them (B zero outside each module's columns),
    the slots' widths and the flat segment list."""
    g = torch.Generator().manual_seed(0)
    slots, max_width, hidden = len(ranks), 3 * max(ranks), 96
    a = torch.zeros(slots, max_width, hidden, dtype=dtype)
    b = torch.zeros(slots, max_width, 128, dtype=dtype)
    widths, flat = [], []
    for slot, (rank, present) in enumerate(zip(ranks, modules, strict=True)):
        flat.append(len(present))
        for i, module in enumerate(present):
            rows = slice(i * rank, (i + 1) * rank)
            c0, c1 = COLUMNS[module]
            a[slot, rows] = torch.randn(rank, hidden, generator=g, dtype=dtype)
            b[slot, rows, c0:c1] = torch.randn(rank, c1 - c0, generator=g, dtype=dtype)
            flat += [i * rank, (i + 1) * rank, c0, c1]
        widths.append(len(present) * rank)
    return a, b, widths, flat


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_runs_match_the_grouped_specification(dtype: torch.dtype) -> None:
    a, b, widths, flat = _stacks([8, 4, 16, 2], [[0, 1, 2], [0, 2], [1], []], dtype)
    runs = [(0, 0, 5), (2, 5, 6), (1, 6, 20), (3, 20, 22), (0, 22, 23)]  # slot 3: nothing
    g = torch.Generator().manual_seed(1)
    x = torch.randn(25, 96, dtype=dtype, generator=g)
    base = torch.randn(25, 128, dtype=dtype, generator=g)
    expected = base.clone()
    add_lora(expected, x, a, b, [LoRAGroup(s, slice(i, j)) for s, i, j in runs], widths)
    got = base.clone()
    slots, starts, ends = (list(c) for c in zip(*runs, strict=True))
    torch.ops.loragate.add_lora_runs(got, x, a, b, slots, starts, ends, widths, flat)
    # Outputs reach ~100 here: float32 sums in another order differ by ~1e-7 of that scale.
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)
    assert torch.equal(got[23:], base[23:])  # rows in no run are untouched


def test_without_segments_the_whole_block_is_used() -> None:
    a, b, widths, _ = _stacks([8, 8], [[0, 1, 2], [1]])
    x, y = torch.randn(6, 96), torch.zeros(6, 128)
    expected = y.clone()
    add_lora(expected, x, a, b, [LoRAGroup(0, slice(0, 3)), LoRAGroup(1, slice(3, 6))], widths)
    torch.ops.loragate.add_lora_runs(y, x, a, b, [0, 1], [0, 3], [3, 6], widths, [])
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("slots", "starts", "ends", "segments", "message"),
    [
        ([2], [0], [3], [], "run out of range"),
        ([0], [2], [9], [], "run out of range"),
        ([0], [3], [3], [], "run out of range"),
        ([0], [0], [3], [1, 0, 99, 0, 10], "segment out of range"),
        ([0], [0], [3], [2, 0, 8, 0, 10], "segment list too short"),
    ],
)
def test_bad_runs_are_refused(
    slots: list[int], starts: list[int], ends: list[int], segments: list[int], message: str
) -> None:
    a, b, widths, _ = _stacks([8, 8], [[0], [1]])
    with pytest.raises(RuntimeError, match=message):
        torch.ops.loragate.add_lora_runs(
            torch.zeros(4, 128), torch.zeros(4, 96), a, b, slots, starts, ends, widths, segments
        )
