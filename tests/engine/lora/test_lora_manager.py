"""LoRAManager: residency in the pool (mixed ranks, a byte budget, compaction), LRU eviction
to the CPU cache, pinning, draining reservations, prefetch, load failures."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from engine.lora.manager import LoRAConfig, LoRAManager
from engine.lora.pool import LoRAPool
from engine.lora.types import LoRALoadError, LoRARequest, LoRAWeights, llama_fused_targets
from kernels.lora import LoRAGroup, SlotRows, add_lora
from kernels.torch_backend import TorchKernels


class TinyConfig:
    num_attention_heads = 2
    num_key_value_heads = 1
    head_dim = 4
    hidden_size = 8
    intermediate_size = 16


NUM_LAYERS = 2


def module_shapes() -> dict[str, tuple[int, int]]:
    """HF module name -> (in_features, out_features) of the tiny model."""
    return {
        name: (target.in_features, end - start)
        for target in llama_fused_targets(TinyConfig)
        for name, start, end in target.modules
    }


def weights_for(adapter_id: str, rank: int = 2, modules: tuple[str, ...] = ("q_proj", "v_proj")):
    targets = module_shapes()
    g = torch.Generator().manual_seed(hash(adapter_id) % 2**31)
    layers = [
        {
            m: (
                torch.randn(rank, targets[m][0], generator=g),
                torch.randn(targets[m][1], rank, generator=g),
            )
            for m in modules
        }
        for _ in range(NUM_LAYERS)
    ]
    return LoRAWeights(adapter_id, rank, 0.5, layers)


def lora(name: str) -> LoRARequest:
    return LoRARequest(name, f"/adapters/{name}", f"sha-{name}")


def make_manager(
    max_loras: int = 2, max_cpu_loras: int = 3, loader=None, lora_memory: int | None = None
) -> LoRAManager:
    def default_loader(request: LoRARequest) -> LoRAWeights:
        return weights_for(request.adapter_id)

    return LoRAManager(
        llama_fused_targets(TinyConfig),
        NUM_LAYERS,
        LoRAConfig(max_loras, 4, max_cpu_loras, lora_memory),
        loader=loader or default_loader,
        kernels=TorchKernels(torch.device("cpu")),
        dtype=torch.float32,
    )


# Bytes of one rank unit of the tiny model: 2 layers x (q/k/v 3 x (8 + 16), o 8 + 8,
# gate/up 2 x (8 + 32), down 16 + 8) float32 values.
UNIT = 2 * (3 * 24 + 16 + 2 * 40 + 24) * 4


def ranked_loader(ranks: dict[str, int]):
    def loader(request: LoRARequest) -> LoRAWeights:
        return weights_for(request.adapter_id, rank=ranks[request.name])

    return loader


def acquire_when_loaded(manager: LoRAManager, request: LoRARequest) -> int:
    """Poll as the scheduler does each step until the background load lands."""
    for _ in range(2000):
        manager.begin_step()
        slot = manager.acquire(request)
        if slot is not None:
            return slot
        time.sleep(0.001)
    raise AssertionError(f"{request.name} never got a slot")


def test_a_cold_adapter_loads_in_the_background_and_then_gets_a_slot() -> None:
    manager = make_manager()
    assert manager.acquire(lora("a")) is None  # the load has only started
    slot = acquire_when_loaded(manager, lora("a"))
    assert manager.slot_of == {"sha-a": slot}
    assert manager.slots[slot].pins == 1  # the first acquire returned None and pinned nothing


def test_eviction_takes_the_least_recently_used_unpinned_slot() -> None:
    manager = make_manager(max_loras=2)
    sa = acquire_when_loaded(manager, lora("a"))
    sb = acquire_when_loaded(manager, lora("b"))
    manager.release(sb)
    manager.release(sa)  # a released last, but b was used less recently
    acquire_when_loaded(manager, lora("a"))
    manager.release(sa)
    sc = acquire_when_loaded(manager, lora("c"))
    assert sc == sb
    assert set(manager.slot_of) == {"sha-a", "sha-c"}


def test_a_pinned_slot_is_never_evicted_and_the_cold_adapter_reserves_it() -> None:
    manager = make_manager(max_loras=2)
    sa = acquire_when_loaded(manager, lora("a"))
    sb = acquire_when_loaded(manager, lora("b"))
    acquire_when_loaded(manager, lora("b"))  # b has two running requests, a one
    manager.begin_step()
    assert manager.acquire(lora("c")) is None  # loads, then finds every slot pinned
    assert acquire_eventually_none(manager, lora("c"))
    assert manager.reserved == {sa: "sha-c"}  # the slot that drains first
    assert manager.acquire(lora("a")) is None  # a admits no new request while draining
    assert manager.acquire(lora("b")) == sb  # b is not reserved
    manager.release(sa)
    assert manager.acquire(lora("c")) == sa
    assert "sha-a" not in manager.slot_of


def acquire_eventually_none(manager: LoRAManager, request: LoRARequest) -> bool:
    for _ in range(2000):
        manager.begin_step()
        if manager.acquire(request) is not None:
            return False
        future = manager.loading.get(request.adapter_id)
        if future is not None and future.done():  # loaded, and still no slot
            return True
        time.sleep(0.001)
    return False


def test_a_failed_load_raises_for_its_requests_and_leaves_no_trace() -> None:
    def loader(request: LoRARequest) -> LoRAWeights:
        raise FileNotFoundError(f"{request.path}: no such adapter")

    manager = make_manager(loader=loader)
    assert manager.acquire(lora("x")) is None
    with pytest.raises(LoRALoadError, match="no such adapter"):
        acquire_when_loaded(manager, lora("x"))
    assert not manager.slot_of and not manager.cpu_cache and not manager.loading


def test_weights_that_do_not_match_the_registered_identity_are_refused() -> None:
    manager = make_manager(loader=lambda r: weights_for("someone-else"))
    with pytest.raises(LoRALoadError, match="changed since it was registered"):
        acquire_when_loaded(manager, lora("x"))


def test_unload_frees_the_slot_and_the_cpu_copy() -> None:
    manager = make_manager(max_loras=1)
    slot = acquire_when_loaded(manager, lora("a"))
    manager.unload("sha-a")
    assert manager.slot_of == {"sha-a": slot}  # pinned: leaves when its request does
    manager.release(slot)
    assert manager.slot_of == {} and manager.cpu_cache == {}
    assert manager.pool.free_units == manager.pool.num_units
    # An adapter evicted to the CPU cache is dropped from there too.
    manager.release(acquire_when_loaded(manager, lora("b")))
    manager.release(acquire_when_loaded(manager, lora("c")))  # evicts b to the cache
    ref = weakref.ref(manager.cpu_cache["sha-b"].modules[0][0][1])
    manager.unload("sha-b")
    assert "sha-b" not in manager.cpu_cache
    gc.collect()
    assert ref() is None


def test_the_cpu_cache_keeps_the_most_recently_evicted_adapters_only() -> None:
    manager = make_manager(max_loras=1, max_cpu_loras=2)
    for name in ["a", "b", "c", "d"]:
        slot = acquire_when_loaded(manager, lora(name))
        assert f"sha-{name}" not in manager.cpu_cache  # resident: the pool holds it
        manager.release(slot)
    assert list(manager.cpu_cache) == ["sha-b", "sha-c"] and set(manager.slot_of) == {"sha-d"}
    refs = [weakref.ref(manager.cpu_cache[f"sha-{n}"].modules[0][0][1]) for n in ("b", "c")]
    manager.release(acquire_when_loaded(manager, lora("b")))  # from the cache, not the disk
    assert manager.num_disk_loads == 4 and list(manager.cpu_cache) == ["sha-c", "sha-d"]
    gc.collect()
    assert [r() is None for r in refs] == [True, False]


def test_a_slot_computes_exactly_the_adapters_update() -> None:
    manager = make_manager(max_loras=2)
    sa = acquire_when_loaded(manager, lora("a"))
    w = weights_for("sha-a")  # the loader's weights, made again
    x = torch.randn(5, TinyConfig.hidden_size)
    layer, qkv = 1, 0
    y = torch.zeros(5, 16)  # q 8 + k 4 + v 4
    pool = manager.pool
    a, b = pool.pool_a[qkv][layer], pool.pool_b[qkv][layer]
    add_lora(
        y, x, a, b, [LoRAGroup(sa, slice(1, 4))], SlotRows(pool.offsets[qkv], pool.widths[qkv])
    )
    a_q, b_q = w.layers[layer]["q_proj"]
    a_v, b_v = w.layers[layer]["v_proj"]
    expected = torch.zeros(5, 16)
    expected[1:4, :8] = x[1:4] @ a_q.t() @ b_q.t() * w.scaling
    expected[1:4, 12:] = x[1:4] @ a_v.t() @ b_v.t() * w.scaling
    torch.testing.assert_close(y, expected)
    # Scattered rows go through index_add and give the same rows.
    y2 = torch.zeros(5, 16)
    groups = [LoRAGroup(sa, torch.tensor([1, 2, 3]))]
    add_lora(y2, x, a, b, groups, SlotRows(pool.offsets[qkv], pool.widths[qkv]))
    torch.testing.assert_close(y2, expected)


def test_each_adapter_takes_rows_for_its_own_rank() -> None:
    ranks = {"r1": 1, "r4": 4, "r2": 2}
    manager = make_manager(max_loras=4, loader=ranked_loader(ranks), lora_memory=16 * UNIT)
    assert manager.pool.num_units == 16
    slots = {n: acquire_when_loaded(manager, lora(n)) for n in ranks}
    qkv, gate_up = 0, 2
    pool = manager.pool
    # Units 0, 1-4, 5-6; q/k/v fuses three modules (rows = 3 x units), q and v adapted.
    assert [pool.offsets[qkv][slots[n]] for n in ranks] == [0, 3, 15]
    assert [pool.widths[qkv][slots[n]] for n in ranks] == [2, 8, 4]
    assert [pool.widths[gate_up][slots[n]] for n in ranks] == [0, 0, 0]
    assert pool.free_units == 16 - 7
    assert pool.tables[qkv][slots["r4"]].tolist()[:10] == [3, 8, 0, 4, 0, 8, 4, 8, 12, 16]


def test_room_is_made_by_evicting_the_least_recently_used_and_compacting() -> None:
    ranks = {"a": 1, "b": 1, "c": 1, "d": 1, "e": 2, "big": 2}
    manager = make_manager(max_loras=8, loader=ranked_loader(ranks), lora_memory=6 * UNIT)
    for name in ("a", "b", "c", "d", "e", "b", "d"):  # units a 0, b 1, c 2, d 3, e 4-5
        manager.release(acquire_when_loaded(manager, lora(name)))
    before = manager.pool.extract(manager.slot_of["sha-e"])
    manager.release(acquire_when_loaded(manager, lora("big")))
    # Evicting a, then c (least recently used) frees units 0 and 2: enough, but not in a
    # row, so the pool compacts rather than evict a third adapter.
    assert set(manager.slot_of) == {"sha-b", "sha-d", "sha-e", "sha-big"}
    assert manager.pool.num_compactions == 1 and manager.num_evictions == 2
    assert list(manager.cpu_cache) == ["sha-a", "sha-c"]
    moved = manager.pool.extract(manager.slot_of["sha-e"])
    for t in range(4):
        for (_, a0, b0), (_, a1, b1) in zip(before.modules[t], moved.modules[t], strict=True):
            assert torch.equal(a0, a1) and torch.equal(b0, b1)
    offsets = [manager.pool.offsets[0][manager.slot_of[f"sha-{n}"]] for n in ("b", "d", "e", "big")]
    assert offsets == [0, 3, 6, 12]


def test_an_evicted_adapter_comes_back_from_the_cache_with_the_same_update() -> None:
    manager = make_manager(max_loras=1, max_cpu_loras=2)
    x = torch.randn(3, TinyConfig.hidden_size)

    def update(slot: int) -> torch.Tensor:
        pool, y = manager.pool, torch.zeros(3, 16)
        a, b = pool.pool_a[0][1], pool.pool_b[0][1]
        add_lora(
            y, x, a, b, [LoRAGroup(slot, slice(0, 3))], SlotRows(pool.offsets[0], pool.widths[0])
        )
        return y

    slot = acquire_when_loaded(manager, lora("a"))
    first = update(slot)
    manager.release(slot)
    manager.release(acquire_when_loaded(manager, lora("b")))
    assert "sha-a" in manager.cpu_cache
    slot = acquire_when_loaded(manager, lora("a"))
    assert torch.equal(update(slot), first) and manager.num_disk_loads == 2


def test_a_budget_too_small_for_one_adapter_of_max_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no adapter of max_lora_rank 4"):
        make_manager(lora_memory=3 * UNIT)
    assert LoRAPool.unit_bytes(llama_fused_targets(TinyConfig), NUM_LAYERS, torch.float32) == UNIT


def test_prefetch_loads_waiting_adapters_within_the_bound() -> None:
    manager = make_manager(max_loras=1, max_cpu_loras=2)
    manager.release(acquire_when_loaded(manager, lora("a")))
    manager.prefetch([lora("a"), lora("b"), lora("c"), lora("d")])
    assert set(manager.loading) == {"sha-b", "sha-c"}  # a is resident; d over the bound
    for name in ("b", "c"):
        manager.loading[f"sha-{name}"].result()
    manager.release(acquire_when_loaded(manager, lora("b")))
    assert manager.num_disk_loads == 3


def test_an_engine_keeping_no_cpu_copies_still_loads_one_adapter_at_a_time() -> None:
    manager = make_manager(max_loras=1, max_cpu_loras=0)
    manager.prefetch([lora("a"), lora("b")])
    assert set(manager.loading) == {"sha-a"}
    manager.release(acquire_when_loaded(manager, lora("a")))
    manager.release(acquire_when_loaded(manager, lora("b")))  # a evicted, and not kept
    assert set(manager.slot_of) == {"sha-b"} and not manager.cpu_cache
    assert manager.num_disk_loads == 2


def test_a_narrower_adapter_where_a_wider_one_was_computes_only_its_own_update() -> None:
    modules = ("q_proj", "k_proj", "v_proj")

    def loader(request: LoRARequest) -> LoRAWeights:
        rank = 4 if request.name == "wide" else 1
        return weights_for(request.adapter_id, rank=rank, modules=modules)

    manager = make_manager(max_loras=1, loader=loader)
    slot = acquire_when_loaded(manager, lora("wide"))
    manager.release(slot)
    assert acquire_when_loaded(manager, lora("narrow")) == slot
    qkv, pool = 0, manager.pool
    assert pool.offsets[qkv][slot] == 0 and pool.widths[qkv][slot] == 3
    w, x, y = (
        weights_for("sha-narrow", rank=1, modules=modules),
        torch.ones(2, 8),
        torch.zeros(2, 16),
    )
    a, b = pool.pool_a[qkv][0], pool.pool_b[qkv][0]
    add_lora(
        y, x, a, b, [LoRAGroup(slot, slice(0, 2))], SlotRows(pool.offsets[qkv], pool.widths[qkv])
    )
    expected = torch.cat([x @ w.layers[0][m][0].t() @ w.layers[0][m][1].t() for m in modules], 1)
    torch.testing.assert_close(y, expected * w.scaling)


def test_abandoned_loads_do_not_block_new_ones() -> None:
    manager = make_manager(max_loras=1, max_cpu_loras=2)
    for name in ("gone-1", "gone-2"):
        manager.acquire(lora(name))
    while not all(f.done() for f in manager.loading.values()):
        time.sleep(0.001)
    manager.begin_step()
    assert manager.acquire(lora("new")) is None and "sha-new" not in manager.loading  # full
    for name in ("gone-1", "gone-2"):  # their requests were aborted while loading
        manager.abandon(f"sha-{name}")
    assert acquire_when_loaded(manager, lora("new")) == 0
