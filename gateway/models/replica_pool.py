"""A model served by several engines: `loragate engine`s named in the models file's `urls`, or
local engines up to `max_replicas`, behind the gateway's one engine interface.

Each request goes where gateway.models.routing says, from what the pool knows now: each
replica's health, its load (the larger of what the pool has in flight there and what the
engine last reported, which counts other gateways' requests too; at most STATE_INTERVAL old),
and the adapters in its slots. A replica that fails leaves the rotation at once (its health
says so) and returns when it answers again. A request a replica refused before its first token
(dead, or its queue full) goes to the next one; one that had started ends with the 503 its
engine's death raised, and its usage row holds what it produced.

When no replica is up (engines elsewhere scaled to zero, as KEDA does on Kubernetes, or all
restarting), a pool given a HoldPolicy holds requests as a model starting on demand does:
at most `max_pending`, each for at most `timeout` seconds, then a 503 with Retry-After. They
count in `num_held`, hence in `loragate:model_pending_requests`: the signal that wakes the
engines from zero, since an engine that is not running exports nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from engine.errors import EngineDead, EngineOverloaded
from engine.frontend.client import EngineClient, Scaling
from engine.frontend.facts import EngineFacts
from engine.frontend.loop_client import LoopClient
from engine.messages import EngineRequest, EngineStats
from engine.outputs import SequenceUpdate
from engine.request import GuidedSpec
from gateway.models.on_demand import OnDemandEngine
from gateway.models.routing import ReplicaView, choose, prefix_key, routing_key
from gateway.models.scale_up import QueueWatch, ScaleUpPolicy, queued_beyond_capacity

logger = logging.getLogger(__name__)

POLICIES = ("affinity", "least_loaded", "round_robin")
HOLD_POLL = 0.05  # seconds between looks for a replica come up (their links run on threads)


@dataclass(frozen=True, slots=True)
class HoldPolicy:
    """Requests held while no replica is up."""

    max_pending: int = 256
    timeout: float = 60.0  # seconds
    scale_to_zero: bool = False  # no replica up is a state, not a failure (health stays ok)


@dataclass(frozen=True, slots=True)
class PoolRouting:
    """How the pool picks a replica: `policy` (one of POLICIES), and for affinity the prompt's
    first `block_size` tokens (the engines' KV block), the prefix the key is made of."""

    block_size: int
    policy: str = "affinity"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing is one of {', '.join(POLICIES)}, not {self.policy!r}")


# A pool's replica: a `loragate engine` elsewhere (gateway.remote's RemoteEngine), or a local
# engine started on demand.
Replica = LoopClient | OnDemandEngine


class ReplicaPool(EngineClient):
    """One model's replicas, as one engine."""

    def __init__(
        self,
        name: str,
        replicas: Sequence[Replica],
        names: Sequence[str],
        routing: PoolRouting,
        hold: HoldPolicy | None = None,
        scale_up: ScaleUpPolicy | None = None,
    ) -> None:
        """`scale_up`: local replicas not running start when the others' queue lasts
        (gateway.models.scale_up)."""
        if not replicas:
            raise ValueError("a pool has at least one replica")
        self.name = name
        self.policy = routing.policy
        self._turn = 0  # round_robin's next replica
        self.replicas = list(replicas)
        self.names = list(names)
        self.block_size = routing.block_size
        self.in_flight = [0] * len(replicas)
        self.routed = [0] * len(replicas)  # requests sent to each, for tests and benchmarks
        self.hold = hold
        self._held = 0  # requests waiting for any replica to come up
        self.scale_up = scale_up
        self._watch: asyncio.Task[None] | None = None
        self.num_scale_ups = 0

    # -- what the gateway reads --------------------------------------------------------------

    @property
    def facts(self) -> EngineFacts:
        return self.replicas[0].facts  # one model: the same facts

    @property
    def health(self) -> str:
        """ok while any replica serves (or may all be down: scaled to zero); else the first
        one's state."""
        states = [r.health for r in self.replicas]
        scaled_to_zero = self.hold is not None and self.hold.scale_to_zero
        return "ok" if "ok" in states or scaled_to_zero else states[0]

    def scaling(self) -> Scaling:
        """The replicas' figures summed, and the requests the pool holds for any."""
        each = [r.scaling() for r in self.replicas]
        return Scaling(
            sum(s.num_ready for s in each),
            sum(s.num_cold_starts for s in each),
            self._held + sum(s.num_held for s in each),
        )

    def stats(self) -> EngineStats:
        """The pool as one engine: counts summed, KV usage averaged, adapters joined."""
        each = [r.stats() for r in self.replicas]
        total = EngineStats()
        for field in (
            "num_running",
            "num_waiting",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "num_preemptions",
            "num_failed_requests",
            "num_yielded_steps",
            "lora_slots_used",
            "lora_disk_loads",
            "lora_evictions",
            "num_kv_blocks",
        ):
            setattr(total, field, sum(getattr(s, field) for s in each))
        total.block_size = max(s.block_size for s in each)  # one model: one block size
        total.kv_cache_usage = sum(s.kv_cache_usage for s in each) / len(each)
        total.lora_pool_usage = sum(s.lora_pool_usage for s in each) / len(each)
        loras = [s.max_loras for s in each if s.max_loras is not None]
        total.max_loras = sum(loras) if loras else None
        total.running_adapters = sorted({a for s in each for a in s.running_adapters})
        total.waiting_adapters = sorted({a for s in each for a in s.waiting_adapters})
        total.resident_adapter_ids = sorted({a for s in each for a in s.resident_adapter_ids})
        total.cached_adapter_ids = sorted({a for s in each for a in s.cached_adapter_ids})
        drafts = [s.spec_decode for s in each if s.spec_decode is not None]
        if drafts:
            total.spec_decode = (
                sum(d[0] for d in drafts),
                sum(d[1] for d in drafts),
                sum(d[2] for d in drafts),
            )
        return total

    # -- requests ------------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[SequenceUpdate]:
        if self.scale_up is not None and self._watch is None:
            self._watch = asyncio.create_task(self._watch_queue(self.scale_up))
        key = self._prefix_key(request)
        adapter = request.lora.adapter_id if request.lora is not None else None
        tried: set[int] = set()
        while True:
            index = self._choose(adapter, key, tried)
            if index is None and not tried and self.hold is not None:
                await self._wait_for_a_replica(self.hold)
                index = self._choose(adapter, key, tried)
            if index is None:
                raise EngineDead(f"no replica of {self.name!r} is serving")
            tried.add(index)
            self.in_flight[index] += 1
            self.routed[index] += 1
            started = False
            try:
                async for update in self.replicas[index].generate(request):
                    started = True
                    yield update
                return
            except (EngineDead, EngineOverloaded):
                if started or len(tried) == len(self.replicas):
                    raise
            finally:
                self.in_flight[index] -= 1

    async def _wait_for_a_replica(self, hold: HoldPolicy) -> None:
        if self._held >= hold.max_pending:
            raise EngineOverloaded(
                f"no replica of {self.name!r} is up and {self._held} requests wait for one"
            )
        self._held += 1
        deadline = time.monotonic() + hold.timeout
        try:
            while not any(r.health == "ok" for r in self.replicas):
                if time.monotonic() >= deadline:
                    raise EngineOverloaded(
                        f"no replica of {self.name!r} came up within {hold.timeout:g} s"
                    )
                await asyncio.sleep(HOLD_POLL)
        finally:
            self._held -= 1

    async def compile_grammar(self, spec: GuidedSpec) -> None:
        # The replica is chosen as the request is sent, by its prompt and adapter: ask the one a
        # request without either would go to. A request sent elsewhere has its grammar
        # compiled there as it arrives (an engine elsewhere checks it before running it).
        index = choose(self.views(), None, None)
        await self.replicas[0 if index is None else index].compile_grammar(spec)

    def unload_lora(self, adapter_id: str) -> None:
        for replica in self.replicas:
            replica.unload_lora(adapter_id)

    async def shutdown(self, grace_period: float = 10.0) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await asyncio.gather(*(r.shutdown(grace_period) for r in self.replicas))

    # -- scale-up ------------------------------------------------------------------------------

    async def _watch_queue(self, policy: ScaleUpPolicy) -> None:
        """Start the next replica not running whenever the others' queue has lasted."""
        watch = QueueWatch(policy)
        while True:
            await asyncio.sleep(policy.poll)
            views = self.views()
            if not watch.observe(queued_beyond_capacity(views), time.monotonic()):
                continue
            cold = [i for i, v in enumerate(views) if v.healthy and v.cold]
            local = [r for r in self.replicas if isinstance(r, OnDemandEngine)]
            if cold and not any(r.is_starting for r in local):
                index = cold[0]
                replica = self.replicas[index]
                assert isinstance(replica, OnDemandEngine)  # cold: a local replica not running
                logger.info(
                    "%r: %d requests waited beyond its replicas for %.1f s; starting %s",
                    self.name, queued_beyond_capacity(views), policy.window, self.names[index],
                )  # fmt: skip
                self.num_scale_ups += 1
                replica.wake()

    # -- routing -------------------------------------------------------------------------------

    def views(self) -> list[ReplicaView]:
        views = []
        for i, replica in enumerate(self.replicas):
            stats = replica.stats()
            # A local replica not running; one elsewhere is the engine's own to start.
            cold = isinstance(replica, OnDemandEngine) and replica.scaling().num_ready == 0
            views.append(
                ReplicaView(
                    name=self.names[i],
                    healthy=replica.health == "ok",
                    load=max(self.in_flight[i], stats.num_running + stats.num_waiting),
                    # In a slot, or in CPU memory: a slot's load from there is a copy.
                    resident=frozenset(stats.resident_adapter_ids + stats.cached_adapter_ids),
                    cold=cold,
                    capacity=replica.max_num_seqs or 1 << 30,
                )
            )
        return views

    def _choose(self, adapter: str | None, key: bytes | None, tried: set[int]) -> int | None:
        views = [v if i not in tried else _out_of_rotation(v) for i, v in enumerate(self.views())]
        if self.policy == "affinity":
            return choose(views, adapter, key)
        if self.policy == "least_loaded":
            return choose(views, None, None)
        for _ in range(len(views)):  # round_robin: the next healthy one
            index, self._turn = self._turn, (self._turn + 1) % len(views)
            if views[index].healthy:
                return index
        return None

    def _prefix_key(self, request: EngineRequest) -> bytes | None:
        adapter = request.lora.adapter_id if request.lora is not None else None
        if request.routing_key is not None:
            return routing_key(request.cache_salt, adapter, request.routing_key)
        prompt = request.prompt
        if isinstance(prompt, str) or len(prompt) < self.block_size:
            return None  # no full block: nothing cached to be near
        return prefix_key(request.cache_salt, adapter, prompt[: self.block_size])


def _out_of_rotation(view: ReplicaView) -> ReplicaView:
    return ReplicaView(view.name, False, view.load, view.resident, view.cold, view.capacity)
