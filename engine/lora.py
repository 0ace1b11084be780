"""LoRA adapters inside the engine: device slots, the CPU cache, and each step's adapters
(`LoRAStep`). What an adapter is (engine/lora_types.py) is kept apart, for the many modules
that only name one.

The engine never reads adapter files itself: it is handed a loader (the
gateway wires `adapters.peft`) that turns a `LoRARequest` into `LoRAWeights`.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np
import torch

from engine.lora_types import (
    FusedTarget,
    LoRALoader,
    LoRALoadError,
    LoRARequest,
    LoRAWeights,
    PackedLoRA,
)
from kernels.dispatch import TORCH_KERNELS, Kernels
from kernels.lora import LoRAGroup, add_lora, add_lora_masked, slot_mask

# Steps of at most this many tokens with more than one adapter (or base rows) take
# the masked dense path: its cost grows with tokens x max_loras, its op count not at all.
MASKED_MAX_TOKENS = 256
# Steps whose adapted tokens form at most this many runs of one slot take the grouped path
# (two ops per run, each at its adapter's own rank), whatever their size.
MAX_GROUPED_RUNS = 8


class LoRAStep:
    """The adapters of one forward pass: which tokens run under which slot.

    Built once per step; every LoRA-targeted linear of every layer calls `apply`.
    Small steps with several adapters take the masked dense path (a fixed three
    ops per linear), large ones the grouped path (work proportional to tokens).
    """

    __slots__ = ("manager", "groups", "masks", "runs", "triton")

    def __init__(
        self,
        manager: LoRAManager,
        groups: list[LoRAGroup],
        masks: list[torch.Tensor] | None,
        runs: tuple[list[int], list[int], list[int]] | None = None,
        triton: tuple[Any, list[Any]] | None = None,
    ) -> None:
        self.manager = manager
        self.groups = groups
        self.masks = masks  # per target, for the dense path; None: grouped
        self.runs = runs  # (slots, starts, ends) for the C++ grouped path; None: torch
        # (kernels.triton LoRABatch, a SlotLayout per target: widths and module blocks)
        self.triton = triton

    def apply(self, layer: int, target: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the step's adapters' contribution for fused target `target` of `layer`."""
        m = self.manager
        a, b = m.lora_a[target][layer], m.lora_b[target][layer]
        if self.runs is not None:
            slots, starts, ends = self.runs
            torch.ops.loragate.add_lora_runs(
                y, x, a, b, slots, starts, ends, m.widths[target], m.flat_segments[target]
            )
        elif self.triton is not None:
            assert m.triton is not None
            batch, layouts = self.triton
            m.triton.add_lora(y, x, a, b, layouts[target], batch)
        elif self.masks is not None:
            add_lora_masked(y, x, a, b, self.masks[target])
        else:
            add_lora(y, x, a, b, self.groups, m.widths[target])


def _flatten(per_slot: list[list[tuple[int, int, int, int]]]) -> list[int]:
    """[count, then 4 ints per segment] for each slot in turn."""
    flat: list[int] = []
    for segments in per_slot:
        flat.append(len(segments))
        for segment in segments:
            flat.extend(segment)
    return flat


class _Slot:
    __slots__ = ("adapter_id", "pins", "last_used")

    def __init__(self) -> None:
        self.adapter_id: str | None = None
        self.pins = 0
        self.last_used = 0


