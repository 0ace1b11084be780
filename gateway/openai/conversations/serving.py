"""The Conversations API over the tenant's stored conversations
(tenants.conversations.ConversationStore), and the two things a response that names a
conversation asks of it (gateway.openai.responses.serving): the items to run before its
input (`history`), and its turn appended once it has finished (`append_turn`).

A conversation and its items are the tenant's alone: another tenant's conversation id, or item
id, answers exactly as one that never existed (404), on every route.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, Literal

from gateway.http.errors import APIError
from gateway.http.request_limits import INVALID_VALUE
from gateway.openai.conversations.protocol import (
    ConversationCreate,
    ConversationUpdate,
    ItemsCreate,
    conversation_body,
    conversation_item,
    conversation_items,
    item_page,
)
from gateway.openai.protocol import FieldError
from gateway.openai.responses.items import new_id
from gateway.tenancy.auth import RequestTenant
from tenants.conversations import (
    MAX_ITEMS,
    ConversationFull,
    ConversationStore,
    DuplicateItem,
    ItemNotFound,
    ItemPage,
    StoredConversation,
)

logger = logging.getLogger(__name__)

# The statuses of a response whose turn is appended: it produced its answer (`incomplete`:
# cut at max_output_tokens, its output what the model said, as OpenAI keeps it). A failed or
# cancelled response appends nothing: the conversation stays as it was before the turn, which
# can be sent again. A background one appends when it finishes, not while it runs.
APPENDED_STATUSES = ("completed", "incomplete")


def not_found(conversation_id: str, param: str | None = None) -> APIError:
    """The one answer for a conversation that does not exist, expired, or is another
    tenant's."""
    return APIError(
        404,
        f"Conversation with id '{conversation_id}' not found.",
        param=param,
        code="conversation_not_found",
    )


def item_not_found(item_id: str) -> APIError:
    return APIError(404, f"Item with id '{item_id}' not found.", code="item_not_found")


def _duplicate(item_id: str, param: str) -> APIError:
    return APIError(
        400,
        f"Duplicate item found with id '{item_id}': the conversation holds it already.",
        param=param,
        code=INVALID_VALUE,
    )


def _full(conversation_id: str, param: str) -> APIError:
    return APIError(
        400,
        f"Conversation '{conversation_id}' holds {MAX_ITEMS} items, as many as one may.",
        param=param,
        code="conversation_full",
    )


