"""Each served model's engine, as its models-file entry asks: one engine process started with
the server, one started on its first request (gateway.models.on_demand), several local replicas
up to max_replicas, or the `loragate engine`s its `urls` name (gateway.remote), the latter two
behind a routing pool (gateway.models.replica_pool); or, with `routing: picker`, an inference
gateway at its one url that picks an engine per request (gateway.remote.picked_engine)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from adapters.registry import RegisteredLoader
from engine.frontend.client import EngineClient
from engine.frontend.facts import EngineFacts
from engine.frontend.loop_client import LoopClient
from engine.frontend.warm_spare import SparePool, start_heap_bytes
from engine.frontend.zygote import Zygote
from engine.lora.types import LoRARequest
from gateway.models.engine_knobs import engine_config
from gateway.models.models_file import ServedModelSpec
from gateway.models.on_demand import OnDemandEngine, ScalePolicy
from gateway.models.replica_pool import HoldPolicy, PoolRouting, Replica, ReplicaPool
from gateway.models.scale_up import ScaleUpPolicy
from gateway.remote.picked_engine import PickedEngine
from gateway.remote.remote_engine import CONNECT_TIMEOUT, RemoteEngine
from gateway.settings import Settings, parse_bytes


@dataclass(frozen=True, slots=True)
class EngineStart:
    """What a model's local engines start with besides its settings: the adapters' loader, the
    adapters that fill the LoRA slots before the first request, and where an engine process
    comes from (warm spares, engine.frontend.warm_spare; the zygote it forks from,
    engine.frontend.zygote)."""

    loader: RegisteredLoader
    preload: list[LoRARequest] = field(default_factory=list)
    spares: SparePool | None = None
    zygote: Zygote | None = None


def start_engine(
    settings: Settings,
    start: EngineStart,
    with_progress: Callable[[Any], Any],
    tokenizer: Any = None,
) -> LoopClient:
    """One model's engine, started and loaded: its own process (the default), or a loop
    in this one. `tokenizer`: the model's, loaded already (the engine process's side need not
    again)."""
    from engine import LLMEngine
    from engine.frontend.async_engine import AsyncEngine
    from engine.frontend.engine_process import RESTART, EngineProcess, ProcessStart
    from engine.heap import retain_freed_memory

    config, loader = engine_config(settings), start.loader
    preload = start.preload[: settings.max_loras] if settings.enable_lora else []
    if settings.engine_process:
        process = EngineProcess(
            config,
            start=ProcessStart(loader, preload, start.spares, start.zygote),
            max_waiting=settings.max_waiting,
            restart=RESTART if settings.restart_engine else None,
            tokenizer=tokenizer,
        )
        with_progress(process.start)
        return process
    retain_freed_memory()
    core = with_progress(lambda progress: LLMEngine(config, progress, loader))
    if core.lora is not None:
        for lora in preload:
            core.lora.load_now(lora)
    engine = AsyncEngine(core, max_waiting=settings.max_waiting)
    engine.start()
    return engine


def model_engine(
    spec: ServedModelSpec, start: EngineStart, with_progress: Callable[[Any], Any]
) -> EngineClient:
    """A model's engine as its entry asks: the engines at its urls; else one local engine,
    started now (min_replicas 1) or on its first request and stopped after idle_timeout
    (min_replicas 0); else (max_replicas above 1) a pool of local ones."""
    entry, settings = spec.entry, spec.settings
    if entry.urls and spec.settings.routing == "picker":
        return picked_engine(spec)
    if entry.urls:
        return remote_pool(spec)
    if entry.max_replicas == 1 and entry.min_replicas == 1:
        # Started with the server: the warm spares are for engines started later.
        return start_engine(settings, replace(start, spares=None), with_progress)
    facts = EngineFacts.read(settings.model, settings.max_model_len)
    replicas: list[Replica] = []
    for index in range(entry.max_replicas):
        replica = _on_demand(spec, index, start, facts)
        if replica.policy.min_replicas:
            replica.start_now()
        replicas.append(replica)
    if len(replicas) == 1:
        return replicas[0]
    names = [f"{spec.name}/{i}" for i in range(len(replicas))]
    scale_up = ScaleUpPolicy(entry.scale_up_waiting, entry.scale_up_window)
    routing = PoolRouting(settings.block_size, settings.routing)
    return ReplicaPool(spec.name, replicas, names, routing, scale_up=scale_up)


def _on_demand(
    spec: ServedModelSpec, index: int, start: EngineStart, facts: EngineFacts
) -> OnDemandEngine:
    """The pool's replica `index`: the first min_replicas always on, the rest on demand."""
    always_on = index < spec.entry.min_replicas
    # A replica on demand is replaced on the model's next request, not by its process.
    restart = always_on and spec.settings.restart_engine
    settings = spec.settings.model_copy(update={"restart_engine": restart})
    name = spec.name if spec.entry.max_replicas == 1 else f"{spec.name}/{index}"
    return OnDemandEngine(
        name,
        lambda: start_engine(settings, start, _without_progress, facts.tokenizer),
        facts,
        ScalePolicy(
            min_replicas=int(always_on),
            idle_timeout=spec.entry.idle_timeout,
            max_pending=settings.max_pending_per_model,
            cold_start_timeout=settings.cold_start_timeout,
        ),
        max_num_seqs=settings.max_num_seqs,
    )


