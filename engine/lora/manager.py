"""LoRA adapters inside the engine: which adapter holds which slot, the CPU cache and
the loader thread (`LoRAManager`), and each step's adapters (a `LoRAStep`, built by the
engine's kernels). Their weights live in engine/lora/pool.py's pool; what an adapter is
(engine/lora/types.py) is kept apart, for the many modules that only name one.

The engine never reads adapter files itself: it is handed a loader (the
gateway wires `adapters.peft`) that turns a `LoRARequest` into `LoRAWeights`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from engine.lora.pool import LoRAPool
from engine.lora.types import (
    FusedTarget,
    LoRALoader,
    LoRALoadError,
    LoRARequest,
    LoRAWeights,
    PackedLoRA,
)
from kernels.backend import Kernels, LoRAStep


class _Slot:
    __slots__ = ("adapter_id", "pins", "last_used")

    def __init__(self) -> None:
        self.adapter_id: str | None = None
        self.pins = 0
        self.last_used = 0


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Where adapters are kept, and how many (EngineConfig's fields of the same names)."""

    max_loras: int = 4  # resident at once (and so per step), at most
    max_lora_rank: int = 16
    max_cpu_loras: int = 16  # kept in CPU memory (LRU) beyond the resident ones
    # Bytes of the pool resident adapters live in, each at its own rank; None: max_loras
    # adapters of max_lora_rank.
    lora_memory: int | None = None


def pool_units(
    targets: list[FusedTarget], num_layers: int, dtype: torch.dtype, config: LoRAConfig
) -> int:
    """Rank units in the pool: `lora_memory` bytes' worth, or without a budget
    `max_loras` adapters of `max_lora_rank` (the padded slots' size, for mixed ranks room
    for more)."""
    max_lora_rank, lora_memory = config.max_lora_rank, config.lora_memory
    if lora_memory is None:
        return config.max_loras * max_lora_rank
    unit = LoRAPool.unit_bytes(targets, num_layers, dtype)
    units = lora_memory // unit
    if units < max_lora_rank:
        raise ValueError(
            f"lora_memory ({lora_memory} bytes) holds no adapter of max_lora_rank "
            f"{max_lora_rank}: one takes {unit * max_lora_rank} bytes on this model"
        )
    return units


