"""Where resident LoRA adapters' weights live: one pool of rows per fused linear, sized in
bytes, each adapter taking rows for its own rank (S-LoRA's unified memory pool, with
contiguous ranges instead of pages so that a prompt run is one GEMM).

The pool counts in rank units. An adapter of rank r takes r consecutive units; unit u of
fused target t is rows [u * m, (u + 1) * m) of that target's pools, m being the modules the
target fuses (3 for q/k/v). Within its range an adapter packs the modules it adapts in the
target's order, module i at rows [i * r, (i + 1) * r) from its first row:

    units   |  adapter X (r=8)  |   free    |    adapter Y (r=16)     |
    qkv A   | q8 k8 v8 (24 rows)|           | q16 v16 (32) | unused 16 |
    qkv B   | same rows, zero outside each module's columns of the fused output

`tables[t]` ([slots, 14] int64, on the CPU) is what the C++ op reads: a slot's first row,
width and (k0, k1, c0, c1) per module block, k relative to the first row.

Placement is first fit; when no hole is long enough but enough units are free, `compact`
slides every adapter down (in chunks that never overlap their source). It runs between
steps on the engine thread, so no kernel reads the pool while rows move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import heap
from engine.lora.types import FusedTarget, PackedLoRA

SEGMENTS = 3  # modules in one fused target at most (q, k, v)
TABLE_COLUMNS = 2 + 4 * SEGMENTS


@dataclass(slots=True)
class _Placement:
    first_unit: int
    units: int
    adapter_id: str
    # per target: the HF modules adapted, in the rows' order
    modules: list[list[str]]


class LoRAPool:
    """`num_units` rank units of every fused target's A and B, for `num_slots` slots."""

    def __init__(
        self,
        targets: list[FusedTarget],
        num_layers: int,
        *,
        num_slots: int,
        num_units: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.targets = targets
        self.num_units = num_units
        self.fused = [len(t.modules) for t in targets]  # rows per unit, per target
        # [layers, rows, features] per target: layer i's pool is the contiguous view [i].
        shapes_a = [
            (num_layers, num_units * m, t.in_features)
            for t, m in zip(targets, self.fused, strict=True)
        ]
        shapes_b = [
            (num_layers, num_units * m, t.out_features)
            for t, m in zip(targets, self.fused, strict=True)
        ]
        if device.type == "cpu":
            # Zeroed by the kernel as each page is first written (engine.heap): a start
            # writes none of the pool, however large --lora-memory makes it.
            pools = heap.lazily_zeroed(shapes_a + shapes_b, dtype)
        else:
            pools = [
                torch.zeros(shape, dtype=dtype, device=device) for shape in shapes_a + shapes_b
            ]
        self.pool_a, self.pool_b = pools[: len(shapes_a)], pools[len(shapes_a) :]
        # Each layer's view, made once: the step's ops take them 4 x layers times.
        self.layer_a = [list(pool.unbind(0)) for pool in self.pool_a]
        self.layer_b = [list(pool.unbind(0)) for pool in self.pool_b]
        self.tables = [torch.zeros(num_slots, TABLE_COLUMNS, dtype=torch.int64) for _ in targets]
        # The same facts as plain lists, for the torch path and the triton layouts.
        self.offsets = [[0] * num_slots for _ in targets]
        self.widths = [[0] * num_slots for _ in targets]
        self.segments: list[list[list[tuple[int, int, int, int]]]] = [
            [[] for _ in range(num_slots)] for _ in targets
        ]
        self._placed: dict[int, _Placement] = {}
        self.num_compactions = 0

    @staticmethod
    def unit_bytes(targets: list[FusedTarget], num_layers: int, dtype: torch.dtype) -> int:
        """Bytes one rank unit takes in every target's A and B."""
        size = torch.empty((), dtype=dtype).element_size()
        rows = sum(len(t.modules) * (t.in_features + t.out_features) for t in targets)
        return num_layers * rows * size

    @property
    def free_units(self) -> int:
        return self.num_units - sum(p.units for p in self._placed.values())

    def hole(self, units: int) -> int | None:
        """The first unit of the first free range of `units`, or None."""
        cursor = 0
        for placement in sorted(self._placed.values(), key=lambda p: p.first_unit):
            if placement.first_unit - cursor >= units:
                return cursor
            cursor = placement.first_unit + placement.units
        return cursor if self.num_units - cursor >= units else None

    def place(self, slot: int, packed: PackedLoRA) -> bool:
        """Write `packed` into a free range for `slot`; False when no range is long enough."""
        assert slot not in self._placed, "slot already holds an adapter"
        first = self.hole(packed.rank)
        if first is None:
            return False
        r = packed.rank
        names = []
        for t, target in enumerate(self.targets):
            columns = {name: (start, end) for name, start, end in target.modules}
            row0 = first * self.fused[t]
            a_pool, b_pool = self.pool_a[t], self.pool_b[t]
            segments = []
            for i, (name, a, b) in enumerate(packed.modules[t]):
                rows = slice(row0 + i * r, row0 + (i + 1) * r)
                start, end = columns[name]
                a_pool[:, rows].copy_(a, non_blocking=True)
                b_pool[:, rows, start:end].copy_(b, non_blocking=True)
                b_pool[:, rows, :start].zero_()  # B's other modules' columns
                b_pool[:, rows, end:].zero_()
                segments.append((i * r, (i + 1) * r, start, end))
            names.append([name for name, _, _ in packed.modules[t]])
            self._describe(t, slot, row0, len(segments) * r, segments)
        self._placed[slot] = _Placement(first, r, packed.adapter_id, names)
        return True

    def release(self, slot: int) -> None:
        """Free the slot's rows (their contents stay until overwritten; nothing reads them)."""
        if self._placed.pop(slot, None) is not None:
            for t in range(len(self.targets)):
                self._describe(t, slot, 0, 0, [])

    def extract(self, slot: int) -> PackedLoRA:
        """A CPU copy of the slot's adapter, as the loader packed it."""
        placement = self._placed[slot]
        r = placement.units
        modules = []
        for t, target in enumerate(self.targets):
            columns = {name: (start, end) for name, start, end in target.modules}
            row0 = placement.first_unit * self.fused[t]
            entries = []
            for i, name in enumerate(placement.modules[t]):
                rows = slice(row0 + i * r, row0 + (i + 1) * r)
                start, end = columns[name]
                a = self.pool_a[t][:, rows].to("cpu", copy=True)
                b = self.pool_b[t][:, rows, start:end].to("cpu", copy=True)
                entries.append((name, a, b))
            modules.append(entries)
        return PackedLoRA(placement.adapter_id, r, modules)

    def compact(self) -> None:
        """Slide every adapter down to the pool's start, closing the holes between them."""
        cursor = 0
        for slot, placement in sorted(self._placed.items(), key=lambda item: item[1].first_unit):
            if placement.first_unit > cursor:
                self._move(placement.first_unit, cursor, placement.units)
                shift = placement.first_unit - cursor
                placement.first_unit = cursor
                for t, m in enumerate(self.fused):
                    self.offsets[t][slot] -= shift * m
                    self.tables[t][slot, 0] = self.offsets[t][slot]
            cursor += placement.units
        self.num_compactions += 1

    def _move(self, source: int, dest: int, units: int) -> None:
        # dest < source: chunks no longer than the gap never overlap their own source.
        chunk = source - dest
        for t, m in enumerate(self.fused):
            for done in range(0, units, chunk):
                n = min(chunk, units - done) * m
                src, dst = (source + done) * m, (dest + done) * m
                for pool in (self.pool_a[t], self.pool_b[t]):
                    pool[:, dst : dst + n].copy_(pool[:, src : src + n])

    def _describe(
        self, t: int, slot: int, row0: int, width: int, segments: list[tuple[int, int, int, int]]
    ) -> None:
        self.offsets[t][slot] = row0
        self.widths[t][slot] = width
        self.segments[t][slot] = segments
        row = [row0, width] + [v for segment in segments for v in segment]
        row += [0] * (TABLE_COLUMNS - len(row))
        self.tables[t][slot] = torch.tensor(row, dtype=torch.int64)
