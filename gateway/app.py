"""Build the FastAPI app around a running engine (EngineClient)."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.responses import Response

from adapters.registry import AdapterRegistry
from engine.async_engine import EngineClient
from gateway.errors import error_body, install_error_handlers
from gateway.metrics import Metrics
from gateway.routers import lora
from gateway.routers.openai import health_router, router
from gateway.serving import OpenAIServing


class BodySizeLimit(BaseHTTPMiddleware):
    """413 for a declared body over the limit, before anything parses it."""

    def __init__(self, app: object, max_bytes: int) -> None:
        super().__init__(app)  # type: ignore[arg-type]
        self.max_bytes = max_bytes

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return JSONResponse(
                error_body(f"request body exceeds {self.max_bytes} bytes", "invalid_request_error"),
                status_code=413,
            )
        return await call_next(request)


def build_app(
    engine: EngineClient,
    served_model_name: str,
    max_body_bytes: int = 4 << 20,
    adapters: AdapterRegistry | None = None,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    app = FastAPI(title="loragate", docs_url=None, redoc_url=None)
    app.state.metrics = Metrics(engine)
    app.state.serving = OpenAIServing(engine, served_model_name, app.state.metrics, adapters)
    app.state.started_at = int(time.time())
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.include_router(router)
    if allow_runtime_lora_updating:
        if adapters is None:
            raise ValueError("runtime LoRA updating needs LoRA enabled")
        app.include_router(lora.router)
    app.include_router(health_router)
    return app
