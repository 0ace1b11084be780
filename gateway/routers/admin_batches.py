"""Admin REST for the Batch API, under /admin (an admin token on every route): a tenant's
batches and the download of its files (what the console's Batches page reads), and the batches
of every tenant by status.

A batch is the object `/v1/batches` answers its tenant (gateway.openai.batches.protocol) with
its `tenant_id` and `progress`; a file's bytes are the ones `/v1/files/{id}/content` gives its
tenant. An unknown tenant is a 404, and so is a file id that is not the tenant's (another
tenant's answers as one that never existed, as the Files API answers).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import BaseModel, Field

from gateway.http.deps import AdminDep, TenancyDep
from gateway.http.edge import StrictJSONRoute
from gateway.http.error_schemas import ADMIN_ERRORS, error_response
from gateway.http.errors import APIError
from gateway.openai.batches.protocol import MAX_ID_CHARS, BatchObject, batch_object
from gateway.openai.files.routes import get_files
from gateway.routers.admin import tenant_or_404
from gateway.tenancy.auth import request_tenant
from gateway.tenancy.state import Tenancy
from tenants.batches import BatchStore, StoredBatch

MAX_PAGE = 100  # batches per page, as /v1/batches pages them
BatchStatus = Literal[
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
]
_CONTENT: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The file's bytes as they were stored, as an attachment with its name.",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
    404: error_response(
        "No such tenant (`not_found`), or no such file of this tenant's (`file_not_found`): "
        "another tenant's file answers as one that never existed."
    ),
}

router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    route_class=StrictJSONRoute,
    responses={code: ADMIN_ERRORS[code] for code in ADMIN_ERRORS if code != 409}
    | {404: error_response("No such tenant, or a server without the Batch API.")},
)


class AdminBatch(BatchObject):
    tenant_id: str
    progress: float = Field(
        ge=0.0, le=1.0, description="The lines answered so far: (completed + failed) / total."
    )


class AdminBatchList(BaseModel):
    """A page of batches in OpenAI's list shape: `after` the previous page's `last_id`."""

    object: Literal["list"] = "list"
    data: list[AdminBatch]
    first_id: str | None
    last_id: str | None
    has_more: bool


Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="Batches per page.")]
After = Annotated[
    str | None,
    Query(max_length=MAX_ID_CHARS, description="A batch's id: the page starts after it."),
]


def _store(tenancy: Tenancy) -> BatchStore:
    if tenancy.batches is None:
        raise APIError(404, "this server does not serve the Batch API", code="not_found")
    return tenancy.batches


def _page(batches: list[StoredBatch], has_more: bool) -> dict[str, Any]:
    data = [_admin_object(batch) for batch in batches]
    return {
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _admin_object(batch: StoredBatch) -> dict[str, Any]:
    counts = batch.totals
    answered = counts.completed + counts.failed
    progress = min(1.0, answered / counts.total) if counts.total else 0.0
    return batch_object(batch) | {"tenant_id": batch.tenant_id, "progress": progress}


@router.get("/tenants/{tenant_id}/batches", response_model=AdminBatchList)
async def list_tenant_batches(
    tenant_id: str, tenancy: TenancyDep, _: AdminDep, limit: Limit = 20, after: After = None
) -> dict[str, Any]:
    """The tenant's batches, newest first, with their counts, files and progress (a running
    batch's counts read from its lines now)."""
    store = _store(tenancy)
    await tenant_or_404(tenancy, tenant_id)
    return _page(*await store.page(tenant_id, limit, after))


@router.get("/batches", response_model=AdminBatchList)
async def list_batches(
    tenancy: TenancyDep,
    _: AdminDep,
    status: Annotated[
        list[BatchStatus] | None,
        Query(max_length=8, description="Only batches in these statuses (repeat to name more)."),
    ] = None,
    limit: Limit = 20,
    after: After = None,
) -> dict[str, Any]:
    """Every tenant's batches, newest first (`status=in_progress`: those running now)."""
    return _page(*await _store(tenancy).page_all(status, limit, after))


@router.get(
    "/tenants/{tenant_id}/files/{file_id}/content",
    response_class=Response,
    responses=_CONTENT,
)
async def file_content(
    request: Request,
    tenant_id: str,
    file_id: Annotated[str, Path(max_length=MAX_ID_CHARS)],
    tenancy: TenancyDep,
    _: AdminDep,
) -> Response:
    """A file of the tenant's (a batch's input, output or error file), downloaded as its
    tenant downloads it."""
    files = get_files(request)
    tenant = await tenant_or_404(tenancy, tenant_id)
    return await files.content(request_tenant(tenancy.secret_key, tenant), file_id)
