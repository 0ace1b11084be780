"""The C++ multi-LoRA op (`add_lora_sgmv`) against kernels/lora.py's specification: a pool
of adapters at mixed ranks and module sets, runs short enough for the vectorized loops and
long enough for the GEMM path, many slots in one call, rows under no adapter."""

from __future__ import annotations

import pytest
import torch

from engine.lora.pool import SEGMENTS, TABLE_COLUMNS
from kernels import native
from kernels.lora import LoRAGroup, SlotRows, add_lora

pytestmark = pytest.mark.skipif(not native.load(), reason="CPU kernels could not be built here")

# A fused target of three modules (q/k/v-like): output columns 0:64, 64:96, 96:200 (the last
# one not a multiple of the 64-column tile).
COLUMNS = [(0, 64), (64, 96), (96, 200)]
IN, OUT = 96, 200


def pool(
    ranks: list[int], modules: list[list[int]], dtype: torch.dtype, gap: int = 5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
    """A pool as engine/lora/pool.py lays it out (slots at scattered offsets, B zero outside
    each module's columns, NaN in every row no slot owns), its C++ table, offsets, widths."""
    g = torch.Generator().manual_seed(0)
    rows = sum(3 * r + gap for r in ranks) + gap
    a = torch.full((rows, IN), float("nan"), dtype=dtype)
    b = torch.full((rows, OUT), float("nan"), dtype=dtype)
    table = torch.zeros(len(ranks), TABLE_COLUMNS, dtype=torch.int64)
    offsets, widths = [], []
    first = gap
    for slot, (rank, present) in enumerate(zip(ranks, modules, strict=True)):
        width = len(present) * rank
        b[first : first + width] = 0
        entry = [first, width]
        for i, module in enumerate(present):
            k = slice(first + i * rank, first + (i + 1) * rank)
            c0, c1 = COLUMNS[module]
            a[k] = torch.randn(rank, IN, generator=g).to(dtype)
            b[k, c0:c1] = torch.randn(rank, c1 - c0, generator=g).to(dtype)
            entry += [i * rank, (i + 1) * rank, c0, c1]
        table[slot, : len(entry)] = torch.tensor(entry)
        offsets.append(first)
        widths.append(width)
        first += 3 * rank + gap
    return a, b, table, offsets, widths


def reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    runs: list[tuple[int, int, int]],
    offsets: list[int],
    widths: list[int],
) -> torch.Tensor:
    """The specification, on a pool whose NaN rows (read by nobody) are zeroed for torch."""
    expected = y.clone()
    clean_a, clean_b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    groups = [LoRAGroup(s, slice(i, j)) for s, i, j in runs]
    add_lora(expected, x, clean_a, clean_b, groups, SlotRows(offsets, widths))
    return expected


