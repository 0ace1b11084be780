"""Admin REST for adapters, under /admin/adapters.

`POST /admin/adapters` takes a multipart upload (text fields `name`, `base_model` and, for a
tenant's own adapter, `tenant_id`; file parts named `adapter_config.json` and
`adapter_model.safetensors`), or JSON `{name, base_model?, tenant_id?, path}` naming a
server-local PEFT directory (only with --allow-local-adapter-paths). `base_model` is the served
model the adapter is for: required when the server serves several, the only one otherwise.
The adapter is validated against that model before anything is stored: a refusal is a 400
naming the problem (a shape that does not fit names the module) and leaves no row and no file.
The body is limited to --max-adapter-bytes (413 before it is read whole).
"""

from __future__ import annotations

import asyncio
import shutil
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import UploadFile

from adapters.peft import WEIGHTS_FILE
from adapters.peft_config import CONFIG_FILE, AdapterError
from gateway.http.deps import AdminDep, ModelsDep, TenancyDep
from gateway.http.edge import StrictJSONRoute
from gateway.http.error_schemas import ADMIN_ERRORS, error_response, not_found
from gateway.http.errors import APIError
from gateway.models.served import ServedModels
from gateway.models.states import model_statuses, residency
from gateway.tenancy.adapter_catalog import InvalidBaseModel
from gateway.tenancy.state import Tenancy
from tenants.adapter_rows import AdapterExists, get_adapter, list_adapters
from tenants.models import Adapter
from tenants.names import ADAPTER_NAME_PATTERN, MAX_ADAPTER_NAME, check_adapter_name
from tenants.tenants import get_tenant

router = APIRouter(
    prefix="/admin", tags=["admin"], route_class=StrictJSONRoute, responses=ADMIN_ERRORS
)

AdapterName = Annotated[
    str,
    Field(min_length=1, max_length=MAX_ADAPTER_NAME, pattern=ADAPTER_NAME_PATTERN),
    AfterValidator(check_adapter_name),
]
MAX_FIELD_BYTES = 1 << 10
MAX_MODEL_NAME = 256  # the adapters table's base_model column
BASE_MODEL_DOC = (
    "The served model (its `model` name) the adapter is for: required when the server serves "
    "several, the only one otherwise."
)


class AdapterFromPath(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: AdapterName
    base_model: str | None = Field(
        None, min_length=1, max_length=MAX_MODEL_NAME, description=BASE_MODEL_DOC
    )
    tenant_id: str | None = Field(None, max_length=64)
    path: str = Field(min_length=1, max_length=4096)


class ResidentOn(BaseModel):
    model: str
    replica: str = Field(description="The replica's id, as `GET /admin/engines` lists it.")


class AdapterPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    object: Literal["adapter"] = "adapter"
    name: str
    tenant_id: str | None = Field(validation_alias="owner_id")
    base_model: str
    rank: int
    alpha: float
    target_modules: list[str]
    sha256: str
    size_bytes: int
    status: str
    created_at: datetime
    resident_on: list[ResidentOn] = Field(
        default=[], description="The engines that hold its weights in a LoRA slot now."
    )


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterPublic]


_UPLOAD_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", CONFIG_FILE, WEIGHTS_FILE],
    "properties": {
        "name": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_ADAPTER_NAME,
            "pattern": ADAPTER_NAME_PATTERN,
        },
        "base_model": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_MODEL_NAME,
            "description": BASE_MODEL_DOC,
        },
        "tenant_id": {"type": "string", "description": "absent: a public adapter"},
        CONFIG_FILE: {"type": "string", "format": "binary"},
        WEIGHTS_FILE: {"type": "string", "format": "binary"},
    },
}
_REQUEST_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {"schema": _UPLOAD_SCHEMA},
            "application/json": {"schema": AdapterFromPath.model_json_schema()},
        },
    }
}


async def _owner(tenancy: Tenancy, tenant_id: str | None) -> str | None:
    if tenant_id is None:
        return None
    async with tenancy.db.session() as session:
        if await get_tenant(session, tenant_id=tenant_id) is None:
            raise not_found("tenant", "tenant_id")
    return tenant_id


@router.post(
    "/adapters",
    status_code=201,
    response_model=AdapterPublic,
    openapi_extra=_REQUEST_BODY,
    responses={
        400: error_response(
            "A field out of bounds, a `base_model` missing (several models are served) or "
            "not served (`invalid_value`), or files (or a server path) that are not a PEFT "
            "LoRA adapter of that base model (`invalid_adapter`): its config, its tensors' "
            "names, shapes and rank are read before anything is registered."
        ),
        415: error_response("Neither multipart/form-data nor application/json."),
    },
)
async def create(
    request: Request, tenancy: TenancyDep, models: ModelsDep, _: AdminDep
) -> AdapterPublic:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if content_type == "multipart/form-data":
            return _public([await _upload(request, tenancy)], models)[0]
        if content_type == "application/json":
            return _public([await _from_path(request, tenancy)], models)[0]
    except InvalidBaseModel as exc:
        raise APIError(400, str(exc), param="base_model", code="invalid_value") from exc
    except AdapterError as exc:
        raise APIError(400, str(exc), param="adapter", code="invalid_adapter") from exc
    except AdapterExists as exc:
        raise APIError(409, str(exc), param="name", code="adapter_exists") from exc
    raise APIError(415, "send multipart/form-data (an upload) or application/json (a path)")


async def _upload(request: Request, tenancy: Tenancy) -> Adapter:
    form = await request.form(max_files=2, max_fields=3, max_part_size=MAX_FIELD_BYTES)
    try:
        name = _text(form.get("name"), "name")
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise APIError(400, f"name: {exc}", param="name") from exc
        tenant_id = form.get("tenant_id")
        owner = await _owner(tenancy, None if tenant_id is None else _text(tenant_id, "tenant_id"))
        base_model = form.get("base_model")
        base = None if base_model is None else _text(base_model, "base_model")
        staging = tenancy.catalog.store.staging()
        try:
            for part in (CONFIG_FILE, WEIGHTS_FILE):
                upload = form.get(part)
                if not isinstance(upload, UploadFile):
                    raise APIError(400, f"a file part named {part} is required", param=part)
                await asyncio.to_thread(_save, upload, staging / part)
        except BaseException:
            tenancy.catalog.store.discard(staging)
            raise
        return await tenancy.catalog.add_upload(
            owner_id=owner, name=name, staging=staging, base_model=base
        )
    finally:
        await form.close()


async def _from_path(request: Request, tenancy: Tenancy) -> Adapter:
    if not tenancy.allow_local_adapter_paths:
        raise APIError(
            403,
            "registering server-local paths is off (--allow-local-adapter-paths); upload the files",
            type="permission_error",
            param="path",
        )
    try:
        body = AdapterFromPath.model_validate(await request.json())
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}", param=param) from exc
    owner = await _owner(tenancy, body.tenant_id)
    path = Path(body.path)
    if not path.is_dir():
        raise APIError(
            400, "path: not a directory on the server", param="path", code="invalid_adapter"
        )
    return await tenancy.catalog.add_local(
        owner_id=owner, name=body.name, path=path, base_model=body.base_model
    )


async def _adapter(tenancy: Tenancy, adapter_id: str) -> Adapter:
    async with tenancy.db.session() as session:
        adapter = await get_adapter(session, adapter_id=adapter_id)
    if adapter is None:
        raise not_found("adapter", "adapter_id")
    return adapter


def _public(adapters: list[Adapter], models: ServedModels) -> list[AdapterPublic]:
    """The adapters as the admin REST shows them, with where each is resident now."""
    where = residency(model_statuses(models))
    public = []
    for adapter in adapters:
        shown = AdapterPublic.model_validate(adapter)
        replicas = where.get((adapter.base_model, adapter.sha256), [])
        shown.resident_on = [ResidentOn(model=adapter.base_model, replica=r) for r in replicas]
        public.append(shown)
    return public


def _text(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"{param} must be a text field", param=param)
    return value


def _save(upload: UploadFile, target: Path) -> None:
    upload.file.seek(0)
    with target.open("wb") as out:
        shutil.copyfileobj(upload.file, out, 1 << 20)


@router.get("/adapters", response_model=AdapterList)
async def list_all(
    tenancy: TenancyDep,
    models: ModelsDep,
    _: AdminDep,
    tenant_id: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    """Every adapter, or one tenant's own; `resident_on`: the engines (model, replica) whose
    LoRA slots hold its weights now."""
    async with tenancy.db.session() as session:
        adapters = await list_adapters(session, owner_id=tenant_id)
    return {"data": _public(adapters, models)}


@router.get("/adapters/{adapter_id}", response_model=AdapterPublic)
async def read(
    adapter_id: str, tenancy: TenancyDep, models: ModelsDep, _: AdminDep
) -> AdapterPublic:
    return _public([await _adapter(tenancy, adapter_id)], models)[0]


@router.delete("/adapters/{adapter_id}", status_code=204, response_class=Response)
async def delete(adapter_id: str, tenancy: TenancyDep, _: AdminDep) -> Response:
    """New requests naming it get 404 at once; the engine unloads it once its running requests
    finish, and its files go with the last adapter that references them."""
    await tenancy.catalog.remove(await _adapter(tenancy, adapter_id))
    return Response(status_code=204)
