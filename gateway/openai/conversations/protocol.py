"""The Conversations API's request bodies, bounded at the edge as the Responses API's are, and
its objects as the openai SDK types them (openai.types.conversations).

Items are Responses input items, checked by the very function `POST /v1/responses` checks its
input with (gateway.openai.responses.protocol.input_item): what a text model cannot read is a
400 naming the item's field, never stored. At most 20 are added at a time, as OpenAI says.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from gateway.openai.protocol import _Body
from gateway.openai.responses.items import input_item
from gateway.openai.responses.protocol import Metadata
from tenants.conversations import ItemPage, StoredConversation

MAX_NEW_ITEMS = 20


class ConversationCreate(_Body):
    items: list[dict[str, Any]] | None = Field(None, max_length=MAX_NEW_ITEMS)
    metadata: Metadata | None = None


class ConversationUpdate(_Body):
    # Required, as OpenAI's: the new metadata in place of the old; null clears it.
    metadata: Metadata | None


class ItemsCreate(_Body):
    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_NEW_ITEMS)


# The answers, for the OpenAPI schema (the routes return the bodies below as dicts).


class ConversationObject(BaseModel):
    id: str
    object: Literal["conversation"]
    created_at: int
    metadata: dict[str, str]


class ConversationDeleted(BaseModel):
    id: str
    object: Literal["conversation.deleted"]
    deleted: bool


class ItemList(BaseModel):
    object: Literal["list"]
    # Messages, function calls and their outputs, as the Responses API shapes them.
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


def conversation_items(items: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Input items (the list at `where`, as errors name it) as a conversation holds them.
    Raises FieldError."""
    return [conversation_item(input_item(item, f"{where}[{i}]")) for i, item in enumerate(items)]


def conversation_item(item: dict[str, Any]) -> dict[str, Any]:
    """An item (an input item with its id, or an output item of a response) in the shape a
    conversation lists it (the SDK's ConversationItem): a message has a `status`, an
    `output_text` part its `annotations` and `logprobs`."""
    if item.get("type") != "message":
        return item
    content = [
        {"annotations": [], "logprobs": []} | part if part.get("type") == "output_text" else part
        for part in item.get("content", ())
    ]
    return {"status": "completed"} | item | {"content": content}


def conversation_body(conversation: StoredConversation) -> dict[str, Any]:
    return {
        "id": conversation.id,
        "object": "conversation",
        "created_at": int(conversation.created_at.timestamp()),
        "metadata": conversation.metadata,
    }


def item_page(page: ItemPage) -> dict[str, Any]:
    """A page of items as OpenAI lists them (the SDK's ConversationItemList)."""
    items = page.items
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": page.has_more,
    }
