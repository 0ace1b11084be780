"""Which replica routing picks (gateway.models.routing), on snapshots: adapter residency first,
then the prefix's replica under the load bound, then the least loaded; a cold replica only when
none is started. And the scale-up rule (gateway.models.scale_up): a queue that lasts."""

from __future__ import annotations

import random

from gateway.models.routing import ReplicaView, choose, prefix_key, routing_key
from gateway.models.scale_up import QueueWatch, ScaleUpPolicy, queued_beyond_capacity


def _pool(*loads: int, resident: dict[int, set[str]] | None = None) -> list[ReplicaView]:
    resident = resident or {}
    return [
        ReplicaView(f"r{i}", True, load, frozenset(resident.get(i, ())), capacity=64)
        for i, load in enumerate(loads)
    ]


def test_a_replica_holding_the_adapter_wins_while_under_the_bound() -> None:
    pool = _pool(2, 3, 2, resident={1: {"a"}})  # 3 + 1 <= ceil(1.25 * (7 + 1) / 3)
    assert choose(pool, "a", None) == 1
    # Above 1.25x the mean (with this request): the adapter's replica passes it on.
    pool = _pool(2, 4, 2, resident={1: {"a"}})
    assert choose(pool, "a", None) != 1


def test_one_prefix_key_lands_on_one_replica_and_keys_spread() -> None:
    pool = _pool(0, 0, 0, 0)
    keys = [prefix_key(f"salt-{i}", None, list(range(16))) for i in range(200)]
    chosen = [choose(pool, None, key) for key in keys]
    assert chosen == [choose(pool, None, key) for key in keys]  # stable
    counts = [chosen.count(i) for i in range(4)]
    assert min(counts) > 25, counts  # rendezvous hashing spreads 200 keys over 4


def test_the_load_bound_moves_a_hot_key_to_the_next_replica_in_its_order() -> None:
    key = prefix_key("hot", None, list(range(16)))
    home = choose(_pool(0, 0, 0), None, key)
    assert home is not None
    loads = [2, 2, 2]
    loads[home] = 6  # above ceil(1.25 * (10 + 1) / 3) = 5
    moved = choose(_pool(*loads), None, key)
    assert moved is not None and moved != home


def test_removing_a_replica_moves_only_the_keys_it_held() -> None:
    pool = _pool(0, 0, 0, 0)
    keys = [prefix_key(f"k{i}", None, [i] * 16) for i in range(100)]
    before = [choose(pool, None, key) for key in keys]
    smaller = [v if v.name != "r2" else ReplicaView("r2", False, 0) for v in pool]
    after = [choose(smaller, None, key) for key in keys]
    moved = [k for k, (b, a) in enumerate(zip(before, after, strict=True)) if b != a]
    assert all(before[k] == 2 for k in moved)


def test_no_key_and_no_adapter_goes_to_the_least_loaded() -> None:
    assert choose(_pool(4, 1, 3), None, None) == 1
    assert choose(_pool(4, 1, 3), "not-resident", None) == 1


def test_unhealthy_replicas_are_skipped_and_none_left_is_none() -> None:
    pool = _pool(0, 0)
    down = [ReplicaView("r0", False, 0), pool[1]]
    assert choose(down, None, prefix_key(None, None, [1] * 16)) == 1
    assert choose([ReplicaView("r0", False, 0)], None, None) is None


def test_a_cold_replica_serves_only_when_none_is_started() -> None:
    """Routing never starts a replica beside a started one, however full: a lasting queue
    does (gateway.models.scale_up)."""
    cold = ReplicaView("r1", True, 0, cold=True, capacity=4)
    full = ReplicaView("r0", True, 9, capacity=4)
    assert choose([full, cold], None, None) == 0
    # Scaled to zero: the first request starts one.
    assert choose([ReplicaView("r0", True, 0, cold=True), cold], None, None) == 0
    assert choose([ReplicaView("r0", False, 0), cold], None, None) == 1


def test_a_queue_that_lasts_the_window_asks_for_a_start_and_one_that_breaks_does_not() -> None:
    watch = QueueWatch(ScaleUpPolicy(waiting=3, window=1.0))
    assert not watch.observe(3, 10.0)
    assert not watch.observe(5, 10.6)
    assert not watch.observe(2, 10.9)  # a break: the window begins again
    assert not watch.observe(4, 11.0)
    assert not watch.observe(4, 11.9)
    assert watch.observe(3, 12.0)
    assert not watch.observe(9, 12.1)  # after a start the window begins again
    assert watch.observe(9, 13.1)
    immediate = QueueWatch(ScaleUpPolicy(waiting=1, window=0.0))
    assert not immediate.observe(0, 1.0) and immediate.observe(1, 1.0)


def test_the_queue_counts_what_started_replicas_hold_beyond_what_they_run() -> None:
    views = [
        ReplicaView("r0", True, 7, capacity=4),  # 3 waiting
        ReplicaView("r1", True, 2, capacity=4),  # room: none waiting
        ReplicaView("r2", False, 9, capacity=4),  # down: not counted
        ReplicaView("r3", True, 0, cold=True, capacity=4),
    ]
    assert queued_beyond_capacity(views) == 3


def test_bounded_load_keeps_every_replica_within_the_bound_under_skewed_keys() -> None:
    """One key for most requests (a tenant's hot system prompt): no replica exceeds the bound
    of the pool's mean, counted as requests arrive and none finish."""
    rng = random.Random(0)
    loads = [0, 0, 0, 0]
    for n in range(400):
        key = prefix_key("hot" if rng.random() < 0.8 else f"k{n}", None, [1] * 16)
        views = [ReplicaView(f"r{i}", True, load, capacity=1 << 30) for i, load in enumerate(loads)]
        index = choose(views, None, key)
        assert index is not None
        loads[index] += 1
        assert max(loads) <= -(-1.25 * sum(loads) // 4) + 1, loads


def test_a_prompt_cache_key_is_its_tenants_alone() -> None:
    mine = routing_key("salt-a", None, "instructions-v1")
    assert mine == routing_key("salt-a", None, "instructions-v1")
    assert mine != routing_key("salt-b", None, "instructions-v1")  # another tenant
    assert mine != routing_key("salt-a", "adapter-1", "instructions-v1")
    assert mine != prefix_key("salt-a", None, [1, 2, 3])