# Runs of 1-2 rows (decode: the loops), 11 (the longest loop run), 12 and 40 (GEMMs).
RUNS = [(0, 0, 1), (2, 1, 3), (1, 3, 14), (3, 14, 16), (4, 18, 30), (0, 30, 70), (5, 70, 71)]


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request: pytest.FixtureRequest):
    """Runs one after another, or taken by two workers as they finish (oneDNN inside)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_runs_match_the_specification_at_mixed_ranks(dtype: torch.dtype, threads: int) -> None:
    ranks = [8, 4, 16, 2, 64, 32]
    modules = [[0, 1, 2], [0, 2], [1], [], [0, 1, 2], [2]]  # slot 3 adapts nothing here
    a, b, table, offsets, widths = pool(ranks, modules, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(73, IN, generator=g).to(dtype)
    base = torch.randn(73, OUT, generator=g).to(dtype)
    expected = reference(base, x, a, b, RUNS, offsets, widths)
    got = base.clone()
    with torch.inference_mode():  # as the engine calls it: y an inference tensor
        got = got.clone()
        torch.ops.loragate.add_lora_sgmv(got, x, a, b, torch.tensor(RUNS), table)
    # Both round the shrunk activations to the dtype; sums in another order differ by a few
    # units in the last place of the update's scale.
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}[dtype]
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * scale)
    assert torch.equal(got[16:18], base[16:18]) and torch.equal(got[71:], base[71:])


def test_many_slots_in_one_call(threads: int) -> None:
    """Sixty adapters, a decode row each and a prompt run for some: one call, each row its own
    adapter's update (Punica's BGMV/SGMV case: cost by rows and ranks, not by slots)."""
    ranks = [(8, 16, 32, 64)[i % 4] for i in range(60)]
    modules = [[0, 1, 2] if i % 3 else [0, 2] for i in range(60)]
    a, b, table, offsets, widths = pool(ranks, modules, torch.float32, gap=1)
    runs = [(s, s, s + 1) for s in range(60)] + [(7, 60, 90), (33, 90, 93)]
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(93, IN, generator=g), torch.randn(93, OUT, generator=g)
    expected = reference(y, x, a, b, runs, offsets, widths)
    torch.ops.loragate.add_lora_sgmv(y, x, a, b, torch.tensor(runs), table)
    scale = float(expected.abs().max())
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * scale)


def test_short_runs_read_only_each_modules_block_of_b() -> None:
    """Decode rows (the loops) read B only inside each module's columns: NaN outside them
    stays unread. (Prompt runs expand over every column, B being zero there in the pool.)"""
    a, b, table, _, _ = pool([8], [[1]], torch.float32)
    b[b == 0] = float("nan")  # B's other modules' columns
    x, y = torch.randn(20, IN), torch.zeros(20, OUT)
    torch.ops.loragate.add_lora_sgmv(y, x, a, b, torch.tensor([(0, 0, 3), (0, 4, 15)]), table)
    assert not y.isnan().any()
    assert y[:, :64].eq(0).all() and y[:, 96:].eq(0).all() and y[3].eq(0).all()


def _bad_table(column: int, value: int) -> torch.Tensor:
    table = torch.tensor([[10, 8, 0, 8, 0, 64] + [0] * (4 * (SEGMENTS - 1))])
    table[0, column] = value
    return table


@pytest.mark.parametrize(
    ("runs", "table", "message"),
    [
        ([(1, 0, 3)], _bad_table(0, 10), "run out of range"),
        ([(0, 2, 9)], _bad_table(0, 10), "run out of range"),
        ([(0, 3, 3)], _bad_table(0, 10), "run out of range"),
        ([(0, 0, 3)], _bad_table(0, 30), "slot rows out of the pool"),
        ([(0, 0, 3)], _bad_table(3, 9), "segment out of range"),
        ([(0, 0, 3)], _bad_table(5, OUT + 1), "segment out of range"),
    ],
)
def test_bad_runs_and_tables_are_refused_before_anything_is_written(
    runs: list[tuple[int, int, int]], table: torch.Tensor, message: str
) -> None:
    a, b = torch.zeros(32, IN), torch.zeros(32, OUT)
    y = torch.zeros(4, OUT)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.loragate.add_lora_sgmv(y, torch.zeros(4, IN), a, b, torch.tensor(runs), table)
    assert y.eq(0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_runs_in_pieces_match_the_specification(dtype: torch.dtype, threads: int) -> None:
    """Prompt runs (bfloat16 on AMX tiles where the CPU has them, cut in pieces the threads
    share): hundreds of rows, a last piece and a last block of 32 rows that are short, widths
    of 24 to 192 rows of the pool (one tile pass to six), a run that ends at x's last row, and
    output columns that are not a multiple of the tiles' 32."""
    ranks = [8, 64, 32, 16]
    modules = [[0, 1, 2], [0, 1, 2], [1, 2], [0]]
    a, b, table, offsets, widths = pool(ranks, modules, dtype)
    runs = [(1, 0, 300), (0, 300, 317), (3, 317, 320), (2, 320, 461)]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(461, IN, generator=g).to(dtype)
    base = torch.randn(461, OUT, generator=g).to(dtype)
    expected = reference(base, x, a, b, runs, offsets, widths)
    got = base.clone()
    torch.ops.loragate.add_lora_sgmv(got, x, a, b, torch.tensor(runs), table)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * scale)
