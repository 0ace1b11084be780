"""OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.body import StrictJSONRoute
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.serving import OpenAIServing

router = APIRouter(prefix="/v1", tags=["openai"], route_class=StrictJSONRoute)


def get_serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


ServingDep = Annotated[OpenAIServing, Depends(get_serving)]


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionRequest, serving: ServingDep
) -> JSONResponse | StreamingResponse:
    return await serving.completions(body)


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, serving: ServingDep
) -> JSONResponse | StreamingResponse:
    return await serving.chat(body)


@router.get("/models")
async def list_models(serving: ServingDep, request: Request) -> dict[str, Any]:
    created = request.app.state.started_at
    base = {
        "id": serving.model_name,
        "object": "model",
        "created": created,
        "owned_by": "loragate",
        "root": serving.model_name,
        "parent": None,
        "max_model_len": serving.engine.max_model_len,
    }
    # Adapters as vLLM lists them: their own ids, with the base model as parent.
    adapters = [] if serving.adapters is None else serving.adapters.names()
    data = [base] + [
        base | {"id": name, "root": name, "parent": serving.model_name} for name in adapters
    ]
    return {"object": "list", "data": data}


health_router = APIRouter(tags=["health"], route_class=StrictJSONRoute)


@health_router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 {"status": "ok"} while the engine serves; else 503 with "restarting" (a dead
    engine process being replaced), "stopping" or "dead"."""
    status = request.app.state.serving.engine.health
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


@health_router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(
        generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )
