"""Runtime adapter loading, vLLM-compatible: /v1/load_lora_adapter, /v1/unload_lora_adapter.

Off unless `--allow-runtime-lora-updating` (as vLLM gates it), and an admin token is required:
the adapters they register are public (every tenant may use them), from server-local paths.
Loading a name in use moves it to the new files, as vLLM does. vLLM serves one base model;
here a load names its model in an optional `base_model` (needed only when the server serves
several), and an unload takes the id `/v1/models` lists (`name`, or `name@base`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from adapters.peft_config import AdapterError
from gateway.http.deps import AdminDep, TenancyDep
from gateway.http.edge import StrictJSONRoute
from gateway.http.error_schemas import ADMIN_ERRORS, error_response
from gateway.http.errors import APIError
from gateway.routers.admin_adapters import BASE_MODEL_DOC, MAX_MODEL_NAME, AdapterName
from gateway.tenancy.adapter_catalog import BASE_SEPARATOR, InvalidBaseModel
from gateway.tenancy.state import Tenancy
from tenants.adapter_rows import find_by_name
from tenants.models import Adapter
from tenants.names import MAX_ADAPTER_NAME

router = APIRouter(prefix="/v1", tags=["lora"], route_class=StrictJSONRoute, responses=ADMIN_ERRORS)


class LoadLoRABody(BaseModel):
    lora_name: AdapterName
    lora_path: str = Field(min_length=1, max_length=4096)
    base_model: str | None = Field(
        None, min_length=1, max_length=MAX_MODEL_NAME, description=BASE_MODEL_DOC
    )


class UnloadLoRABody(BaseModel):
    lora_name: str = Field(
        min_length=1,
        max_length=MAX_ADAPTER_NAME + 1 + MAX_MODEL_NAME,
        description="The adapter's id as /v1/models lists it: its name, or `name@base`.",
    )


# vLLM answers these in plain text; errors are JSON, as everywhere.
_PLAIN: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}}
}


_LOAD = _PLAIN | {
    400: error_response(
        "A field out of bounds, a served model's name, a `base_model` missing (several models "
        "are served) or not served (`invalid_value`), or a `lora_path` that is not a PEFT "
        "LoRA adapter directory of that model on the server (`invalid_adapter`)."
    )
}


@router.post("/load_lora_adapter", response_model=None, responses=_LOAD)
async def load_lora_adapter(
    body: LoadLoRABody, tenancy: TenancyDep, _: AdminDep
) -> PlainTextResponse:
    if body.lora_name in tenancy.model_names:
        raise APIError(
            400,
            "an adapter cannot take a served base model's name",
            param="lora_name",
            code="invalid_value",
        )
    path = Path(body.lora_path)
    if not _is_dir(path):
        raise APIError(
            400,
            "lora_path: not a directory on the server",
            param="lora_path",
            code="invalid_adapter",
        )
    try:
        await tenancy.catalog.put_local(
            owner_id=None, name=body.lora_name, path=path, base_model=body.base_model
        )
    except InvalidBaseModel as exc:
        raise APIError(400, str(exc), param="base_model", code="invalid_value") from exc
    except AdapterError as exc:
        raise APIError(400, str(exc), param="lora_path", code="invalid_adapter") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


_UNLOAD = _PLAIN | {
    400: error_response(
        "A field out of bounds, or a bare name of public adapters on several base models "
        "(`ambiguous_model`: send `name@base`)."
    )
}


@router.post("/unload_lora_adapter", response_model=None, responses=_UNLOAD)
async def unload_lora_adapter(
    body: UnloadLoRABody, tenancy: TenancyDep, _: AdminDep
) -> PlainTextResponse:
    await tenancy.catalog.remove(await _public_adapter(tenancy, body.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _public_adapter(tenancy: Tenancy, lora_name: str) -> Adapter:
    """The public adapter `name` or `name@base` names, on a model this server serves."""
    name, separator, base = lora_name.partition(BASE_SEPARATOR)
    async with tenancy.db.session() as session:
        found = [
            row
            for row in await find_by_name(session, owner_id=None, name=name)
            if row.base_model in tenancy.model_names and (not separator or row.base_model == base)
        ]
    if not found:
        raise APIError(
            404,
            f"no public adapter named {lora_name!r}",
            type="not_found_error",
            param="lora_name",
            code="model_not_found",
        )
    if len(found) > 1:
        choices = ", ".join(f"`{name}{BASE_SEPARATOR}{row.base_model}`" for row in found)
        raise APIError(
            400,
            f"`{name}` names public adapters of several base models; send one of {choices}",
            param="lora_name",
            code="ambiguous_model",
        )
    return found[0]


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long for the filesystem, say: no directory either
        return False
