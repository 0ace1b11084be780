"""Build the FastAPI app around the served models' engines (gateway.models.served) and the
tenancy objects."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass

from fastapi import FastAPI

from engine.frontend.client import EngineClient
from gateway.console.headers import PATH_HEADERS as CONSOLE_HEADERS
from gateway.console.oauth import ConsoleOAuth
from gateway.console.routes import install_console
from gateway.http.edge import Edge
from gateway.http.errors import install_error_handlers
from gateway.http.request_limits import RequestLimits
from gateway.metrics import Metrics
from gateway.models.served import ServedModels
from gateway.openai.batches import routes as batches_routes
from gateway.openai.batches.finalize import Finisher
from gateway.openai.batches.lines import LineRunner
from gateway.openai.batches.runner import BatchRunner, RunnerOptions, TenantLookup, worker_id
from gateway.openai.batches.serving import BatchesServing, BatchPolicy
from gateway.openai.conversations import routes as conversations_routes
from gateway.openai.conversations.serving import ConversationsServing
from gateway.openai.files import routes as files_routes
from gateway.openai.files.serving import FileLimits, FilesServing
from gateway.openai.responses import routes as responses_routes
from gateway.openai.responses import websocket as responses_socket
from gateway.openai.responses.compaction import Compactor, CompactPolicy
from gateway.openai.responses.serving import ResponsesServing
from gateway.openai.routes import health_router, router
from gateway.openai.serving import OpenAIServing
from gateway.routers import admin, admin_adapters, admin_batches, admin_engines, lora, usage
from gateway.settings import Settings
from gateway.tenancy.admission import Admission
from gateway.tenancy.state import Tenancy

ADAPTER_UPLOADS = "/admin/adapters"
FILE_UPLOADS = "/v1/files"
# A file upload's bytes besides the file's own: the form's boundaries, headers and purpose.
FORM_OVERHEAD = 64 << 10


@dataclass(frozen=True)
class AppOptions:
    """What the app is built with beside its engines and tenancy: the settings that shape its
    routes and bounds (`loragate serve` makes it from its Settings, tests name a few fields)."""

    max_body_bytes: int = 4 << 20
    enable_lora: bool = True
    # The /v1/load_lora_adapter routes (vLLM's); needs enable_lora.
    allow_runtime_lora_updating: bool = False
    limits: RequestLimits = RequestLimits()
    metrics_max_tenants: int = 100
    tool_call_parser: str | None = None
    console_oauth: ConsoleOAuth | None = None
    compaction: CompactPolicy = CompactPolicy()
    # The Batch API: how a batch is made (its window, the queued-token cap) and run here.
    batch_policy: BatchPolicy = BatchPolicy()
    batch_runner: RunnerOptions = RunnerOptions()

    @classmethod
    def from_settings(cls, settings: Settings, console_oauth: ConsoleOAuth | None) -> AppOptions:
        return cls(
            max_body_bytes=settings.max_body_bytes,
            enable_lora=settings.enable_lora,
            allow_runtime_lora_updating=(
                settings.allow_runtime_lora_updating and settings.enable_lora
            ),
            limits=RequestLimits(max_n=settings.max_n, max_prompt_chars=settings.max_prompt_chars),
            metrics_max_tenants=settings.metrics_max_tenants,
            compaction=CompactPolicy(
                settings.responses_compact_keep_turns, settings.responses_compact_summary_tokens
            ),
            tool_call_parser=(
                settings.tool_call_parser if settings.enable_auto_tool_choice else None
            ),
            console_oauth=console_oauth,
            batch_policy=BatchPolicy(
                completion_window=settings.batch_completion_window_seconds,
                token_limit=settings.batch_token_limit,
            ),
            batch_runner=RunnerOptions(
                max_concurrency=settings.batch_max_concurrency,
                lease=settings.batch_lease_seconds,
                priority=settings.batch_priority,
            ),
        )


def build_app(
    engines: Mapping[str, EngineClient], tenancy: Tenancy, options: AppOptions | None = None
) -> FastAPI:
    options = options or AppOptions()
    app = FastAPI(
        title="loragate",
        summary="Multi-tenant, OpenAI-compatible LoRA serving gateway",
        docs_url=None,
        redoc_url=None,
    )
    app.state.tenancy = tenancy
    app.state.console_oauth = options.console_oauth
    models = app.state.models = ServedModels(engines, options.limits)
    metrics = app.state.metrics = Metrics(models, options.metrics_max_tenants)
    metrics.watch_tenancy(tenancy.limiter, tenancy.ledger)
    catalog = tenancy.catalog if options.enable_lora else None
    if catalog is not None:
        catalog.on_unreferenced = models.unload_lora
    app.state.serving = OpenAIServing(
        models,
        metrics,
        Admission(tenancy.limiter, metrics.tenants),
        tenancy.ledger,
        catalog,
        options.tool_call_parser,
    )
    conversations = app.state.conversations = (
        None if tenancy.conversations is None else ConversationsServing(tenancy.conversations)
    )
    app.state.responses = (
        None
        if tenancy.responses is None
        else ResponsesServing(app.state.serving, tenancy.responses, conversations)
    )
    app.state.compactor = (
        None if app.state.responses is None else Compactor(app.state.responses, options.compaction)
    )
    app.state.files = (
        None
        if tenancy.files is None
        else FilesServing(
            app.state.serving,
            tenancy.files,
            FileLimits(
                tenancy.batch_file_max_bytes,
                tenancy.batch_file_max_lines,
                max_line_bytes=options.max_body_bytes,
            ),
            app.state.responses,
        )
    )
    app.state.batch_runner, app.state.batches = _batches(app, tenancy, options)
    app.state.started_at = int(time.time())
    install_error_handlers(app)
    # The one middleware: request ids, body bounds (adapter and file uploads have their own),
    # the console's security headers on its paths, and JSON 500s for whatever escapes.
    app.add_middleware(
        Edge,
        max_body_bytes=options.max_body_bytes,
        body_limits={
            ADAPTER_UPLOADS: tenancy.max_adapter_bytes,
            FILE_UPLOADS: tenancy.batch_file_max_bytes + FORM_OVERHEAD,
        },
        path_headers=CONSOLE_HEADERS,
    )
    routers = [
        router,
        responses_routes.router,
        conversations_routes.router,
        files_routes.router,
        batches_routes.router,
        usage.router,
        admin.router,
        usage.admin_router,
        usage.organization_router,
        admin_adapters.router,
        admin_engines.router,
        admin_batches.router,
        health_router,
    ]
    if options.allow_runtime_lora_updating:
        if catalog is None:
            raise ValueError("runtime LoRA updating needs LoRA enabled")
        routers.append(lora.router)
    for included in routers:
        app.include_router(included)
    app.state.max_body_bytes = options.max_body_bytes  # a WebSocket message's bound too
    app.include_router(responses_socket.router)  # no methods: not among the routes a 405 lists
    console_routes = install_console(app)
    # What a 405's Allow header lists (gateway.http.errors).
    app.state.routes = [r for included in routers for r in included.routes] + console_routes
    return app


def _batches(
    app: FastAPI, tenancy: Tenancy, options: AppOptions
) -> tuple[BatchRunner | None, BatchesServing | None]:
    """The Batch API's routes' serving and this gateway's runner of batches (started and
    stopped with the tenancy), on a tenancy that keeps batches and files."""
    store, claims, files = tenancy.batches, tenancy.batch_lines, tenancy.files
    if store is None or claims is None or files is None:
        return None, None
    run = options.batch_runner
    runner = BatchRunner(
        claims,
        Finisher(store, files, worker_id(), run.lease),
        LineRunner(app.state.serving, app.state.responses, run.priority),
        TenantLookup(tenancy.db, tenancy.secret_key, tenancy.auth.ttl),
        run,
    )
    tenancy.services.append(runner)
    policy = options.batch_policy
    if policy.max_line_bytes is None:
        policy = dataclasses.replace(policy, max_line_bytes=options.max_body_bytes)
    serving = BatchesServing(app.state.serving, store, files, policy, runner, app.state.responses)
    return runner, serving
