"""Multi-LoRA over a mixed batch: shrink (x @ A[slot].T) then expand (@ B[slot]) per token.

    lora_a[rows, in], lora_b[rows, out]   the pool (engine/lora/pool.py; B transposed, scaled)
    offsets[slots], widths[slots]: each slot's rows [offset, offset + width) (0: not adapted)

The step's adapted tokens are handed over grouped by slot (`LoRABatch`): `order` lists
their row indices slot by slot, segment s owning order[starts[s]:starts[s + 1]] under
slots[s]. A prefill's tokens are one contiguous segment; decode tokens of one adapter,
wherever they sit in the batch, are one segment too (the gather makes them so). Rows
under no adapter (slot -1) are in no segment and are never touched.

Both kernels run one program per (segment, tile of BLOCK_M tokens, ...); a grid sized
by the longest segment leaves programs past a shorter one's end to return at once.
shrink: ... x rank tile, looping over `in`, reading each slot's first `width` rows of A
only, so a rank-4 adapter reads rank-4 bytes. expand: ... x output
tile of BLOCK_N columns, reading for each column only the rows of B that can be non-zero
there. Fused q/k/v and gate/up pools hold module i of a rank-r slot at rows
[i*r, (i+1)*r) from the slot's first row, B zero outside that module's columns; a `SlotLayout`
lists each slot's (first row, end row, first column, end column) blocks, and an output
tile reads only the blocks whose columns it overlaps: a third of q/k/v's B, half of
gate/up's, rather than their zeros too.

Rounding follows the torch specification: the shrunk activations are rounded to the
model dtype before the expand, and the update is added to y in float32 then rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton._checks import check, check_float, check_index, next_pow2, same_device
from kernels.triton._tile import dot

# Modules packed into one fused target at most (q, k, v).
MAX_MODULES = 3


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """One fused target's slots, on the device: offsets [slots] int32 (a slot's first row of
    the pool), widths [slots] int32 (its rows), blocks [slots, MAX_MODULES, 4] int32 (row0,
    row1, col0, col1 relative to the first row; unused ones all zero)."""

    offsets: torch.Tensor
    widths: torch.Tensor
    blocks: torch.Tensor
    max_rank: int  # the largest row1 - row0: sizes the expand's rank tile
    max_width: int  # the largest width: sizes the shrink's output


def slot_layouts(
    offsets: list[list[int]],
    widths: list[list[int]],
    blocks: list[list[list[tuple[int, int, int, int]]]],
    max_rank: int,
    device: torch.device,
) -> list[SlotLayout]:
    """Layouts of every fused target (offsets, widths and blocks [target][slot]: the
    engine's LoRAPool.offsets, .widths and .segments) in one copy to the device."""
    targets, slots = len(widths), len(widths[0])
    host = torch.zeros(targets, slots * (2 + 4 * MAX_MODULES), dtype=torch.int32)
    host[:, :slots] = torch.tensor(offsets, dtype=torch.int32)
    host[:, slots : 2 * slots] = torch.tensor(widths, dtype=torch.int32)
    table = host[:, 2 * slots :].view(targets, slots, MAX_MODULES, 4)
    for t, per_slot in enumerate(blocks):
        for slot, entries in enumerate(per_slot):
            for j, entry in enumerate(entries):
                table[t, slot, j] = torch.tensor(entry, dtype=torch.int32)
    dev = host.to(device)
    return [
        SlotLayout(
            dev[t, :slots],
            dev[t, slots : 2 * slots],
            dev[t, 2 * slots :].view(slots, MAX_MODULES, 4),
            max_rank,
            max(1, max(widths[t])),
        )
        for t in range(targets)
    ]


def dense_layout(
    offsets: list[int], widths: list[int], out_features: int, device: torch.device
) -> SlotLayout:
    """A pool with one module per slot: B's `width` rows over every column."""
    blocks = [[[(0, w, 0, out_features)] if w else [] for w in widths]]
    return slot_layouts([offsets], [widths], blocks, max(widths), device)[0]


@dataclass(frozen=True, slots=True)
class LoRABatch:
    """A step's adapted tokens grouped by slot (device int32 tensors, host ints for grids)."""

    order: torch.Tensor  # [num_adapted] row indices, slot by slot
    starts: torch.Tensor  # [num_segments + 1] offsets into order
    slots: torch.Tensor  # [num_segments]
    num_segments: int
    max_segment_len: int


def lora_batch(token_slots: list[int] | torch.Tensor, device: torch.device) -> LoRABatch | None:
    """Group a step's per-token slots (-1: no adapter); None when no token is adapted."""
    slots_cpu = torch.as_tensor(token_slots, dtype=torch.int64, device="cpu")
    adapted = torch.nonzero(slots_cpu >= 0).flatten()
    if adapted.numel() == 0:
        return None
    by_slot = slots_cpu[adapted]
    order = adapted[torch.argsort(by_slot, stable=True)]
    seg_slots, counts = torch.unique_consecutive(slots_cpu[order], return_counts=True)
    n, segments = len(order), len(counts)
    # One host buffer, one copy: order, then segment starts, then segment slots.
    host = torch.empty(n + 2 * segments + 1, dtype=torch.int32)
    host[:n] = order
    host[n] = 0
    torch.cumsum(counts, 0, out=host[n + 1 : n + 1 + segments])
    host[n + 1 + segments :] = seg_slots
    dev = host.to(device)
    return LoRABatch(
        order=dev[:n],
        starts=dev[n : n + 1 + segments],
        slots=dev[n + 1 + segments :],
        num_segments=segments,
        max_segment_len=int(counts.max()),
    )


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _shrink_kernel(  # type: ignore[no-untyped-def]  # triton reads annotations
    x,
    lora_a,
    offsets,
    widths,
    order,
    starts,
    seg_slots,
    xa,
    stride_xt,
    stride_ar,
    stride_xa,
    in_features,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    r_tile = tl.program_id(2)
    seg_start = tl.load(starts + seg)
    seg_len = tl.load(starts + seg + 1) - seg_start
    slot = tl.load(seg_slots + seg).to(tl.int64)
    width = tl.load(widths + slot)
    first = tl.load(offsets + slot).to(tl.int64)
    if (tile * BLOCK_M >= seg_len) | (r_tile * BLOCK_R >= width):
        return
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < seg_len
    rows = tl.load(order + seg_start + m, mask=m_mask, other=0).to(tl.int64)
    r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < width
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        # Masked lanes must be 0, not garbage: 0 * NaN would poison the dot.
        xt = tl.load(
            x + rows[:, None] * stride_xt + k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        at = tl.load(
            lora_a + (first + r[None, :]) * stride_ar + k[:, None],
            mask=k_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        acc += dot(xt, at, UPCAST)
    tl.store(
        xa + (seg_start + m)[:, None] * stride_xa + r[None, :],
        acc.to(xa.dtype.element_ty),
        mask=m_mask[:, None] & r_mask[None, :],
    )


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _expand_kernel(  # type: ignore[no-untyped-def]  # triton reads annotations
    xa,
    lora_b,
    offsets,
    widths,
    blocks,
    order,
    starts,
    seg_slots,
    y,
    stride_xa,
    stride_br,
    stride_yt,
    out_features,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RANK_PAD: tl.constexpr,
    MODULES: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    n_tile = tl.program_id(2)
    seg_start = tl.load(starts + seg)
    seg_len = tl.load(starts + seg + 1) - seg_start
    slot = tl.load(seg_slots + seg).to(tl.int64)
    width = tl.load(widths + slot)
    first = tl.load(offsets + slot).to(tl.int64)
    if (tile * BLOCK_M >= seg_len) | (width == 0):
        return
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < seg_len
    rows = tl.load(order + seg_start + m, mask=m_mask, other=0).to(tl.int64)
    n_lo = n_tile * BLOCK_N
    n = n_lo + tl.arange(0, BLOCK_N)
    n_mask = n < out_features
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for j in tl.static_range(MODULES):
        entry = blocks + (slot * MODULES + j) * 4
        r0 = tl.load(entry)
        r1 = tl.load(entry + 1)
        c0 = tl.load(entry + 2)
        c1 = tl.load(entry + 3)
        # Only a block whose columns meet this tile's: the rest of B is zero here.
        if (r1 > r0) & (c0 < n_lo + BLOCK_N) & (c1 > n_lo):
            r = r0 + tl.arange(0, RANK_PAD)
            r_mask = r < r1
            a = tl.load(
                xa + (seg_start + m)[:, None] * stride_xa + r[None, :],
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            cols = n_mask & (n >= c0) & (n < c1)
            b = tl.load(
                lora_b + (first + r[:, None]) * stride_br + n[None, :],
                mask=r_mask[:, None] & cols[None, :],
                other=0.0,
            )
            acc += dot(a, b, UPCAST)
    y_ptrs = y + rows[:, None] * stride_yt + n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    old = tl.load(y_ptrs, mask=mask)
    tl.store(y_ptrs, (old.to(tl.float32) + acc).to(y.dtype.element_ty), mask=mask)


def _check_pool(name: str, pool: torch.Tensor, layout: SlotLayout) -> None:
    check(pool.dim() == 2, f"{name} must be [rows, features]")
    check_float(name, pool)
    check(pool.stride(1) == 1, f"{name} must be contiguous in its features")
    for what in ("offsets", "widths"):
        index = getattr(layout, what)
        check_index(what, index, 1)
        check(index.dtype == torch.int32, f"{what} must be int32")
    check(layout.offsets.shape == layout.widths.shape, "one offset and one width per slot")


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, layout: SlotLayout, batch: LoRABatch
) -> torch.Tensor:
    """xa[j, :w] = x[order[j]] @ A(slot(j)).T, in x's dtype: [num_adapted, max_width], in
    `order`'s order; columns past a slot's width are left unwritten (expand never reads them)."""
    check(x.dim() == 2 and x.stride(1) == 1, "x must be [tokens, in], contiguous in `in`")
    _check_pool("lora_a", lora_a, layout)
    check(
        lora_a.shape[1] == x.shape[1],
        f"lora_a takes {lora_a.shape[1]} features, x has {x.shape[1]}",
    )
    check(lora_a.dtype == x.dtype, f"lora_a is {lora_a.dtype}, x {x.dtype}")
    same_device(x, lora_a, layout.offsets, layout.widths, batch.order)
    max_width = layout.max_width
    xa = torch.empty(batch.order.shape[0], max_width, dtype=x.dtype, device=x.device)
    on_gpu = x.device.type == "cuda"
    block_m, block_r, block_k = 16, 16, 128 if on_gpu else 32
    grid = (batch.num_segments, -(-batch.max_segment_len // block_m), -(-max_width // block_r))
    _shrink_kernel[grid](
        x,
        lora_a,
        layout.offsets,
        layout.widths,
        batch.order,
        batch.starts,
        batch.slots,
        xa,
        x.stride(0),
        lora_a.stride(0),
        xa.stride(0),
        x.shape[1],
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        UPCAST=not on_gpu,
    )
    return xa


def lora_expand(
    y: torch.Tensor, xa: torch.Tensor, lora_b: torch.Tensor, layout: SlotLayout, batch: LoRABatch
) -> None:
    """y[order[j]] += xa[j, :w] @ B(slot(j)), in place (each slot's blocks only)."""
    check(y.dim() == 2 and y.stride(1) == 1, "y must be [tokens, out], contiguous in `out`")
    _check_pool("lora_b", lora_b, layout)
    check(
        layout.blocks.shape == (layout.widths.shape[0], MAX_MODULES, 4)
        and layout.blocks.dtype == torch.int32
        and layout.blocks.is_contiguous(),
        f"layout blocks must be [slots, {MAX_MODULES}, 4] int32, contiguous",
    )
    check(
        lora_b.shape[1] == y.shape[1],
        f"lora_b gives {lora_b.shape[1]} features, y has {y.shape[1]}",
    )
    check(lora_b.dtype == y.dtype == xa.dtype, "y, xa and lora_b must share a dtype")
    check(xa.shape == (batch.order.shape[0], layout.max_width), "xa must be lora_shrink's output")
    same_device(y, xa, lora_b, layout.offsets, layout.widths, layout.blocks, batch.order)
    out_features = y.shape[1]
    on_gpu = y.device.type == "cuda"
    block_m, block_n = 16, 128 if on_gpu else 64
    grid = (
        batch.num_segments,
        -(-batch.max_segment_len // block_m),
        -(-out_features // block_n),
    )
    _expand_kernel[grid](
        xa,
        lora_b,
        layout.offsets,
        layout.widths,
        layout.blocks,
        batch.order,
        batch.starts,
        batch.slots,
        y,
        xa.stride(0),
        lora_b.stride(0),
        y.stride(0),
        out_features,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        RANK_PAD=max(16, next_pow2(layout.max_rank)),
        MODULES=MAX_MODULES,
        UPCAST=not on_gpu,
    )


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    layout: SlotLayout,
    batch: LoRABatch,
) -> None:
    """y += each adapted token's own adapter update (`kernels.lora.add_lora`'s contract)."""
    lora_expand(y, lora_shrink(x, lora_a, layout, batch), lora_b, layout, batch)
