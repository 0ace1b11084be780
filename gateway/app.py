"""Build the FastAPI app around a running engine (EngineClient)."""

from __future__ import annotations

import time

from fastapi import FastAPI

from adapters.registry import AdapterRegistry
from engine.async_engine import EngineClient
from gateway.body import BodySizeLimit
from gateway.errors import ErrorBoundary, install_error_handlers
from gateway.metrics import Metrics
from gateway.routers import lora
from gateway.routers.openai import health_router, router
from gateway.serving import OpenAIServing, RequestLimits


def build_app(
    engine: EngineClient,
    served_model_name: str,
    max_body_bytes: int = 4 << 20,
    adapters: AdapterRegistry | None = None,
    allow_runtime_lora_updating: bool = False,
    limits: RequestLimits | None = None,
) -> FastAPI:
    app = FastAPI(title="loragate", docs_url=None, redoc_url=None)
    app.state.metrics = Metrics(engine)
    app.state.serving = OpenAIServing(
        engine, served_model_name, app.state.metrics, adapters, limits or RequestLimits()
    )
    app.state.started_at = int(time.time())
    install_error_handlers(app)
    # The last added runs first: every request passes the error boundary, then the size limit.
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(ErrorBoundary)
    app.include_router(router)
    if allow_runtime_lora_updating:
        if adapters is None:
            raise ValueError("runtime LoRA updating needs LoRA enabled")
        app.include_router(lora.router)
    app.include_router(health_router)
    return app