def engine_zygote(specs: list[ServedModelSpec]) -> Zygote | None:
    """The zygote the models' local engine processes fork from (started: it imports in the
    background); None where none is a local process or --no-zygote."""
    local = [
        s for s in specs if not s.entry.urls and s.settings.engine_process and s.settings.zygote
    ]
    if not local:
        return None
    zygote = Zygote([s.settings.model for s in local])
    zygote.start()
    return zygote


def spare_pool(
    specs: list[ServedModelSpec], size: int, memory: str = "auto", zygote: Zygote | None = None
) -> SparePool | None:
    """Warm spares (not started: start() once the engines that start with the server have
    loaded, or a spare's imports slow theirs) where a model's engine processes start on demand
    (a replica above min_replicas); None where every engine starts with the server, runs in
    this process or lives elsewhere. `memory`: the heap each faults in ahead (a size, or auto:
    what the largest of those models writes as it starts, up to engine.heap's cap); `zygote`:
    spares are forked from it (ready in a fraction of a second), else spawned."""
    on_demand = [
        s
        for s in specs
        if s.entry.max_replicas > s.entry.min_replicas
        and not s.entry.urls
        and s.settings.engine_process
    ]
    if size <= 0 or not on_demand:
        return None
    configs = [engine_config(s.settings) for s in on_demand]
    if memory == "auto":
        heap_bytes = max(start_heap_bytes(config) for config in configs)
    else:
        heap_bytes = parse_bytes(memory)
    return SparePool(size, heap_bytes, configs, zygote=zygote)


def hold_policy(spec: ServedModelSpec) -> HoldPolicy:
    """How requests wait for engines elsewhere while none is up."""
    return HoldPolicy(
        max_pending=spec.settings.max_pending_per_model,
        timeout=spec.settings.cold_start_timeout,
        scale_to_zero=spec.entry.min_replicas == 0,
    )


def picked_engine(spec: ServedModelSpec) -> PickedEngine:
    """The engines behind the entry's one url, an inference gateway that picks per request."""
    settings = spec.settings
    facts = EngineFacts.read(settings.model, settings.max_model_len)
    token = settings.engine_token
    return PickedEngine(
        spec.name,
        spec.entry.urls[0],
        facts=facts,
        hold=hold_policy(spec),
        token=None if token is None else token.get_secret_value(),
    )


def remote_pool(spec: ServedModelSpec) -> ReplicaPool:
    """The `loragate engine`s at the entry's urls, connected (each retried in the background
    until it answers; a replica not up is out of rotation)."""
    settings = spec.settings
    facts = EngineFacts.read(settings.model, settings.max_model_len)
    token = settings.engine_token
    replicas = [
        RemoteEngine(
            url,
            engine_config(settings),
            facts=facts,
            token=None if token is None else token.get_secret_value(),
            max_waiting=settings.max_waiting,
        )
        for url in spec.entry.urls
    ]
    for replica in replicas:
        replica.start(wait=0)
    # Engines scaled to zero need not answer at start; others get a moment to.
    deadline = time.monotonic() + (CONNECT_TIMEOUT if spec.entry.min_replicas else 0.0)
    while time.monotonic() < deadline and not all(r.is_alive for r in replicas):
        time.sleep(0.05)
    urls = spec.entry.urls
    routing = PoolRouting(settings.block_size, settings.routing)
    return ReplicaPool(spec.name, replicas, urls, routing, hold_policy(spec))


def _without_progress(load: Callable[[Any], Any]) -> Any:
    return load(None)
