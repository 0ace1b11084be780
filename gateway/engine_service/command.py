"""`loragate engine`: start one engine from Settings and serve it (gateway.engine_service.server)
until SIGTERM, then drain it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from gateway.settings import Settings, SettingsError

# The flags `loragate engine` takes: the model, its engine's knobs, LoRA, where it listens.
ENGINE_COMMAND_FIELDS = (
    "model",
    "cpu_isa",
    "served_model_name",
    "engine_token",
    "adapter_store",
    "enable_lora",
    "max_lora_rank",
    "host",
    "port",
    "shutdown_grace",
    "max_body_bytes",
    "zygote",
)


def run_engine_server(settings: Settings, with_progress: Callable[[Any], Any]) -> None:
    import uvicorn

    from adapters.peft import describe_base
    from adapters.registry import RegisteredLoader
    from adapters.store import open_adapter_store
    from engine.frontend.zygote import Zygote
    from engine.heap import freeze_startup_objects
    from gateway.engine_service.app import build_engine_app
    from gateway.engine_service.server import EngineService
    from gateway.models.engines import EngineStart, start_engine

    try:
        settings.check_engine_token()
    except SettingsError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if "engine_process" not in settings.model_fields_set:
        # Its HTTP side carries one message per step (no SSE, no tokenizing): the loop runs
        # in this process unless told otherwise, a hop fewer (bench remote-hop measures it).
        settings = settings.model_copy(update={"engine_process": False})
    name = settings.served_model_name or Path(settings.model).resolve().name
    loader = RegisteredLoader(describe_base(settings.model), settings.max_lora_rank)
    # An engine process is restarted when it dies: from a zygote, in a fraction of a second
    # rather than the seconds of a spawn and its imports.
    zygote = None
    if settings.engine_process and settings.zygote:
        zygote = Zygote([settings.model])
        zygote.start()
    try:
        engine = start_engine(settings, EngineStart(loader, zygote=zygote), with_progress)
    except BaseException:
        if zygote is not None:
            zygote.close()
        raise
    token = settings.engine_token
    service = EngineService(
        name,
        engine,
        store=open_adapter_store(settings.adapter_store) if settings.enable_lora else None,
        token=None if token is None else token.get_secret_value(),
        block_size=settings.block_size,
    )
    app = build_engine_app(service, settings.max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(_: object):  # type: ignore[no-untyped-def]
        yield
        await engine.shutdown(settings.shutdown_grace)
        if zygote is not None:
            zygote.close()

    app.router.lifespan_context = lifespan
    typer.echo(f"engine {name!r} on ws://{settings.host}:{settings.port}/internal/v1/engine")
    freeze_startup_objects()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=int(settings.shutdown_grace),
    )
