"""The Conversations API: /v1/conversations and their items (gateway.openai.conversations)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query

from gateway.http.deps import app_service
from gateway.http.edge import StrictJSONRoute
from gateway.http.error_schemas import OPENAI_ERRORS, error_response
from gateway.openai.conversations.protocol import (
    ConversationCreate,
    ConversationDeleted,
    ConversationObject,
    ConversationUpdate,
    ItemList,
    ItemsCreate,
)
from gateway.openai.conversations.serving import ConversationsServing
from gateway.openai.responses.items import MAX_ID_CHARS
from gateway.tenancy.auth import TenantDep

_ERRORS = OPENAI_ERRORS | {
    404: error_response(
        "No such conversation (`conversation_not_found`) or item (`item_not_found`) for this "
        "tenant: another tenant's answers as one that never existed."
    ),
}
# Items are Responses input items: what they hold is checked beyond the schema.
_TAKES_ITEMS: dict[int | str, dict[str, Any]] = {
    400: error_response(
        "Invalid request: a field out of bounds, a body that is not JSON, or an item this "
        "server cannot take (`invalid_value`: a type or content part a text model cannot "
        "read, an item id the conversation holds already; `conversation_full`)."
    ),
}

router = APIRouter(
    prefix="/v1/conversations",
    tags=["conversations"],
    route_class=StrictJSONRoute,
    responses=_ERRORS,
)


get_conversations = app_service(ConversationsServing, "conversations", "Conversations API")


ConversationsDep = Annotated[ConversationsServing, Depends(get_conversations)]

# Ids as path parameters: bounded in the schema, so a longer one is the same 400 as any other
# malformed field.
ConversationId = Annotated[str, Path(max_length=MAX_ID_CHARS)]
ItemId = Annotated[str, Path(max_length=MAX_ID_CHARS)]


@router.post("", response_model=ConversationObject, responses=_TAKES_ITEMS)
async def create_conversation(
    body: ConversationCreate, conversations: ConversationsDep, tenant: TenantDep
) -> dict[str, Any]:
    return await conversations.create(body, tenant)


@router.get("/{conversation_id}", response_model=ConversationObject)
async def retrieve_conversation(
    conversation_id: ConversationId, conversations: ConversationsDep, tenant: TenantDep
) -> dict[str, Any]:
    return await conversations.retrieve(tenant, conversation_id)


@router.post("/{conversation_id}", response_model=ConversationObject)
async def update_conversation(
    conversation_id: ConversationId,
    body: ConversationUpdate,
    conversations: ConversationsDep,
    tenant: TenantDep,
) -> dict[str, Any]:
    return await conversations.update(tenant, conversation_id, body)


@router.delete("/{conversation_id}", response_model=ConversationDeleted)
async def delete_conversation(
    conversation_id: ConversationId, conversations: ConversationsDep, tenant: TenantDep
) -> dict[str, Any]:
    return await conversations.delete(tenant, conversation_id)


@router.get("/{conversation_id}/items", response_model=ItemList)
async def list_items(
    conversation_id: ConversationId,
    conversations: ConversationsDep,
    tenant: TenantDep,
    order: Literal["asc", "desc"] = "desc",
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=MAX_ID_CHARS)] = None,
) -> dict[str, Any]:
    return await conversations.list_items(tenant, conversation_id, order, limit, after)


@router.post("/{conversation_id}/items", response_model=ItemList, responses=_TAKES_ITEMS)
async def create_items(
    conversation_id: ConversationId,
    body: ItemsCreate,
    conversations: ConversationsDep,
    tenant: TenantDep,
) -> dict[str, Any]:
    return await conversations.add_items(tenant, conversation_id, body)


@router.get("/{conversation_id}/items/{item_id}")
async def retrieve_item(
    conversation_id: ConversationId,
    item_id: ItemId,
    conversations: ConversationsDep,
    tenant: TenantDep,
) -> dict[str, Any]:
    return await conversations.get_item(tenant, conversation_id, item_id)


@router.delete("/{conversation_id}/items/{item_id}", response_model=ConversationObject)
async def delete_item(
    conversation_id: ConversationId,
    item_id: ItemId,
    conversations: ConversationsDep,
    tenant: TenantDep,
) -> dict[str, Any]:
    return await conversations.delete_item(tenant, conversation_id, item_id)
