"""What each served model's engines are doing now, replica by replica: the admin REST's
/admin/engines and its adapters' `resident_on`. One read of every engine per call, the reads
/metrics makes (each engine's EngineStats and Scaling).

A replica is in one of four states, from what its engine object knows:

- `starting`: an engine on demand loading for the requests held for it; an engine process
  being replaced (health `starting` or `restarting`, also a remote engine's own word); a
  picker's address that answered no engine ready while requests are held for one.
- `ready`: up and taking requests.
- `idle`: up, but an engine that scales to zero (min_replicas 0) with nothing in flight or
  held and no request for at least half its idle_timeout: it stops within the other half
  unless called. Engines that never idle out (started with the server, a pool's first
  min_replicas, remote ones, a picker's) are never idle.
- `stopped`: no engine: one on demand not started yet or idled out, a process dead or
  shutting down, a remote engine not connected, a picker's address that answered no engine
  ready with nothing held. A stopped replica reports no load and no adapters (nothing runs
  there to hold them; a remote engine's last figures would be stale).

Replica ids are stable within a model: a remote engine's url, a picker's url, else the
replica's index in its pool ("0" for a model with one engine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from engine.frontend.client import EngineClient
from engine.messages import EngineStats
from gateway.models.on_demand import OnDemandEngine
from gateway.models.replica_pool import ReplicaPool
from gateway.models.served import ServedModels
from gateway.remote.picked_engine import PickedEngine
from gateway.remote.remote_engine import RemoteEngine

EngineState = Literal["starting", "ready", "idle", "stopped"]
Routing = Literal["local", "on_demand", "remote", "picker"]


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    id: str
    state: EngineState
    stats: EngineStats  # empty while stopped
    num_cold_starts: int


@dataclass(frozen=True, slots=True)
class ModelStatus:
    name: str
    routing: Routing
    num_held: int  # requests held for an engine to start
    num_cold_starts: int
    replicas: list[ReplicaStatus]


def model_statuses(models: ServedModels, now: float | None = None) -> list[ModelStatus]:
    """Every served model's engines, in the order they were configured; `now`: a
    time.monotonic() reading (the idle rule's clock)."""
    now = time.monotonic() if now is None else now
    statuses = []
    for model in models:
        counts = model.engine.scaling()
        statuses.append(
            ModelStatus(
                model.name,
                routing_of(model.engine),
                counts.num_held,
                counts.num_cold_starts,
                _replicas(model.engine, now),
            )
        )
    return statuses


def residency(statuses: list[ModelStatus]) -> dict[tuple[str, str], list[str]]:
    """(model, adapter weights' sha256) -> the ids of its replicas that hold them in a LoRA
    slot now. The engine keys adapters by that sha256 (engine.lora.types.LoRARequest)."""
    where: dict[tuple[str, str], list[str]] = {}
    for model in statuses:
        for replica in model.replicas:
            for sha in replica.stats.resident_adapter_ids:
                where.setdefault((model.name, sha), []).append(replica.id)
    return where


def routing_of(engine: EngineClient) -> Routing:
    """How a model's engines are reached: `picker` (one address that picks an engine per
    request), `remote` (`loragate engine`s linked to this gateway), `on_demand` (local engines,
    one or more of which start on a request and stop when idle), `local` (local engines started
    with the server)."""
    if isinstance(engine, PickedEngine):
        return "picker"
    replicas = engine.replicas if isinstance(engine, ReplicaPool) else [engine]
    if any(isinstance(r, RemoteEngine) for r in replicas):
        return "remote"
    if any(isinstance(r, OnDemandEngine) and r.policy.min_replicas == 0 for r in replicas):
        return "on_demand"
    return "local"


def replica_state(engine: EngineClient, now: float) -> EngineState:
    """One replica's state by the rule above."""
    if isinstance(engine, OnDemandEngine):
        return _on_demand_state(engine, now)
    if isinstance(engine, PickedEngine):
        if engine.health == "stopping":
            return "stopped"
        if engine.scaling().num_ready:
            return "ready"
        return "starting" if engine.num_held else "stopped"
    if isinstance(engine, RemoteEngine) and not engine.is_alive:
        return "stopped"  # not connected: whatever it was doing, it does not serve here
    return _state_of_health(engine.health)


def _on_demand_state(engine: OnDemandEngine, now: float) -> EngineState:
    if engine.health == "stopping":  # the server is shutting down
        return "stopped"
    if engine.is_starting:
        return "starting"
    client = engine.client
    if client is None:
        return "stopped"
    state = _state_of_health(client.health)
    policy = engine.policy
    if (
        state == "ready"
        and policy.min_replicas == 0
        and not (engine.num_in_flight or engine.num_held)
        and now - engine.last_used >= policy.idle_timeout / 2
    ):
        return "idle"
    return state


def _state_of_health(health: str) -> EngineState:
    if health == "ok":
        return "ready"
    if health in ("starting", "restarting"):
        return "starting"
    return "stopped"  # stopping, stopped, dead


def _replicas(engine: EngineClient, now: float) -> list[ReplicaStatus]:
    if isinstance(engine, ReplicaPool):
        return [
            _replica(name if isinstance(replica, RemoteEngine) else str(index), replica, now)
            for index, (replica, name) in enumerate(zip(engine.replicas, engine.names, strict=True))
        ]
    return [_replica(engine.url if isinstance(engine, PickedEngine) else "0", engine, now)]


def _replica(replica_id: str, engine: EngineClient, now: float) -> ReplicaStatus:
    state = replica_state(engine, now)
    stats = EngineStats() if state == "stopped" else engine.stats()
    return ReplicaStatus(replica_id, state, stats, engine.scaling().num_cold_starts)
