"""Runtime adapter loading, vLLM-compatible: /v1/load_lora_adapter, /v1/unload_lora_adapter.

Off unless `--allow-runtime-lora-updating` (as vLLM gates it): until tenancy brings
admin keys, anyone who reaches the port could otherwise swap adapters.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from adapters.peft import AdapterError
from gateway.body import StrictJSONRoute
from gateway.errors import APIError

router = APIRouter(prefix="/v1", tags=["lora"], route_class=StrictJSONRoute)


class LoadLoRABody(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRABody(BaseModel):
    lora_name: str


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRABody, request: Request) -> PlainTextResponse:
    serving = request.app.state.serving
    if body.lora_name == serving.model_name:
        raise APIError(400, "an adapter cannot take the base model's name", param="lora_name")
    registry = serving.adapters
    previous = registry.get(body.lora_name)
    try:
        lora = registry.register(body.lora_name, body.lora_path)
    except AdapterError as exc:
        raise APIError(400, str(exc), param="lora_path") from exc
    if previous is not None and previous.adapter_id != lora.adapter_id:
        _unload_if_unused(request, previous.adapter_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRABody, request: Request) -> PlainTextResponse:
    registry = request.app.state.serving.adapters
    try:
        lora = registry.unregister(body.lora_name)
    except AdapterError as exc:
        raise APIError(404, str(exc), param="lora_name", code="model_not_found") from exc
    _unload_if_unused(request, lora.adapter_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _unload_if_unused(request: Request, adapter_id: str) -> None:
    """Free the engine's copy unless another name still serves the same weights."""
    registry = request.app.state.serving.adapters
    if all(registry.get(name).adapter_id != adapter_id for name in registry.names()):
        request.app.state.serving.engine.unload_lora(adapter_id)
