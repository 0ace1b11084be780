"""The Responses API over the chat path (gateway.openai.chat): a response is a chat request
made of the stored conversation (`previous_response_id`, or a `conversation`'s items, to which
its turn is appended: gateway.openai.conversations) and this turn's input, admitted,
metered (one usage row, endpoint `responses`) and answered as chat is; its result is stored
per tenant (unless `store: false`) for later turns, `GET`, `input_items` and deletion.

Stored responses are the tenant's alone: another tenant's id answers exactly as an id that
never existed (404). A background response runs detached from its HTTP request in this
gateway's task set; `cancel` aborts it in the engine; a gateway that restarts marks the ones
it left unfinished `failed` (tenants.responses.ResponseStore.fail_unfinished).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response

from gateway.http.errors import APIError
from gateway.http.request_limits import INVALID_VALUE
from gateway.models.served import ServedModel
from gateway.openai.answer import Answer
from gateway.openai.chat import ChatServing
from gateway.openai.conversations.serving import ConversationsServing
from gateway.openai.conversations.serving import not_found as conversation_not_found
from gateway.openai.json_response import Disconnected, collect, json_body, unless_disconnected
from gateway.openai.protocol import ChatCompletionRequest, FieldError
from gateway.openai.responses.events import EventStream, sse
from gateway.openai.responses.items import chat_messages, new_id
from gateway.openai.responses.objects import (
    ResponseMeta,
    item_list,
    message_item,
    output_items,
    status_of,
    usage_body,
)
from gateway.openai.responses.protocol import InputTokensRequest, ResponseFields, ResponsesRequest
from gateway.openai.serving import CLIENT_CLOSED_REQUEST, Generation, OpenAIServing
from gateway.openai.sse import MeteredStream, chunk_bodies
from gateway.tenancy.auth import RequestTenant
from tenants.responses import BEAT_INTERVAL, ResponseStore, StoredResponse

logger = logging.getLogger(__name__)

CANCEL_WAIT = 10.0  # seconds `cancel` waits for the engine to stop the response


def not_found(response_id: str, param: str | None = None) -> APIError:
    """The one answer for an id that does not exist, expired, or is another tenant's."""
    return APIError(
        404,
        f"Response with id '{response_id}' not found.",
        param=param,
        code="response_not_found",
    )


@dataclass(slots=True)
class Turn:
    """A response admitted and at its engine: what it echoes, the chat answer it streams
    from, its tenant, and this turn's input items (stored with it)."""

    meta: ResponseMeta
    answer: Answer
    tenant: RequestTenant
    items: list[dict[str, Any]]