class LoRAManager:
    """Where every adapter lives: `max_loras` device slots, `max_cpu_loras` CPU
    copies (LRU), the rest on disk.

    Slots hold stacked A and B per layer and fused linear, padded to
    `max_lora_rank`: A as [max_loras, modules * max_rank, in], B transposed as
    [max_loras, modules * max_rank, out], the scaling folded into B. A slot of
    rank r packs its modules' rows at stride r, so its first `width` rows are
    all of it and the rest is never read.

    Loads from disk run on one background thread; the engine thread only polls
    and copies CPU weights into a slot. A slot used by a running request is
    pinned; eviction takes the least recently used unpinned slot. When every
    slot is pinned, the oldest waiting request reserves the slot with the
    fewest pins, which admits no new requests until it drains.
    """

    def __init__(
        self,
        targets: list[FusedTarget],
        num_layers: int,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        loader: LoRALoader | None,
        device: torch.device,
        dtype: torch.dtype,
        kernels: Kernels = TORCH_KERNELS,
    ) -> None:
        self.targets = targets
        self.num_layers = num_layers
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.loader = loader
        self.device = device
        self.dtype = dtype
        # Per fused target, every layer's slots in one tensor: a slot installs with one
        # copy per target, and layer i's stack is the contiguous view [i].
        self.lora_a = [self._slot_stack(len(t.modules), t.in_features) for t in targets]
        self.lora_b = [self._slot_stack(len(t.modules), t.out_features) for t in targets]
        # widths[target][slot]: rows of that slot's A/B in use (0: not adapted);
        # _written: rows that may be non-zero (an evicted adapter's stay until overwritten).
        self.widths = [[0] * max_loras for _ in targets]
        self._written = [[0] * max_loras for _ in targets]
        # segments[target][slot]: (first row, last row + 1, first column, last column + 1) of
        # each module's block of B (the rest of B is zero); flat for the C++ op.
        self.segments: list[list[list[tuple[int, int, int, int]]]] = [
            [[] for _ in range(max_loras)] for _ in targets
        ]
        self.flat_segments = [_flatten(t) for t in self.segments]
        self.slots = [_Slot() for _ in range(max_loras)]
        self.slot_of: dict[str, int] = {}
        self.cpu_cache: OrderedDict[str, PackedLoRA] = OrderedDict()
        self.loading: dict[str, Future[PackedLoRA]] = {}
        self.reserved: dict[int, str] = {}  # slot -> adapter waiting for it to drain
        self._pending_unload: set[str] = set()
        self._clock = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")
        self.native = kernels.native  # the C++ grouped op (kernels.native)
        self.triton: ModuleType | None = kernels.triton  # kernels.triton.ops
        self._triton_layouts: list[Any] | None = None  # per target; remade after slots change
        self.num_loads = 0  # installs into a slot
        self.num_disk_loads = 0

    def _slot_stack(self, num_modules: int, features: int) -> torch.Tensor:
        """[layers, slots, modules * max_rank, features], zeroed: per fused target, every
        layer's slots in one tensor, so a slot installs with one copy per target and
        layer i's stack is the contiguous view [i]."""
        shape = (self.num_layers, self.max_loras, num_modules * self.max_lora_rank, features)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # -- residency --------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Reservations are re-made each step by the oldest request still waiting."""
        self.reserved.clear()

    def acquire(self, lora: LoRARequest) -> int | None:
        """The slot holding `lora`, pinned for one request; None while it loads or
        waits for a slot. Raises LoRALoadError when its load failed."""
        adapter_id = lora.adapter_id
        slot = self.slot_of.get(adapter_id)
        if slot is None:
            weights = self._cpu_weights(lora)
            if weights is None:
                return None
            slot = self._free_slot(adapter_id)
            if slot is None:
                return None
            self._install(slot, weights)
            self.loading.pop(adapter_id, None)
            self._cache(weights)
        elif slot in self.reserved and self.reserved[slot] != adapter_id:
            return None  # draining for a waiting adapter
        state = self.slots[slot]
        state.pins += 1
        self._clock += 1
        state.last_used = self._clock
        return slot

    def load_now(self, lora: LoRARequest) -> int:
        """Load `lora` into a free or unpinned slot on the calling thread (start-up
        preloading, benchmarks); returns the slot, unpinned."""
        slot = self.slot_of.get(lora.adapter_id)
        if slot is not None:
            return slot
        weights = self.cpu_cache.get(lora.adapter_id) or self._load(lora)
        self._cache(weights)
        slot = self._free_slot(lora.adapter_id)
        if slot is None:
            raise LoRALoadError("every LoRA slot is in use")
        self._install(slot, weights)
        return slot

    def release(self, slot: int) -> None:
        state = self.slots[slot]
        state.pins -= 1
        assert state.pins >= 0, "LoRA slot released more often than acquired"
        if state.pins == 0 and state.adapter_id in self._pending_unload:
            self._pending_unload.discard(state.adapter_id)
            self._evict_slot(slot)

    def abandon(self, adapter_id: str) -> None:
        """No waiting request wants this adapter any more (they were aborted): drop
        its load, so that it stops holding a place among the loads in flight."""
        self.loading.pop(adapter_id, None)

    def unload(self, adapter_id: str) -> None:
        """Drop an adapter's CPU copy and device slot now, or once its running
        requests finish."""
        self.cpu_cache.pop(adapter_id, None)
        self.loading.pop(adapter_id, None)
        slot = self.slot_of.get(adapter_id)
        if slot is None:
            return
        if self.slots[slot].pins:
            self._pending_unload.add(adapter_id)
        else:
            self._evict_slot(slot)

    def _cpu_weights(self, lora: LoRARequest) -> PackedLoRA | None:
        """The adapter's weights if in CPU memory (cached, or loaded and not yet
        taken); otherwise start loading them and return None."""
        adapter_id = lora.adapter_id
        weights = self.cpu_cache.get(adapter_id)
        if weights is not None:
            self.cpu_cache.move_to_end(adapter_id)
            return weights
        future = self.loading.get(adapter_id)
        if future is None:
            if self.loader is None:
                raise LoRALoadError("this engine was started without LoRA support")
            # Loaded weights wait in `loading` until a slot takes them: bounding it
            # bounds that memory and keeps a queue of many cold adapters from
            # loading them all only to evict them unused.
            if len(self.loading) >= self.max_cpu_loras:
                return None
            self.loading[adapter_id] = self._executor.submit(self._load, lora)
            self.num_disk_loads += 1
            return None
        if not future.done():
            return None
        if future.exception() is not None:
            del self.loading[adapter_id]
        return future.result()  # raises LoRALoadError

    def _cache(self, weights: PackedLoRA) -> None:
        self.cpu_cache[weights.adapter_id] = weights
        self.cpu_cache.move_to_end(weights.adapter_id)
        while len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)

    def _load(self, lora: LoRARequest) -> PackedLoRA:
        assert self.loader is not None
        try:
            weights = self.loader(lora)
        except Exception as exc:  # the loader names the problem; the engine keeps serving
            raise LoRALoadError(f"adapter {lora.name!r} failed to load: {exc}") from exc
        if weights.adapter_id != lora.adapter_id:
            raise LoRALoadError(f"adapter {lora.name!r} changed since it was registered")
        if weights.rank > self.max_lora_rank:
            raise LoRALoadError(
                f"adapter {lora.name!r} has rank {weights.rank}, "
                f"above max_lora_rank={self.max_lora_rank}"
            )
        if len(weights.layers) != self.num_layers:
            raise LoRALoadError(
                f"adapter {lora.name!r} has {len(weights.layers)} layers, "
                f"the model {self.num_layers}"
            )
        return self._pack(weights)

    def _pack(self, weights: LoRAWeights) -> PackedLoRA:
        r, layers, num_layers = weights.rank, weights.layers, self.num_layers
        present = {name for layer in layers for name in layer}
        packed = []
        for target in self.targets:
            entries = []
            for name, start, end in target.modules:
                if name not in present:
                    continue
                # A layer the adapter leaves alone contributes zeros.
                absent = (torch.zeros(r, target.in_features), torch.zeros(end - start, r))
                factors = [layer.get(name, absent) for layer in layers]
                a = torch.stack(
                    [fa for fa, _ in factors], out=torch.empty(num_layers, r, target.in_features)
                )
                b = torch.empty(num_layers, r, end - start)
                for i, (_, fb) in enumerate(factors):
                    torch.mul(fb.T, weights.scaling, out=b[i])
                entries.append((name, a.to(self.dtype), b.to(self.dtype)))
            packed.append(entries)
        return PackedLoRA(weights.adapter_id, r, packed)

    def _free_slot(self, adapter_id: str) -> int | None:
        free = [
            i for i, s in enumerate(self.slots) if s.adapter_id is None and i not in self.reserved
        ]
        if free:
            return free[0]
        unpinned = [
            i
            for i, s in enumerate(self.slots)
            if s.pins == 0 and self.reserved.get(i, adapter_id) == adapter_id
        ]
        if unpinned:
            slot = min(unpinned, key=lambda i: self.slots[i].last_used)
            self._evict_slot(slot)
            return slot
        if adapter_id not in self.reserved.values():
            candidates = [i for i in range(self.max_loras) if i not in self.reserved]
            if candidates:
                self.reserved[min(candidates, key=lambda i: self.slots[i].pins)] = adapter_id
        return None

    def _evict_slot(self, slot: int) -> None:
        state = self.slots[slot]
        if state.adapter_id is not None:
            del self.slot_of[state.adapter_id]
        state.adapter_id = None
        for widths in self.widths:
            widths[slot] = 0
        self._triton_layouts = None

    def _install(self, slot: int, packed: PackedLoRA) -> None:
        r = packed.rank
        for t, target in enumerate(self.targets):
            a_slot, b_slot = self.lora_a[t][:, slot], self.lora_b[t][:, slot]
            columns = {name: (start, end) for name, start, end in target.modules}
            segments = []
            for i, (name, a, b) in enumerate(packed.modules[t]):
                rows = slice(i * r, (i + 1) * r)
                start, end = columns[name]
                segments.append((i * r, (i + 1) * r, start, end))
                a_slot[:, rows].copy_(a, non_blocking=True)
                b_slot[:, rows, start:end].copy_(b, non_blocking=True)
                b_slot[:, rows, :start].zero_()  # B's other modules' columns
                b_slot[:, rows, end:].zero_()
            width = len(packed.modules[t]) * r
            written = self._written[t][slot]
            if written > width:  # the masked path reads past `width`: it must be zero
                a_slot[:, width:written].zero_()
                b_slot[:, width:written].zero_()
            self.widths[t][slot] = self._written[t][slot] = width
            self.segments[t][slot] = segments
            self.flat_segments[t] = _flatten(self.segments[t])
        self.slots[slot].adapter_id = packed.adapter_id
        self.slot_of[packed.adapter_id] = slot
        self._triton_layouts = None
        self.num_loads += 1

    # -- the step ---------------------------------------------------------------------------

    def step_context(self, token_slots: np.ndarray) -> LoRAStep | None:
        """Group the step's tokens by slot (-1: base model only)."""
        if len(token_slots) == 0 or token_slots.max() < 0:  # the common all-base step
            return None
        if self.triton is not None:
            # The kernels gather each slot's tokens wherever they are: one segment per slot.
            batch = self.triton.lora_batch(torch.from_numpy(token_slots), self.device)
            if self._triton_layouts is None:
                self._triton_layouts = self.triton.slot_layouts(
                    self.widths, self.segments, self.max_lora_rank, self.device
                )
            return LoRAStep(self, [], None, triton=(batch, self._triton_layouts))
        # Runs of equal slots: the model runner orders rows by slot when it can, and then
        # each adapter's tokens are a slice or two, which the grouped path takes at the
        # cost of its own rank alone.
        changes = np.flatnonzero(np.diff(token_slots, prepend=token_slots[0] - 1)).tolist()
        runs = [
            (int(token_slots[start]), start, end)
            for start, end in zip(changes, [*changes[1:], len(token_slots)], strict=True)
            if token_slots[start] >= 0
        ]
        if len(runs) <= MAX_GROUPED_RUNS:
            groups = [LoRAGroup(slot, slice(a, b)) for slot, a, b in runs]
            if not self.native:
                return LoRAStep(self, groups, None)
            slots, firsts, ends = (list(column) for column in zip(*runs, strict=True))
            return LoRAStep(self, groups, None, (slots, firsts, ends))
        if len(token_slots) <= MASKED_MAX_TOKENS:
            index = torch.from_numpy(token_slots).to(self.device)
            masks = [
                slot_mask(index, self.max_loras, a.shape[2]).to(self.dtype) for a in self.lora_a
            ]
            return LoRAStep(self, [], masks)
        groups = []
        for slot in np.unique(token_slots[token_slots >= 0]).tolist():
            rows = torch.from_numpy(np.flatnonzero(token_slots == slot)).to(self.device)
            groups.append(LoRAGroup(slot, rows))
        return LoRAStep(self, groups, None)

    @property
    def cpu_cache_bytes(self) -> int:
        return sum(w.nbytes for w in self.cpu_cache.values())

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
