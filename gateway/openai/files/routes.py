"""The Files API: /v1/files (gateway.openai.files)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import Response

from gateway.http.deps import app_service
from gateway.http.edge import StrictJSONRoute
from gateway.http.error_schemas import OPENAI_ERRORS, error_response
from gateway.openai.batch_lines import MAX_REPORTED
from gateway.openai.files.protocol import (
    UPLOAD_BODY,
    FileDeleted,
    FileList,
    FileObject,
    InvalidFileBody,
)
from gateway.openai.files.serving import FilesServing
from gateway.tenancy.auth import TenantDep
from tenants.files import MAX_PAGE

MAX_FILE_ID_CHARS = 64  # the files table's

_ERRORS = OPENAI_ERRORS | {
    404: error_response(
        "No such file for this tenant (`file_not_found`): another tenant's answers as one "
        "that never existed."
    ),
}
_UPLOAD_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {
        "model": InvalidFileBody,
        "description": "A purpose other than `batch`, a form without a file, an empty file "
        "(`empty_file`), a tenant holding as many files as it may (`too_many_files`), or a "
        "file with lines their route would refuse (`invalid_file`: the first "
        f"{MAX_REPORTED} listed by number under `lines`, as OpenAI's BatchError). Nothing "
        "is stored.",
    },
    413: error_response(
        "The file is larger than --batch-file-max-bytes or has more lines than "
        "--batch-file-max-lines (`file_too_large`)."
    ),
    415: error_response("Not multipart/form-data."),
}
_CONTENT: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The file's bytes as they were stored.",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}

router = APIRouter(
    prefix="/v1/files", tags=["files"], route_class=StrictJSONRoute, responses=_ERRORS
)


get_files = app_service(FilesServing, "files", "Files API")


FilesDep = Annotated[FilesServing, Depends(get_files)]
FileId = Annotated[str, Path(max_length=MAX_FILE_ID_CHARS)]


@router.post("", response_model=FileObject, openapi_extra=UPLOAD_BODY, responses=_UPLOAD_ERRORS)
async def upload_file(request: Request, files: FilesDep, tenant: TenantDep) -> dict[str, Any]:
    """A batch's input file (purpose `batch`), stored once every line passes its route's
    checks."""
    return await files.upload(request, tenant)


@router.get("", response_model=FileList)
async def list_files(
    files: FilesDep,
    tenant: TenantDep,
    purpose: Annotated[str | None, Query(max_length=32)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    order: Literal["asc", "desc"] = "desc",
    after: Annotated[str | None, Query(max_length=MAX_FILE_ID_CHARS)] = None,
) -> dict[str, Any]:
    """The tenant's files by creation (newest first unless `order` is asc), after the file
    `after`."""
    return await files.list(tenant, purpose, limit, order, after)


@router.get("/{file_id}", response_model=FileObject)
async def retrieve_file(file_id: FileId, files: FilesDep, tenant: TenantDep) -> dict[str, Any]:
    return await files.retrieve(tenant, file_id)


@router.get("/{file_id}/content", response_class=Response, responses=_CONTENT)
async def file_content(file_id: FileId, files: FilesDep, tenant: TenantDep) -> Response:
    return await files.content(tenant, file_id)


@router.delete("/{file_id}", response_model=FileDeleted)
async def delete_file(file_id: FileId, files: FilesDep, tenant: TenantDep) -> dict[str, Any]:
    return await files.delete(tenant, file_id)
