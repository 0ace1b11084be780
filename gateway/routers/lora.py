"""Runtime adapter loading, vLLM-compatible: /v1/load_lora_adapter, /v1/unload_lora_adapter.

Off unless `--allow-runtime-lora-updating` (as vLLM gates it), and an admin token is required:
the adapters they register are public (every tenant may use them), from server-local paths.
Loading a name in use moves it to the new files, as vLLM does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from adapters.peft_config import AdapterError
from gateway.body import StrictJSONRoute
from gateway.deps import AdminDep, TenancyDep
from gateway.errors import APIError
from gateway.routers.admin_adapters import AdapterName
from gateway.routers.error_schemas import ADMIN_ERRORS, error_response
from tenants.adapter_rows import get_by_name
from tenants.names import MAX_ADAPTER_NAME

router = APIRouter(prefix="/v1", tags=["lora"], route_class=StrictJSONRoute, responses=ADMIN_ERRORS)


class LoadLoRABody(BaseModel):
    lora_name: AdapterName
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRABody(BaseModel):
    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_NAME)


# vLLM answers these in plain text; errors are JSON, as everywhere.
_PLAIN: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}}
}


_LOAD = _PLAIN | {
    400: error_response(
        "A field out of bounds, the base model's name, or a `lora_path` that is not a PEFT "
        "LoRA adapter directory on the server (`invalid_adapter`)."
    )
}


@router.post("/load_lora_adapter", response_model=None, responses=_LOAD)
async def load_lora_adapter(
    body: LoadLoRABody, tenancy: TenancyDep, _: AdminDep
) -> PlainTextResponse:
    if body.lora_name == tenancy.catalog.base_model_name:
        raise APIError(
            400,
            "an adapter cannot take the base model's name",
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
        await tenancy.catalog.add_local(owner_id=None, name=body.lora_name, path=path, replace=True)
    except AdapterError as exc:
        raise APIError(400, str(exc), param="lora_path", code="invalid_adapter") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/unload_lora_adapter", response_model=None, responses=_PLAIN)
async def unload_lora_adapter(
    body: UnloadLoRABody, tenancy: TenancyDep, _: AdminDep
) -> PlainTextResponse:
    async with tenancy.db.session() as session:
        adapter = await get_by_name(session, owner_id=None, name=body.lora_name)
    if adapter is None:
        raise APIError(
            404,
            f"no public adapter named {body.lora_name!r}",
            type="not_found_error",
            param="lora_name",
            code="model_not_found",
        )
    await tenancy.catalog.remove(adapter)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long for the filesystem, say: no directory either
        return False