class ResponsesServing:
    def __init__(
        self,
        serving: OpenAIServing,
        store: ResponseStore,
        conversations: ConversationsServing | None = None,
    ) -> None:
        self.serving = serving
        self.chat = ChatServing(serving)
        self.store = store
        self.conversations = conversations
        self._background: dict[str, asyncio.Task[None]] = {}
        self._beating: asyncio.Task[None] | None = None

    # -- POST /v1/responses -------------------------------------------------------------------

    async def create(
        self, body: ResponsesRequest, tenant: RequestTenant, disconnected: Disconnected | None
    ) -> Response:
        turn = await self.begin(body, tenant)
        meta, answer = turn.meta, turn.answer
        if body.background:
            return await self._detach(meta, answer, tenant, turn.items)
        if body.stream:
            return MeteredStream(
                (sse(event) async for event in self.event_dicts(turn)),
                on_close=answer.abandon,
                media_type="text/event-stream",
                headers=answer.headers,
            )
        if not await unless_disconnected(collect(answer), disconnected):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        response = await self.result(meta, answer)
        await self._save(meta, tenant, turn.items, response)
        return JSONResponse(response, headers=answer.headers)

    async def prepare(
        self, body: ResponseFields, tenant: RequestTenant
    ) -> tuple[list[dict[str, Any]], ChatCompletionRequest]:
        """This turn's input items, and the chat request that answers it: the stored history
        (`previous_response_id`, or the conversation's items), instructions, tools, format.
        Raises APIError (400 naming the field, 404 for an unknown id)."""
        try:
            body.check()
            items = body.input_items()
        except FieldError as exc:
            raise APIError(400, str(exc), param=exc.param, code=INVALID_VALUE) from exc
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = await self.history(tenant, body.previous_response_id)
        if body.conversation_id is not None:  # the turn is appended by _save
            if self.conversations is None:  # a server that keeps none has not this one
                raise conversation_not_found(body.conversation_id, "conversation")
            history = await self.conversations.history(tenant, body.conversation_id, items)
        messages = chat_messages(body.instructions, history + items)
        if body.truncation == "auto":
            model, _ = await self.serving.resolve_model(body.model, tenant)
            messages = await asyncio.to_thread(_fit, model, messages, body.max_output_tokens)
        try:
            return items, body.chat_request(messages)
        except FieldError as exc:
            raise APIError(400, str(exc), param=exc.param, code=INVALID_VALUE) from exc

    async def history(self, tenant: RequestTenant, response_id: str) -> list[dict[str, Any]]:
        """The items of a stored response's chain, oldest first: each turn's input, then its
        output. Raises the 404 an unknown (or another tenant's) id gets."""
        chain = await self.store.chain(tenant.id, response_id)
        if chain is None:
            raise not_found(response_id, "previous_response_id")
        return [item for turn in chain for item in turn.input_items + turn.output]

    async def begin(self, body: ResponsesRequest, tenant: RequestTenant) -> Turn:
        """The response admitted and at its engine (HTTP and the WebSocket mode alike): from
        here on it ends with exactly one usage row. Raises APIError."""
        meta, items, generation = await self.generation(body, tenant)
        with _input_param():
            answer = await self.serving.start(generation, tenant)
        return Turn(meta, answer, tenant, items)

    async def generation(
        self, body: ResponsesRequest, tenant: RequestTenant
    ) -> tuple[ResponseMeta, list[dict[str, Any]], Generation]:
        """The response to be (its id, what it echoes), this turn's input items, and the chat
        generation that answers it, not yet started (a batch line starts it its own way:
        gateway.openai.batches). Raises APIError."""
        items, chat = await self.prepare(body, tenant)
        meta = ResponseMeta(new_id("resp"), body)
        with _input_param():
            # The usage row's request id is the response's: billing joins the two.
            generation = await self.chat.generation(chat, tenant, "responses", meta.id)
        return meta, items, generation

    async def input_tokens(self, body: InputTokensRequest, tenant: RequestTenant) -> dict[str, Any]:
        """`POST /v1/responses/input_tokens`: the prompt the same body would run, counted
        (template, tools, instructions and history included), without running it: nothing
        admitted, nothing billed."""
        _, chat = await self.prepare(body, tenant)
        generation = await self.chat.generation(chat, tenant, "responses")
        return {"object": "response.input_tokens", "input_tokens": len(generation.prompts[0])}

    async def result(self, meta: ResponseMeta, answer: Answer) -> dict[str, Any]:
        """The collected chat answer as the response object."""
        chat = await json_body(answer, self.serving.checks)
        (choice,) = chat["choices"]
        reason = choice["finish_reason"]
        error = choice.get("error")
        return meta.body(
            status_of(reason),
            output_items(choice),
            usage_body(chat["usage"]),
            error=None if error is None else {"code": "invalid_output", "message": str(error)},
            finish_reason=reason,
        )

    async def event_dicts(self, turn: Turn) -> AsyncGenerator[dict[str, Any]]:
        """The turn's stream events, in order (SSE frames them; the WebSocket mode sends
        them as they are); the response is stored before its last event."""
        stream = EventStream(turn.meta)
        for event in stream.start():
            yield event
        answer = turn.answer
        closing: list[dict[str, Any]] | None = None
        async with contextlib.aclosing(chunk_bodies(answer, self.serving.checks)) as chunks:
            async for chunk in chunks:
                if "error" in chunk and "choices" not in chunk:
                    closing, response = stream.fail(chunk["error"])
                    break
                for event in stream.chunk(chunk):
                    yield event
        if closing is None:
            usage = usage_body(answer.usage.body(answer.choices))
            closing, response = stream.finish(status_of(stream.finish_reason), usage)
        # Stored before the client hears the end: what it saw complete, it can fetch.
        await self._save(turn.meta, turn.tenant, turn.items, response)
        for event in closing:
            yield event

    # -- background ---------------------------------------------------------------------------

    async def _detach(
        self,
        meta: ResponseMeta,
        answer: Answer,
        tenant: RequestTenant,
        items: list[dict[str, Any]],
    ) -> Response:
        pending = meta.body("in_progress", [])
        await self._save(meta, tenant, items, pending)
        task = asyncio.create_task(self._run_detached(meta, answer, tenant, items))
        self._background[meta.id] = task
        task.add_done_callback(lambda _: self._background.pop(meta.id, None))
        if self._beating is None or self._beating.done():
            self._beating = asyncio.create_task(self._beat())
        return JSONResponse(pending, headers=answer.headers)

    async def _beat(self) -> None:
        """While background responses run here, say so: a gateway that falls silent has
        stopped, and any gateway's sweep fails what it was running."""
        while self._background:
            await asyncio.sleep(BEAT_INTERVAL)
            try:
                await self.store.beat(list(self._background))
            except Exception:  # noqa: BLE001 - the next beat tries again
                logger.exception("could not record that background responses still run")

    async def _run_detached(
        self,
        meta: ResponseMeta,
        answer: Answer,
        tenant: RequestTenant,
        items: list[dict[str, Any]],
    ) -> None:
        try:
            await collect(answer)  # writes the usage row however it ends
            response = await self.result(meta, answer)
        except asyncio.CancelledError:
            text = answer.choices[0].text
            output = [message_item(new_id("msg"), text, "incomplete")] if text else []
            response = meta.body("cancelled", output)
        except Exception as exc:  # noqa: BLE001 - the response records it
            logger.exception("background response %s failed", meta.id)
            error = {"code": "server_error", "message": str(exc) or type(exc).__name__}
            response = meta.body("failed", [], error=error)
        await self._save(meta, tenant, items, response)

    async def cancel(self, tenant: RequestTenant, response_id: str) -> dict[str, Any]:
        stored = await self.store.get(tenant.id, response_id)
        if stored is None:
            raise not_found(response_id)
        if not stored.background:
            raise APIError(400, "Only background responses can be cancelled.", code=INVALID_VALUE)
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=CANCEL_WAIT)
            stored = await self.store.get(tenant.id, response_id) or stored
        return stored.body

    async def shutdown(self) -> None:
        """Background responses end as cancelled, their rows and results written."""
        if self._beating is not None:
            self._beating.cancel()
        tasks = list(self._background.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_WAIT)

    # -- stored responses ---------------------------------------------------------------------

    async def retrieve(self, tenant: RequestTenant, response_id: str) -> dict[str, Any]:
        stored = await self.store.get(tenant.id, response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.body

    async def delete(self, tenant: RequestTenant, response_id: str) -> dict[str, Any]:
        if await self.store.get(tenant.id, response_id) is None:
            raise not_found(response_id)
        task = self._background.get(response_id)
        if task is not None:  # stopped first: its last save would write the row back
            task.cancel()
            await asyncio.wait([task], timeout=CANCEL_WAIT)
        if not await self.store.delete(tenant.id, response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def input_items(
        self,
        tenant: RequestTenant,
        response_id: str,
        order: str,
        limit: int,
        after: str | None,
    ) -> dict[str, Any]:
        stored = await self.store.get(tenant.id, response_id)
        if stored is None:
            raise not_found(response_id)
        return item_list(stored.input_items, order, limit, after)

    async def _save(
        self,
        meta: ResponseMeta,
        tenant: RequestTenant,
        items: list[dict[str, Any]],
        response: dict[str, Any],
    ) -> None:
        request = meta.request
        if self.conversations is not None and request.conversation_id is not None:
            await self.conversations.append_turn(tenant, request.conversation_id, items, response)
        if not request.store:
            return
        await self.store.save(
            StoredResponse(
                id=meta.id,
                tenant_id=tenant.id,
                key_id=tenant.key_id,
                model=request.model,
                status=response["status"],
                background=request.background,
                previous_response_id=request.previous_response_id,
                input_items=items,
                output=response["output"],
                body=response,
                created_at=meta.created,
                expires_at=self.store.new_expiry(),
            )
        )


@contextlib.contextmanager
def _input_param() -> Iterator[None]:
    """A refusal of the chat's `messages` is of this API's `input`."""
    try:
        yield
    except APIError as exc:
        if exc.param == "messages":
            exc.param = "input"
        raise


def _fit(
    model: ServedModel, messages: list[dict[str, Any]], max_output_tokens: int | None
) -> list[dict[str, Any]]:
    """`truncation: auto`: the oldest turns dropped (never the system message or the last
    one) until the prompt leaves room for the output in the model's context."""
    budget = model.engine.facts.max_model_len - (max_output_tokens or 1)
    kept = list(messages)
    while True:
        try:
            encoded = model.tokenizer.apply_chat_template(
                kept, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            ids = encoded["input_ids"]
        except Exception:  # noqa: BLE001 - a template that cannot count this: the engine will
            return kept
        if len(ids) <= budget:
            return kept
        first = next((i for i, m in enumerate(kept) if m["role"] != "system"), None)
        if first is None or first == len(kept) - 1:
            return kept  # only the last turn is left: too long is the engine's 400
        del kept[first]
        while first < len(kept) - 1 and kept[first]["role"] == "tool":
            del kept[first]  # a call's output without its call
