"""`loragate engine`'s app: the internal routes a gateway uses (gateway.engine_service.server) and
the OpenAI routes an inference router uses (gateway.engine_service.openai), over one engine."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gateway.engine_service.openai import add_openai_routes
from gateway.engine_service.server import EngineService, Unauthorized, router, unauthorized
from gateway.http.edge import Edge
from gateway.http.errors import install_error_handlers
from gateway.http.request_limits import RequestLimits
from gateway.metrics import Metrics
from gateway.models.served import ServedModels


def build_engine_app(service: EngineService, max_body_bytes: int = 4 << 20) -> FastAPI:
    app = FastAPI(title="loragate engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    models = app.state.models = ServedModels({service.name: service.engine}, RequestLimits())
    metrics = app.state.metrics = Metrics(models, 0, scaling=False)
    app.include_router(router)
    add_openai_routes(app, service, metrics)
    install_error_handlers(app)
    app.add_middleware(Edge, max_body_bytes=max_body_bytes)
    app.state.routes = list(app.routes)  # what a 405's Allow header lists (gateway.http.errors)

    @app.exception_handler(Unauthorized)
    async def on_unauthorized(_: Request, __: Unauthorized) -> JSONResponse:
        return unauthorized()

    return app
