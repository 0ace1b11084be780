"""`loragate engine`'s app: the internal routes a gateway uses (gateway.remote.engine_server) and
the OpenAI routes an inference router uses (gateway.remote.engine_openai), over one engine."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gateway.body import BodySizeLimit
from gateway.errors import ErrorBoundary, install_error_handlers
from gateway.metrics import Metrics
from gateway.remote.engine_openai import add_openai_routes
from gateway.remote.engine_server import EngineService, Unauthorized, router, unauthorized
from gateway.request_limits import RequestLimits
from gateway.served_models import ServedModels


def build_engine_app(service: EngineService, max_body_bytes: int = 4 << 20) -> FastAPI:
    app = FastAPI(title="loragate engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    models = app.state.models = ServedModels({service.name: service.engine}, RequestLimits())
    metrics = app.state.metrics = Metrics(models, 0, scaling=False)
    app.include_router(router)
    add_openai_routes(app, service, metrics)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes, overrides={})
    app.add_middleware(ErrorBoundary)
    app.state.routes = list(app.routes)  # what a 405's Allow header lists (gateway.errors)

    @app.exception_handler(Unauthorized)
    async def on_unauthorized(_: Request, __: Unauthorized) -> JSONResponse:
        return unauthorized()

    return app
