"""Each served model's engine, as its models-file entry asks: one engine process started with
the server, one started on its first request (gateway.models.on_demand), several local replicas
up to max_replicas, or the `loragate engine`s its `urls` name (gateway.remote), the latter two
behind a routing pool (gateway.models.replica_pool); or, with `routing: picker`, an inference
gateway at its one url that picks an engine per request (gateway.remote.picked_engine)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from adapters.registry import RegisteredLoader
from engine.config import EngineConfig
from engine.engine_client import EngineClient
from engine.engine_facts import EngineFacts
from engine.loop_client import LoopClient
from engine.lora_types import LoRARequest
from engine.spec_decode import SpeculativeConfig
from engine.warm_spare import SparePool, start_heap_bytes
from engine.zygote import Zygote
from gateway.models.models_file import ServedModelSpec
from gateway.models.on_demand import OnDemandEngine, ScalePolicy
from gateway.models.replica_pool import HoldPolicy, Replica, ReplicaPool
from gateway.models.scale_up import ScaleUpPolicy
from gateway.remote.picked_engine import PickedEngine
from gateway.remote.remote_engine import CONNECT_TIMEOUT, RemoteEngine
from gateway.settings import Settings, parse_bytes


def engine_config(settings: Settings) -> EngineConfig:
    # With the engine in its own process, decode steps leave one core to the HTTP side
    # (vLLM-CPU reserves one the same way); prefills, which the streams wait on, take all.
    cores = len(os.sched_getaffinity(0))
    threads = (max(1, cores - 1), cores) if settings.engine_process else (None, None)
    s = settings
    return EngineConfig(
        model=s.model,
        dtype=s.dtype,
        quantization=s.quantization,
        speculative_config=(
            None if s.speculative_config is None else SpeculativeConfig.parse(s.speculative_config)
        ),
        device=s.device,
        max_model_len=s.max_model_len,
        block_size=s.block_size,
        kv_cache_memory=parse_bytes(s.kv_cache_memory) if s.kv_cache_memory else None,
        memory_utilization=s.memory_utilization,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        enable_prefix_caching=s.enable_prefix_caching,
        enable_chunked_prefill=s.enable_chunked_prefill,
        seed=s.seed,
        num_threads=s.num_threads or threads[0],
        prefill_threads=s.prefill_threads or threads[1],
        cpu_kernels=s.cpu_kernels,
        weights_cache_dir=s.weights_cache_dir,
        kernels=s.kernels,
        enable_lora=s.enable_lora,
        max_loras=s.max_loras,
        max_lora_rank=s.max_lora_rank,
        max_cpu_loras=s.max_cpu_loras,
        lora_memory=parse_bytes(s.lora_memory) if s.lora_memory else None,
        scheduling_policy=s.scheduling_policy,
        fair_delay_ratio=s.fair_delay_ratio,
        guided_compile_timeout=s.guided_compile_timeout,
        guided_cache_size=s.guided_cache_size,
        guided_max_schema_bytes=s.guided_max_schema_bytes,
        guided_max_schema_depth=s.guided_max_schema_depth,
    )


def start_engine(
    settings: Settings,
    loader: RegisteredLoader,
    preload: list[LoRARequest],
    with_progress: Callable[[Any], Any],
    tokenizer: Any = None,
    spares: SparePool | None = None,
    zygote: Zygote | None = None,
) -> LoopClient:
    """One model's engine, started and loaded: its own process (the default), or a loop
    in this one. `preload`: adapters that fill its LoRA slots before the first request;
    `tokenizer`: the model's, loaded already (the engine process's side need not again);
    `spares`: warm processes to start it in (engine.warm_spare); `zygote`: the process to fork
    it from (engine.zygote)."""
    from engine import LLMEngine
    from engine.async_engine import AsyncEngine
    from engine.engine_process import EngineProcess
    from engine.heap import retain_freed_memory

    config = engine_config(settings)
    preload = preload[: settings.max_loras] if settings.enable_lora else []
    if settings.engine_process:
        process = EngineProcess(
            config,
            lora_loader=loader,
            preload=preload,
            max_waiting=settings.max_waiting,
            restart=settings.restart_engine,
            tokenizer=tokenizer,
            spares=spares,
            zygote=zygote,
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
    spec: ServedModelSpec,
    loader: RegisteredLoader,
    preload: list[LoRARequest],
    with_progress: Callable[[Any], Any],
    spares: SparePool | None = None,
    zygote: Zygote | None = None,
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
        return start_engine(settings, loader, preload, with_progress, zygote=zygote)
    facts = EngineFacts.read(settings.model, settings.max_model_len)
    replicas: list[Replica] = []
    for index in range(entry.max_replicas):
        always_on = index < entry.min_replicas
        replica = _on_demand(spec, index, always_on, loader, preload, facts, spares, zygote)
        if always_on:
            replica.start_now()
        replicas.append(replica)
    if len(replicas) == 1:
        return replicas[0]
    names = [f"{spec.name}/{i}" for i in range(len(replicas))]
    scale_up = ScaleUpPolicy(entry.scale_up_waiting, entry.scale_up_window)
    return ReplicaPool(
        spec.name, replicas, names, settings.block_size, settings.routing, scale_up=scale_up
    )


def _on_demand(
    spec: ServedModelSpec,
    index: int,
    always_on: bool,
    loader: RegisteredLoader,
    preload: list[LoRARequest],
    facts: EngineFacts,
    spares: SparePool | None,
    zygote: Zygote | None,
) -> OnDemandEngine:
    # A replica on demand is replaced on the model's next request, not by its process.
    restart = always_on and spec.settings.restart_engine
    settings = spec.settings.model_copy(update={"restart_engine": restart})
    name = spec.name if spec.entry.max_replicas == 1 else f"{spec.name}/{index}"
    return OnDemandEngine(
        name,
        lambda: start_engine(
            settings, loader, preload, _without_progress, facts.tokenizer, spares, zygote
        ),
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
        engine_config(settings),
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
    return ReplicaPool(
        spec.name, replicas, urls, settings.block_size, settings.routing, hold_policy(spec)
    )


def _without_progress(load: Callable[[Any], Any]) -> Any:
    return load(None)
