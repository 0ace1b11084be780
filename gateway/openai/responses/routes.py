"""The Responses API: /v1/responses and the stored responses under it (gateway.openai.responses)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import Response

from gateway.http.deps import app_service
from gateway.http.edge import StrictJSONRoute
from gateway.http.error_schemas import OPENAI_ERRORS
from gateway.openai.responses.compaction import Compactor, CompactRequest
from gateway.openai.responses.items import MAX_ID_CHARS
from gateway.openai.responses.protocol import InputTokensRequest, ResponsesRequest
from gateway.openai.responses.serving import ResponsesServing
from gateway.openai.serving import hung_up
from gateway.tenancy.auth import TenantDep

router = APIRouter(
    prefix="/v1/responses", tags=["responses"], route_class=StrictJSONRoute, responses=OPENAI_ERRORS
)

# One server-sent event, as OpenAPI describes text/event-stream (its schema is each event's):
# `data` is the event's JSON.
_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": "application/json"},
    },
}
_CREATED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The response, or its events as server-sent events.",
        "content": {"application/json": {}, "text/event-stream": {"schema": _EVENT}},
    }
}


get_responses = app_service(ResponsesServing, "responses", "Responses API")


ResponsesDep = Annotated[ResponsesServing, Depends(get_responses)]


# A response id as a path parameter: bounded in the schema, so a longer one is the same 400
# as any other malformed field.
ResponseId = Annotated[str, Path(max_length=MAX_ID_CHARS)]


@router.post("", response_model=None, responses=_CREATED)
async def create_response(
    body: ResponsesRequest, responses: ResponsesDep, tenant: TenantDep, request: Request
) -> Response:
    return await responses.create(body, tenant, hung_up(request))


get_compactor = app_service(Compactor, "compactor", "Responses API")


@router.post("/compact")
async def compact_conversation(
    body: CompactRequest,
    compactor: Annotated[Compactor, Depends(get_compactor)],
    tenant: TenantDep,
) -> dict[str, Any]:
    """A conversation made shorter: its older turns summarised by the model, its last turns
    and every function call with its output kept (billed as `responses_compact`)."""
    return await compactor.compact(body, tenant)


@router.post("/input_tokens")
async def count_input_tokens(
    body: InputTokensRequest, responses: ResponsesDep, tenant: TenantDep
) -> dict[str, Any]:
    """The input tokens the same body would run with (not run, not billed)."""
    return await responses.input_tokens(body, tenant)


@router.get("/{response_id}")
async def retrieve_response(
    response_id: ResponseId, responses: ResponsesDep, tenant: TenantDep
) -> dict[str, Any]:
    return await responses.retrieve(tenant, response_id)


@router.delete("/{response_id}")
async def delete_response(
    response_id: ResponseId, responses: ResponsesDep, tenant: TenantDep
) -> dict[str, Any]:
    return await responses.delete(tenant, response_id)


@router.post("/{response_id}/cancel")
async def cancel_response(
    response_id: ResponseId, responses: ResponsesDep, tenant: TenantDep
) -> dict[str, Any]:
    return await responses.cancel(tenant, response_id)


@router.get("/{response_id}/input_items")
async def list_input_items(
    response_id: ResponseId,
    responses: ResponsesDep,
    tenant: TenantDep,
    order: Literal["asc", "desc"] = "desc",
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=MAX_ID_CHARS)] = None,
) -> dict[str, Any]:
    return await responses.input_items(tenant, response_id, order, limit, after)
