"""LoRAManager: slot residency, LRU eviction, pinning, draining reservations, load failures."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from engine.lora import LoRAManager
from engine.lora_types import LoRALoadError, LoRARequest, LoRAWeights, llama_fused_targets
from kernels.lora import LoRAGroup, add_lora, add_lora_masked, slot_mask


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


def make_manager(max_loras: int = 2, max_cpu_loras: int = 3, loader=None) -> LoRAManager:
    def default_loader(request: LoRARequest) -> LoRAWeights:
        return weights_for(request.adapter_id)

    return LoRAManager(
        llama_fused_targets(TinyConfig),
        NUM_LAYERS,
        max_loras=max_loras,
        max_lora_rank=4,
        max_cpu_loras=max_cpu_loras,
        loader=loader or default_loader,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


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
    manager = make_manager()
    slot = acquire_when_loaded(manager, lora("a"))
    ref = weakref.ref(manager.cpu_cache["sha-a"].modules[0][0][1])
    manager.unload("sha-a")
    assert manager.slot_of == {"sha-a": slot}  # pinned: leaves when its request does
    manager.release(slot)
    assert manager.slot_of == {} and manager.cpu_cache == {}
    gc.collect()
    assert ref() is None


def test_the_cpu_cache_keeps_the_most_recent_adapters_only() -> None:
    manager = make_manager(max_loras=1, max_cpu_loras=2)
    refs = []
    for name in ["a", "b", "c", "d"]:
        slot = acquire_when_loaded(manager, lora(name))
        refs.append(weakref.ref(manager.cpu_cache[f"sha-{name}"].modules[0][0][1]))
        manager.release(slot)
    assert list(manager.cpu_cache) == ["sha-c", "sha-d"]
    gc.collect()
    assert [r() is None for r in refs] == [True, True, False, False]


def test_a_slot_computes_exactly_the_adapters_update() -> None:
    manager = make_manager(max_loras=2)
    sa = acquire_when_loaded(manager, lora("a"))
    w = weights_for("sha-a")  # the loader's weights, made again
    x = torch.randn(5, TinyConfig.hidden_size)
    layer, qkv = 1, 0
    y = torch.zeros(5, 16)  # q 8 + k 4 + v 4
    add_lora(
        y,
        x,
        manager.lora_a[qkv][layer],
        manager.lora_b[qkv][layer],
        [LoRAGroup(sa, slice(1, 4))],
        manager.widths[qkv],
    )
    a_q, b_q = w.layers[layer]["q_proj"]
    a_v, b_v = w.layers[layer]["v_proj"]
    expected = torch.zeros(5, 16)
    expected[1:4, :8] = x[1:4] @ a_q.t() @ b_q.t() * w.scaling
    expected[1:4, 12:] = x[1:4] @ a_v.t() @ b_v.t() * w.scaling
    torch.testing.assert_close(y, expected)
    # Scattered rows go through index_add and give the same rows.
    y2 = torch.zeros(5, 16)
    add_lora(
        y2,
        x,
        manager.lora_a[qkv][layer],
        manager.lora_b[qkv][layer],
        [LoRAGroup(sa, torch.tensor([1, 2, 3]))],
        manager.widths[qkv],
    )
    torch.testing.assert_close(y2, expected)


def test_the_masked_dense_path_equals_the_grouped_path() -> None:
    manager = make_manager(max_loras=3)
    slots = [acquire_when_loaded(manager, lora(n)) for n in ("a", "b", "c")]
    token_slots = torch.tensor([slots[0], -1, slots[2], slots[0], slots[1], -1])
    for target in range(4):
        a, b = manager.lora_a[target][1], manager.lora_b[target][1]
        x_t = torch.randn(6, a.shape[2])
        grouped = torch.zeros(6, b.shape[2])
        groups = [
            LoRAGroup(s, torch.nonzero(token_slots == s).flatten()) for s in sorted(set(slots))
        ]
        add_lora(grouped, x_t, a, b, groups, manager.widths[target])
        masked = torch.zeros(6, b.shape[2])
        add_lora_masked(masked, x_t, a, b, slot_mask(token_slots, 3, a.shape[1]))
        torch.testing.assert_close(masked, grouped)


def test_a_narrower_adapter_in_a_reused_slot_leaves_no_stale_rows() -> None:
    def loader(request: LoRARequest) -> LoRAWeights:
        rank = 4 if request.name == "wide" else 1
        return weights_for(request.adapter_id, rank=rank, modules=("q_proj", "k_proj", "v_proj"))

    manager = make_manager(max_loras=1, loader=loader)
    slot = acquire_when_loaded(manager, lora("wide"))
    manager.release(slot)
    assert acquire_when_loaded(manager, lora("narrow")) == slot
    qkv = 0
    assert manager.widths[qkv][slot] == 3
    assert manager.lora_a[qkv][:, slot, 3:].abs().sum() == 0
    assert manager.lora_b[qkv][:, slot, 3:].abs().sum() == 0


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
