"""The Responses API's WebSocket mode (the Open Responses spec's `x-openresponses-websocket`,
the openai SDK's `client.responses.connect()`): `/v1/responses` upgraded, one socket carrying
several responses in turn.

The client sends `{"type": "response.create", ...}` with the body `POST /v1/responses` takes;
the server answers with the same events a stream sends over SSE, as text frames, until the
response's last one (`response.completed`, `.incomplete` or `.failed`), then reads the next.
Messages sent while a response runs wait their turn. A request refused before it starts (a
malformed body, a 404, a rate limit) is one `{"type": "error", "status": ..., "error": {...}}`
(the spec's WebSocketErrorEvent), and the socket stays open for the next.

The API key is checked at the upgrade: a bad one is refused with its HTTP status and OpenAI's
error body, as `POST` would be. Limits, quotas and usage are the HTTP route's: each response
is admitted and metered on its own, and a client that hangs up mid-response aborts its engine
sequence and is billed for what was produced. `background` has no meaning on a socket the
client holds open (400); `stream` is implied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pydantic
import pydantic_core
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from gateway.http.errors import APIError, error_body, error_response, validation_param
from gateway.http.request_limits import INVALID_VALUE
from gateway.openai.responses.protocol import ResponsesRequest
from gateway.openai.responses.serving import ResponsesServing, Turn
from gateway.tenancy.auth import RequestTenant
from gateway.tenancy.state import Tenancy

logger = logging.getLogger(__name__)

router = APIRouter()

CREATE = "response.create"
MAX_QUEUED = 8  # messages read ahead while a response runs


@router.websocket("/v1/responses")
async def responses_socket(socket: WebSocket) -> None:
    responses: ResponsesServing | None = getattr(socket.app.state, "responses", None)
    tenant = await _authenticate(socket)
    if tenant is None:
        return
    if responses is None:
        await _refuse(socket, APIError(404, "this server does not serve the Responses API"))
        return
    await socket.accept()
    max_bytes: int = socket.app.state.max_body_bytes
    reader = _Reader(socket)
    try:
        while (message := await reader.messages.get()) is not None:
            try:
                body = _create_body(message, max_bytes)
                turn = await responses.begin(body, tenant)
            except APIError as exc:
                await socket.send_json(socket_error(exc))
                continue
            if not await _stream(socket, reader, responses, turn):
                return
    except (WebSocketDisconnect, RuntimeError):
        return  # gone while we wrote to it
    finally:
        reader.task.cancel()


class _Reader:
    """Reads the socket for its whole life: messages queue up in order (one sent while a
    response runs is taken when it ends), and a hang-up is known at once."""

    def __init__(self, socket: WebSocket) -> None:
        self.socket = socket
        self.messages: asyncio.Queue[str | None] = asyncio.Queue(maxsize=MAX_QUEUED)
        self.closed = asyncio.Event()
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            while True:
                message = await self.socket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    text = (message.get("bytes") or b"").decode("utf-8", "replace")
                await self.messages.put(text)  # a full queue: the client waits (TCP)
        finally:
            self.closed.set()
            with contextlib.suppress(asyncio.QueueFull):
                self.messages.put_nowait(None)


async def _stream(
    socket: WebSocket, reader: _Reader, responses: ResponsesServing, turn: Turn
) -> bool:
    """One response's events onto the socket; False if the client hung up. A hang-up stops
    the response at once, waiting for a token or not: its engine sequence is aborted and the
    usage row says what was produced (as for an SSE client gone)."""
    events = responses.event_dicts(turn)
    try:
        while True:
            following = asyncio.ensure_future(anext(events))
            closed = asyncio.ensure_future(reader.closed.wait())
            await asyncio.wait({following, closed}, return_when=asyncio.FIRST_COMPLETED)
            closed.cancel()
            if not following.done():
                following.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await following
                return False
            try:
                event = following.result()
            except StopAsyncIteration:
                return True
            await socket.send_json(event)
    finally:
        try:
            await turn.answer.abandon()  # nothing if the response ran to its end
        finally:
            await events.aclose()


def _create_body(message: str, max_bytes: int) -> ResponsesRequest:
    """A `response.create` message as the request body. Raises APIError (400, 413)."""
    if len(message.encode()) > max_bytes:
        raise APIError(413, f"the message exceeds {max_bytes} bytes")
    try:
        data = pydantic_core.from_json(message, allow_inf_nan=False)
    except ValueError as exc:
        raise APIError(400, f"the message is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("type") != CREATE:
        raise APIError(400, f"a message is {{'type': '{CREATE}', ...}}", param="type")
    fields = {k: v for k, v in data.items() if k != "type"}
    if fields.get("background"):
        raise APIError(
            400,
            "a response on a socket streams to it; background responses are POSTed",
            param="background",
            code=INVALID_VALUE,
        )
    if fields.get("generate") is False:
        raise APIError(
            400,
            "generate false (preparing a response without generating it) is not supported",
            param="generate",
            code=INVALID_VALUE,
        )
    try:
        return ResponsesRequest.model_validate(fields | {"stream": True})
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        param = validation_param(first["loc"])
        raise APIError(400, f"{param}: {first['msg']}", param=param) from exc


async def _authenticate(socket: WebSocket) -> RequestTenant | None:
    """The tenant the upgrade's key names; None once the upgrade was refused."""
    tenancy: Tenancy = socket.app.state.tenancy
    if tenancy.no_auth_tenant is not None:
        return tenancy.no_auth_tenant
    try:
        return await tenancy.auth.authenticate(socket.headers.get("authorization"))
    except APIError as exc:
        await _refuse(socket, exc)
        return None


async def _refuse(socket: WebSocket, exc: APIError) -> None:
    """Refuse the upgrade with the HTTP status and body `POST` would answer; a server
    without the ASGI denial-response extension gets the error event and a policy close."""
    if "websocket.http.response" in socket.scope.get("extensions", {}):
        await socket.send_denial_response(error_response(exc))
        return
    await socket.accept()
    await socket.send_json(socket_error(exc))
    await socket.close(code=1008)


def socket_error(exc: APIError) -> dict[str, Any]:
    """The spec's WebSocketErrorEvent: the HTTP status, and OpenAI's error object (with the
    headers, Retry-After among them, that an HTTP answer would carry)."""
    error = error_body(exc.message, exc.type, exc.param, exc.code)["error"]
    if exc.headers:
        error["headers"] = dict(exc.headers)
    return {"type": "error", "status": exc.status, "error": error}
