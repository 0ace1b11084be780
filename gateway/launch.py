"""Start a server from Settings: tenancy (database, keys, adapters), the engine, the app,
uvicorn; stop it in order."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from adapters.peft import describe_base
from adapters.peft_config import AdapterError
from adapters.registry import RegisteredLoader
from engine.async_engine import EngineClient
from engine.config import EngineConfig
from engine.lora_types import LoRARequest
from engine.spec_decode import SpeculativeConfig
from gateway.engine_on_demand import OnDemandEngine, ScalePolicy, model_facts
from gateway.models_file import ServedModelSpec, served_models
from gateway.served_models import ModelEngine
from gateway.settings import Settings, SettingsError, parse_bytes
from gateway.tenancy import DemoKey, Tenancy, open_tenancy, prepare
from tenants.adapter_rows import AdapterExists


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
        kernels=s.kernels,
        enable_lora=s.enable_lora,
        max_loras=s.max_loras,
        max_lora_rank=s.max_lora_rank,
        max_cpu_loras=s.max_cpu_loras,
        scheduling_policy=s.scheduling_policy,
        guided_compile_timeout=s.guided_compile_timeout,
        guided_cache_size=s.guided_cache_size,
        guided_max_schema_bytes=s.guided_max_schema_bytes,
        guided_max_schema_depth=s.guided_max_schema_depth,
    )


def lora_modules(settings: Settings) -> list[tuple[str, Path]]:
    modules = []
    for module in settings.lora_modules:
        name, sep, path = module.partition("=")
        if not sep or not name or not path:
            raise typer.BadParameter(
                f"expected name=path, got {module!r}", param_hint="--lora-modules"
            )
        modules.append((name, Path(path)))
    if modules and not settings.enable_lora:
        raise typer.BadParameter("--lora-modules needs --enable-lora", param_hint="--lora-modules")
    return modules


async def _start_up(
    tenancy: Tenancy, settings: Settings, modules: list[tuple[str, Path]]
) -> tuple[DemoKey | None, list[LoRARequest]]:
    """Database work before serving: the demo tenant, --lora-modules as public adapters (of
    the first served model, the one --model names)."""
    try:
        demo = await prepare(tenancy, settings)
        preload = []
        first = tenancy.catalog.model_names[0]
        for name, path in modules:
            try:
                row = await tenancy.catalog.add_local(
                    owner_id=None, name=name, path=path, base_model=first, replace=True
                )
            except (AdapterError, AdapterExists, ValueError, OSError) as exc:
                raise typer.BadParameter(f"{name}: {exc}", param_hint="--lora-modules") from exc
            preload.append(tenancy.catalog.request(row))
        return demo, preload
    finally:
        await tenancy.db.close()  # its connections belong to this loop, not uvicorn's


def start_engine(
    settings: Settings,
    loader: RegisteredLoader,
    preload: list[LoRARequest],
    with_progress: Callable[[Any], Any],
    tokenizer: Any = None,
) -> EngineClient:
    """One model's engine, started and loaded: its own process (the default), or a loop
    in this one. `preload`: adapters that fill its LoRA slots before the first request;
    `tokenizer`: the model's, loaded already (the engine process's side need not again)."""
    from engine import LLMEngine
    from engine.async_engine import AsyncEngine
    from engine.engine_process import EngineProcess, retain_freed_memory

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
) -> ModelEngine:
    """A model's engine as its entry asks: started now (min_replicas 1), or on its first
    request, stopped after idle_timeout (min_replicas 0: gateway.engine_on_demand)."""
    if spec.entry.min_replicas > 0:
        return start_engine(spec.settings, loader, preload, with_progress)
    # A dead engine is replaced on the model's next request, not by the process itself.
    settings = spec.settings.model_copy(update={"restart_engine": False})
    facts = model_facts(settings.model, settings.max_model_len)
    return OnDemandEngine(
        spec.name,
        lambda: start_engine(settings, loader, preload, _without_progress, facts.tokenizer),
        facts,
        ScalePolicy(
            min_replicas=0,
            idle_timeout=spec.entry.idle_timeout,
            max_pending=settings.max_pending_per_model,
            cold_start_timeout=settings.cold_start_timeout,
        ),
    )


def _without_progress(load: Callable[[Any], Any]) -> Any:
    return load(None)


def run_server(settings: Settings, with_progress: Callable[[Any], Any]) -> None:
    import uvicorn

    from gateway.app import build_app
    from gateway.request_limits import RequestLimits

    modules = lora_modules(settings)
    try:
        specs = served_models(settings)
        first = specs[0]
        bases = {s.name: describe_base(s.settings.model, extra_names=[s.name]) for s in specs}
        tenancy = open_tenancy(settings, bases)
    except SettingsError as exc:
        raise typer.BadParameter(str(exc)) from exc
    demo, preload = asyncio.run(_start_up(tenancy, settings, modules))
    engines: dict[str, ModelEngine] = {}
    for spec in specs:
        if spec.entry.min_replicas == 0:
            typer.echo(f"{spec.name!r} scales to zero: its engine starts on its first request")
        elif len(specs) > 1:
            typer.echo(f"loading {spec.name!r} from {spec.entry.path}")
        engines[spec.name] = model_engine(
            spec,
            tenancy.catalog.loader(spec.name),
            preload if spec is first else [],
            with_progress,
        )
    app = build_app(
        engines,
        tenancy,
        max_body_bytes=settings.max_body_bytes,
        enable_lora=settings.enable_lora,
        allow_runtime_lora_updating=settings.allow_runtime_lora_updating and settings.enable_lora,
        limits=RequestLimits(max_n=settings.max_n, max_prompt_chars=settings.max_prompt_chars),
        metrics_max_tenants=settings.metrics_max_tenants,
        tool_call_parser=settings.tool_call_parser if settings.enable_auto_tool_choice else None,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: object):  # type: ignore[no-untyped-def]
        await tenancy.start()  # in uvicorn's loop, which the tenancy's connections belong to
        yield
        await asyncio.gather(*(e.shutdown(settings.shutdown_grace) for e in engines.values()))
        await tenancy.close()

    app.router.lifespan_context = lifespan
    for module_name, path in modules:
        typer.echo(f"public adapter {module_name!r} from {path}")
    if demo is not None:
        typer.echo(
            f"\nCreated tenant {demo.tenant!r}. Its API key, shown this once:\n\n"
            f"    export LORAGATE_API_KEY={demo.key}\n"
        )
    if not settings.auth:
        typer.echo("--no-auth: every request runs as tenant 'demo'")
    names = ", ".join(repr(name) for name in engines)
    typer.echo(f"serving {names} on http://{settings.host}:{settings.port}/v1")
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=int(settings.shutdown_grace),
    )