def _checked(items: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    try:
        return conversation_items(items, where)
    except FieldError as exc:
        raise APIError(400, str(exc), param=exc.param, code=INVALID_VALUE) from exc


class ConversationsServing:
    def __init__(self, store: ConversationStore) -> None:
        self.store = store

    # -- conversations ------------------------------------------------------------------------

    async def create(self, body: ConversationCreate, tenant: RequestTenant) -> dict[str, Any]:
        items = _checked(body.items or [], "items")
        now = datetime.now(UTC)
        conversation = StoredConversation(
            id=new_id("conv"),
            tenant_id=tenant.id,
            key_id=tenant.key_id,
            metadata=dict(body.metadata or {}),
            created_at=now,
            expires_at=self.store.new_expiry(now),
        )
        try:
            await self.store.create(conversation, items)
        except DuplicateItem as exc:
            raise _duplicate(exc.item_id, "items") from exc
        return conversation_body(conversation)

    async def retrieve(self, tenant: RequestTenant, conversation_id: str) -> dict[str, Any]:
        found = await self.store.get(tenant.id, conversation_id)
        if found is None:
            raise not_found(conversation_id)
        return conversation_body(found)

    async def update(
        self, tenant: RequestTenant, conversation_id: str, body: ConversationUpdate
    ) -> dict[str, Any]:
        metadata = dict(body.metadata or {})
        found = await self.store.update_metadata(tenant.id, conversation_id, metadata)
        if found is None:
            raise not_found(conversation_id)
        return conversation_body(found)

    async def delete(self, tenant: RequestTenant, conversation_id: str) -> dict[str, Any]:
        if not await self.store.delete(tenant.id, conversation_id):
            raise not_found(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    # -- items --------------------------------------------------------------------------------

    async def add_items(
        self, tenant: RequestTenant, conversation_id: str, body: ItemsCreate
    ) -> dict[str, Any]:
        """The items appended, in their order; the list of them as stored."""
        items = _checked(body.items, "items")
        try:
            added = await self.store.add_items(tenant.id, conversation_id, items)
        except DuplicateItem as exc:
            raise _duplicate(exc.item_id, "items") from exc
        except ConversationFull as exc:
            raise _full(conversation_id, "items") from exc
        if not added:
            raise not_found(conversation_id)
        return item_page(ItemPage(items, has_more=False))

    async def list_items(
        self,
        tenant: RequestTenant,
        conversation_id: str,
        order: Literal["asc", "desc"],
        limit: int,
        after: str | None,
    ) -> dict[str, Any]:
        page = await self.store.list_items(tenant.id, conversation_id, order, limit, after)
        if page is None:
            raise not_found(conversation_id)
        return item_page(page)

    async def get_item(
        self, tenant: RequestTenant, conversation_id: str, item_id: str
    ) -> dict[str, Any]:
        try:
            found = await self.store.get_item(tenant.id, conversation_id, item_id)
        except ItemNotFound as exc:
            raise item_not_found(item_id) from exc
        if found is None:
            raise not_found(conversation_id)
        return found

    async def delete_item(
        self, tenant: RequestTenant, conversation_id: str, item_id: str
    ) -> dict[str, Any]:
        """The conversation, as OpenAI answers an item's deletion."""
        try:
            found = await self.store.delete_item(tenant.id, conversation_id, item_id)
        except ItemNotFound as exc:
            raise item_not_found(item_id) from exc
        if found is None:
            raise not_found(conversation_id)
        return conversation_body(found)

    # -- a response's turn (POST /v1/responses with `conversation`) ---------------------------

    async def history(
        self, tenant: RequestTenant, conversation_id: str, items: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The conversation's items, oldest first: what comes before a response's input
        `items`. Raises APIError: 404 for a conversation the tenant lacks (param
        `conversation`), 400 for one that is full, or for an input item whose id the
        conversation (or the input itself) holds already (param `input`), which could not be
        appended after the response."""
        held = await self.store.items(tenant.id, conversation_id)
        if held is None:
            raise not_found(conversation_id, "conversation")
        if len(held) >= MAX_ITEMS:
            raise _full(conversation_id, "conversation")
        seen = {item["id"] for item in held}
        for item in items:
            if item["id"] in seen:
                raise _duplicate(item["id"], "input")
            seen.add(item["id"])
        return held

    async def append_turn(
        self,
        tenant: RequestTenant,
        conversation_id: str,
        items: list[dict[str, Any]],
        response: dict[str, Any],
    ) -> None:
        """A finished response's turn, its input `items` then its output items, appended in
        one transaction, if its status is one of APPENDED_STATUSES (otherwise nothing is).

        Called once the response has finished, before its client hears the end. What
        `history` checked can change while a response runs (the conversation deleted or
        expired, filled, given one of the input's ids by another request): then the turn is
        not kept and a warning is logged, and the response itself stands (it ran, and was
        metered)."""
        if response.get("status") not in APPENDED_STATUSES:
            return
        turn = [conversation_item(item) for item in [*items, *response.get("output", ())]]
        try:
            added = await self.store.add_items(tenant.id, conversation_id, turn)
        except (DuplicateItem, ConversationFull) as exc:
            logger.warning(
                "response %s: its turn not appended to conversation %s: %s",
                response.get("id"),
                conversation_id,
                exc,
            )
            return
        if not added:
            logger.warning(
                "response %s: conversation %s went while it ran; its turn not appended",
                response.get("id"),
                conversation_id,
            )
