"""Start a server from Settings: tenancy (database, keys, adapters), the engine, the app,
uvicorn; stop it in order."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from adapters.peft import describe_base
from adapters.peft_config import AdapterError
from engine.frontend.client import EngineClient
from engine.heap import freeze_startup_objects
from engine.lora.types import LoRARequest
from gateway.console.oauth import ConsoleOAuth
from gateway.models.engines import EngineStart, engine_zygote, model_engine, spare_pool
from gateway.models.models_file import served_models
from gateway.settings import Settings, SettingsError
from gateway.tenancy.state import DemoKey, Tenancy, open_tenancy, prepare
from tenants.adapter_rows import AdapterExists


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
                row = await tenancy.catalog.put_local(
                    owner_id=None, name=name, path=path, base_model=first
                )
            except (AdapterError, AdapterExists, ValueError, OSError) as exc:
                raise typer.BadParameter(f"{name}: {exc}", param_hint="--lora-modules") from exc
            preload.append(tenancy.catalog.request(row))
        return demo, preload
    finally:
        await tenancy.db.close()  # its connections belong to this loop, not uvicorn's


def run_server(settings: Settings, with_progress: Callable[[Any], Any]) -> None:
    import uvicorn

    from gateway.app import AppOptions, build_app

    modules = lora_modules(settings)
    try:
        specs = served_models(settings)
        first = specs[0]
        bases = {s.name: describe_base(s.settings.model, extra_names=[s.name]) for s in specs}
        tenancy = open_tenancy(settings, bases)
        console_oauth = ConsoleOAuth.from_settings(settings)
    except SettingsError as exc:
        raise typer.BadParameter(str(exc)) from exc
    demo, preload = asyncio.run(_start_up(tenancy, settings, modules))
    engines: dict[str, EngineClient] = {}
    zygote = engine_zygote(specs)
    spares = spare_pool(specs, settings.spare_engines, settings.spare_engine_memory, zygote)
    for spec in specs:
        if spec.entry.min_replicas == 0:
            typer.echo(f"{spec.name!r} scales to zero: its engine starts on its first request")
        elif len(specs) > 1:
            typer.echo(f"loading {spec.name!r} from {spec.entry.path}")
        loader = tenancy.catalog.loader(spec.name)
        start = EngineStart(loader, preload if spec is first else [], spares, zygote)
        engines[spec.name] = model_engine(spec, start, with_progress)
    if spares is not None:
        spares.start()  # the engines that start with the server have loaded
    app = build_app(engines, tenancy, AppOptions.from_settings(settings, console_oauth))

    @contextlib.asynccontextmanager
    async def lifespan(_: object):  # type: ignore[no-untyped-def]
        await tenancy.start()  # in uvicorn's loop, which the tenancy's connections belong to
        yield
        if app.state.batch_runner is not None:  # its lines aborted and given back, engines up
            await app.state.batch_runner.close()
        if app.state.responses is not None:  # background responses end cancelled, recorded
            await app.state.responses.shutdown()
        await asyncio.gather(*(e.shutdown(settings.shutdown_grace) for e in engines.values()))
        if spares is not None:
            await asyncio.to_thread(spares.close)  # up to seconds per spare
        if zygote is not None:
            zygote.close()
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
    freeze_startup_objects()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=int(settings.shutdown_grace),
    )