class LoRAManager:
    """Where every adapter lives: up to `max_loras` resident in the pool (as many as its
    bytes hold, each at its own rank), `max_cpu_loras` more as CPU copies (LRU), the rest
    on disk.

    Loads from disk run on one background thread, for the requests being admitted and,
    ahead of them, for the ones waiting (`prefetch`); the engine thread only polls and
    copies CPU weights into the pool. A slot used by a running request is pinned; room is
    made by evicting the least recently used unpinned adapters (their weights go back to
    the CPU cache). When pins leave no room, the oldest waiting request reserves the
    pinned slot with the fewest pins, which admits no new requests until it drains.
    """

    def __init__(
        self,
        targets: list[FusedTarget],
        num_layers: int,
        config: LoRAConfig,
        *,
        loader: LoRALoader | None,
        kernels: Kernels,
        dtype: torch.dtype,
    ) -> None:
        """The pool on `kernels`' device, holding adapters in `dtype`."""
        self.targets = targets
        self.num_layers = num_layers
        self.max_loras = max_loras = config.max_loras
        self.max_lora_rank = max_lora_rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras
        # Loads in flight (their weights wait in `loading` until a slot takes them): at least
        # one, so that an engine keeping no CPU copies still loads.
        self.max_loads = max(1, config.max_cpu_loras)
        self.loader = loader
        self.device = device = kernels.device
        self.dtype = dtype
        units = pool_units(targets, num_layers, dtype, config)
        self.pool = LoRAPool(
            targets, num_layers, num_slots=max_loras, num_units=units, device=device, dtype=dtype
        )
        self.slots = [_Slot() for _ in range(max_loras)]
        self.slot_of: dict[str, int] = {}
        # Adapters in CPU memory that are not resident: a resident one's weights are the pool's.
        self.cpu_cache: OrderedDict[str, PackedLoRA] = OrderedDict()
        self.loading: dict[str, Future[PackedLoRA]] = {}
        self.reserved: dict[int, str] = {}  # slot -> adapter waiting for it to drain
        self._pending_unload: set[str] = set()
        self._clock = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")
        # Each step's adapters as the engine's kernels read them.
        self.steps = kernels.lora_steps(self.pool, max_lora_rank)
        self.num_loads = 0  # installs into the pool
        self.num_disk_loads = 0
        self.num_evictions = 0

    @property
    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.pool.pool_a, *self.pool.pool_b])

    # -- residency --------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Reservations are re-made each step by the oldest request still waiting."""
        self.reserved.clear()

    def acquire(self, lora: LoRARequest) -> int | None:
        """The slot holding `lora`, pinned for one request; None while it loads or
        waits for room. Raises LoRALoadError when its load failed."""
        adapter_id = lora.adapter_id
        slot = self.slot_of.get(adapter_id)
        if slot is None:
            weights = self._cpu_weights(lora)
            if weights is None:
                return None
            # Out of the cache while room is made, so the evictions do not push it out.
            cached = self.cpu_cache.pop(adapter_id, None)
            slot = self._make_room(adapter_id, weights.rank)
            if slot is None:
                if cached is not None:
                    self._cache(cached)
                return None
            self._install(slot, weights)
            self.loading.pop(adapter_id, None)
        elif slot in self.reserved and self.reserved[slot] != adapter_id:
            return None  # draining for a waiting adapter
        state = self.slots[slot]
        state.pins += 1
        self._clock += 1
        state.last_used = self._clock
        return slot

    def load_now(self, lora: LoRARequest) -> int:
        """Load `lora` into the pool on the calling thread (start-up preloading,
        benchmarks); returns its slot, unpinned."""
        slot = self.slot_of.get(lora.adapter_id)
        if slot is not None:
            return slot
        weights = self.cpu_cache.pop(lora.adapter_id, None) or self._load(lora)
        slot = self._make_room(lora.adapter_id, weights.rank)
        if slot is None:
            self._cache(weights)
            raise LoRALoadError("every LoRA slot is in use")
        self._install(slot, weights)
        return slot

    def prefetch(self, loras: Iterable[LoRARequest]) -> None:
        """Start reading the adapters of waiting requests from disk, in the order given,
        while loads in flight stay within `max_cpu_loras` (one at least)."""
        for lora in loras:
            if len(self.loading) >= self.max_loads:
                return
            adapter_id = lora.adapter_id
            if adapter_id in self.slot_of or adapter_id in self.cpu_cache:
                continue
            if adapter_id not in self.loading and self.loader is not None:
                self.loading[adapter_id] = self._executor.submit(self._load, lora)
                self.num_disk_loads += 1

    def release(self, slot: int) -> None:
        state = self.slots[slot]
        state.pins -= 1
        assert state.pins >= 0, "LoRA slot released more often than acquired"
        if state.pins == 0 and state.adapter_id in self._pending_unload:
            self._pending_unload.discard(state.adapter_id)
            self._drop_slot(slot)

    def abandon(self, adapter_id: str) -> None:
        """No waiting request wants this adapter any more (they were aborted): drop
        its load, so that it stops holding a place among the loads in flight."""
        self.loading.pop(adapter_id, None)

    def unload(self, adapter_id: str) -> None:
        """Drop an adapter's CPU copy and slot now, or once its running requests finish."""
        self.cpu_cache.pop(adapter_id, None)
        self.loading.pop(adapter_id, None)
        slot = self.slot_of.get(adapter_id)
        if slot is None:
            return
        if self.slots[slot].pins:
            self._pending_unload.add(adapter_id)
        else:
            self._drop_slot(slot)

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
            if len(self.loading) >= self.max_loads:
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

    def _evictable(self, slot: int, adapter_id: str) -> bool:
        state = self.slots[slot]
        return (
            state.adapter_id is not None
            and state.pins == 0
            and self.reserved.get(slot, adapter_id) == adapter_id
        )

    def _lru_evictable(self, adapter_id: str) -> int | None:
        candidates = [i for i in self.slot_of.values() if self._evictable(i, adapter_id)]
        return min(candidates, key=lambda i: self.slots[i].last_used) if candidates else None

    def _make_room(self, adapter_id: str, units: int) -> int | None:
        """A free slot and `units` free in a row of the pool for `adapter_id`, evicting the
        least recently used unpinned adapters as needed; None when pins leave too little (the
        slot with the fewest pins is then reserved for this adapter to drain)."""
        free = [
            i for i, s in enumerate(self.slots) if s.adapter_id is None and i not in self.reserved
        ]
        slot = free[0] if free else None
        if slot is None:
            victim = self._lru_evictable(adapter_id)
            if victim is not None:
                self._evict_slot(victim)
                slot = victim
        while slot is not None and self.pool.hole(units) is None:
            if self.pool.free_units >= units:
                self.pool.compact()
                self.steps.pool_changed()
                continue
            victim = self._lru_evictable(adapter_id)
            if victim is None:
                slot = None
                break
            self._evict_slot(victim)
        if slot is None:
            self._reserve_for(adapter_id)
        return slot

    def _reserve_for(self, adapter_id: str) -> None:
        if adapter_id in self.reserved.values():
            return
        candidates = [i for i in self.slot_of.values() if i not in self.reserved]
        if candidates:
            self.reserved[min(candidates, key=lambda i: self.slots[i].pins)] = adapter_id

    def _evict_slot(self, slot: int) -> None:
        """Free the slot to make room: its weights go back to the CPU cache."""
        if self.slots[slot].adapter_id is not None and self.max_cpu_loras > 0:
            self._cache(self.pool.extract(slot))
        self._drop_slot(slot)

    def _drop_slot(self, slot: int) -> None:
        """Free the slot, its weights dropped (an unloaded adapter's)."""
        state = self.slots[slot]
        if state.adapter_id is not None:
            del self.slot_of[state.adapter_id]
            self.num_evictions += 1
        state.adapter_id = None
        self.pool.release(slot)
        self.steps.pool_changed()

    def _install(self, slot: int, packed: PackedLoRA) -> None:
        placed = self.pool.place(slot, packed)
        assert placed, "_make_room leaves a hole for the adapter"
        self.cpu_cache.pop(packed.adapter_id, None)
        self.slots[slot].adapter_id = packed.adapter_id
        self.slot_of[packed.adapter_id] = slot
        self.steps.pool_changed()
        self.num_loads += 1

    # -- the step ---------------------------------------------------------------------------

    def step_context(self, token_slots: np.ndarray) -> LoRAStep | None:
        """The step's adapters by token (slots; -1: base model only); None when no token
        runs under one."""
        if len(token_slots) == 0 or token_slots.max() < 0:  # the common all-base step
            return None
        return self.steps.step(token_slots)

    @property
    def cpu_cache_bytes(self) -> int:
        return sum(w.nbytes for w in self.cpu_cache.values())

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
