"""The Batch API: /v1/batches (gateway.openai.batches)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query

from gateway.http.deps import app_service
from gateway.http.edge import StrictJSONRoute
from gateway.http.error_schemas import OPENAI_ERRORS, error_response
from gateway.openai.batches.protocol import MAX_ID_CHARS, BatchCreate, BatchList, BatchObject
from gateway.openai.batches.serving import BatchesServing
from gateway.openai.files.protocol import InvalidFileBody
from gateway.tenancy.auth import TenantDep

_ERRORS = OPENAI_ERRORS | {
    404: error_response(
        "No such batch (`batch_not_found`) or input file (`file_not_found`) for this tenant: "
        "another tenant's answers as one that never existed."
    ),
}
_CREATE_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {
        "model": InvalidFileBody,
        "description": "Invalid request: a field out of bounds, an input file that is not a "
        "batch's (`invalid_value`), or one with lines this batch cannot run (`invalid_file`: "
        "a url other than its endpoint, a body the route refuses), the first listed under "
        "`lines`.",
    },
    429: error_response(
        "The tenant's unfinished batches would hold more tokens than its cap "
        "(`token_limit_exceeded`)."
    ),
}

router = APIRouter(
    prefix="/v1/batches", tags=["batches"], route_class=StrictJSONRoute, responses=_ERRORS
)


get_batches = app_service(BatchesServing, "batches", "Batch API")


BatchesDep = Annotated[BatchesServing, Depends(get_batches)]
BatchId = Annotated[str, Path(max_length=MAX_ID_CHARS)]


@router.post("", response_model=BatchObject, responses=_CREATE_ERRORS)
async def create_batch(body: BatchCreate, batches: BatchesDep, tenant: TenantDep) -> dict[str, Any]:
    """A batch of the input file's requests, all to `endpoint`, run within the completion
    window in the capacity interactive traffic leaves."""
    return await batches.create(body, tenant)


@router.get("", response_model=BatchList)
async def list_batches(
    batches: BatchesDep,
    tenant: TenantDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=MAX_ID_CHARS)] = None,
) -> dict[str, Any]:
    """The tenant's batches, newest first, with their counts and token usage."""
    return await batches.list(tenant, limit, after)


@router.get("/{batch_id}", response_model=BatchObject)
async def retrieve_batch(
    batch_id: BatchId, batches: BatchesDep, tenant: TenantDep
) -> dict[str, Any]:
    return await batches.retrieve(tenant, batch_id)


@router.post("/{batch_id}/cancel", response_model=BatchObject)
async def cancel_batch(batch_id: BatchId, batches: BatchesDep, tenant: TenantDep) -> dict[str, Any]:
    """`cancelling` at once, then `cancelled` with the lines that finished in its output."""
    return await batches.cancel(tenant, batch_id)
