"""The OpenAI routes under /v1: the endpoints' handlers (gateway.openai.completions, .chat)
registered, and /v1/models; /health and /metrics beside them."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from gateway.http.deps import get_tenancy
from gateway.http.edge import StrictJSONRoute
from gateway.http.error_schemas import ADMIN_ERRORS, OPENAI_ERRORS
from gateway.openai import chat, completions
from gateway.openai.serving import ServingDep
from gateway.tenancy.auth import TenantDep

router = APIRouter(
    prefix="/v1", tags=["openai"], route_class=StrictJSONRoute, responses=OPENAI_ERRORS
)

# A completion is one JSON body, or server-sent events with `"stream": true`.
_GENERATION: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion, or its chunks as server-sent events.",
        "content": {"application/json": {}, "text/event-stream": {"schema": {"type": "string"}}},
    }
}

# Each endpoint holds its route's handler; the order here is the OpenAPI document's.
for path, handler in (
    ("/completions", completions.completions),
    ("/chat/completions", chat.chat_completions),
):
    router.add_api_route(
        path, handler, methods=["POST"], response_model=None, responses=_GENERATION
    )


@router.get("/models")
async def list_models(serving: ServingDep, tenant: TenantDep, request: Request) -> dict[str, Any]:
    """The base models the caller may use, the public adapters and the caller's own."""
    created = request.app.state.started_at
    bases = {
        model.name: {
            "id": model.name,
            "object": "model",
            "created": created,
            "owned_by": "loragate",
            "root": model.name,
            "parent": None,
            "max_model_len": model.engine.facts.max_model_len,
        }
        for model in serving.models_for(tenant)
    }
    # Adapters as vLLM lists them: their own ids, with their base model as parent.
    adapters = (
        []
        if serving.catalog is None
        else await serving.catalog.names(tenant.id, tenant.allowed_models)
    )
    data = list(bases.values()) + [
        bases[base] | {"id": name, "root": name, "parent": base}
        for name, base in adapters
        if base in bases
    ]
    return {"object": "list", "data": data}


health_router = APIRouter(tags=["health"], route_class=StrictJSONRoute)


class Health(BaseModel):
    status: Literal["ok", "restarting", "stopping", "dead"]


@health_router.get(
    "/health",
    response_model=Health,
    responses={503: {"model": Health, "description": "The engine is not serving."}},
)
async def health(request: Request) -> JSONResponse:
    """200 {"status": "ok"} while the engine serves; else 503 with "restarting" (a dead
    engine process being replaced), "stopping" or "dead"."""
    status = request.app.state.models.health
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


@health_router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition.",
            "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
        },
        401: ADMIN_ERRORS[401],
        403: ADMIN_ERRORS[403],
    },
)
async def metrics(request: Request) -> Response:
    """Open by default, as Prometheus scrapes without credentials; --metrics-auth asks for an
    admin token."""
    tenancy = get_tenancy(request)
    if tenancy.metrics_auth:
        tenancy.admin.verify(request.headers.get("authorization"))
    return Response(
        generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )
