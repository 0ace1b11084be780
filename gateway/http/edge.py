"""The edge: what every HTTP request crosses before its route, in one middleware and one route
class.

`Edge` (the outermost middleware) gives each request an id (its `x-request-id` header), bounds
its body (413 at once for a declared Content-Length past the limit, else as soon as the bytes
read pass it, with nothing buffered beyond it), sets the headers its path prefix carries (the
console's security headers), counts the /v1 requests refused before the engine, and turns an
exception that no handler took into an OpenAI-shaped 500 naming the request id (logged with
its traceback), so the client gets JSON and its keep-alive connection stays usable.

`StrictJSONRoute` parses a body as RFC 8259 JSON in UTF-8 and nothing looser. Python's json
module accepts NaN and Infinity, strings holding lone surrogates, and nesting as deep as the
interpreter's stack; each then fails somewhere deep inside (the sampler, the tokenizer, a
recursion). pydantic's Rust parser refuses all of them (nesting past 200 levels included), so
such a body is a 400 here. Every router takes it as its route class.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.errors import APIError, error_response, http_error

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"


class InvalidJSON(HTTPException):
    """400. An HTTPException, so that FastAPI's body reading passes it on unchanged."""

    def __init__(self, reason: str) -> None:
        if "surrogate" in reason or "hex escape" in reason:
            reason = f"a string holds a lone UTF-16 surrogate, which is not Unicode text ({reason})"
        super().__init__(400, f"the body is not valid JSON: {reason}")


class BodyTooLarge(HTTPException):
    def __init__(self, max_bytes: int) -> None:
        # The rest of the body is never read: closing the connection stops the sender.
        detail = f"the request body exceeds {max_bytes} bytes"
        super().__init__(413, detail, headers={"connection": "close"})


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = pydantic_core.from_json(await self.body(), allow_inf_nan=False)
            except ValueError as exc:
                raise InvalidJSON(str(exc)) from exc
        return self._json


class StrictJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict_handler


class Edge:
    """The outermost middleware (module docstring). `max_body_bytes` bounds every body but
    those of the paths `body_limits` names (adapter and file uploads: their own limits);
    `path_headers` maps a path prefix to headers every response under it carries, errors
    included."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        body_limits: Mapping[str, int] | None = None,
        path_headers: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_limits = dict(body_limits or {})
        # Shortest prefix first: a more specific prefix's headers are set after, and win.
        self.path_headers = sorted((path_headers or {}).items(), key=lambda kv: len(kv[0]))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = f"req_{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        path = scope["path"]
        added = [h for prefix, h in self.path_headers if _under(path, prefix)]
        limit = self.body_limits.get(path, self.max_body_bytes)
        num_read = 0
        started = ended = False

        async def bounded_receive() -> Message:
            nonlocal num_read
            message = await receive()
            if message["type"] == "http.request":
                num_read += len(message.get("body", b""))
                if num_read > limit:
                    raise BodyTooLarge(limit)
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                headers.append(REQUEST_ID_HEADER, request_id)
                for each in added:
                    headers.update(each)
                _count_rejection(scope, message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        try:
            declared = _content_length(scope)
            if declared is not None and declared > limit:
                raise BodyTooLarge(limit)
            await self.app(scope, bounded_receive, send_with_id)
        except HTTPException as exc:  # the body's bound, before any route took the request
            if not started:
                await error_response(http_error(exc))(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - the last resort: logged, answered in JSON
            logger.exception("request %s failed", request_id)
            if started:  # a response under way can only be ended
                if not ended:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            message = f"internal server error (request id {request_id})"
            err = APIError(500, message, type="internal_error")
            await error_response(err)(scope, receive, send_with_id)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _under(path: str, prefix: str) -> bool:
    return path.startswith(prefix) and (
        len(path) == len(prefix) or prefix.endswith("/") or path[len(prefix)] == "/"
    )


def _count_rejection(scope: Scope, status: int) -> None:
    """A /v1 request refused before the engine (400, 401, 403, 404, 413, 429, ...) writes no
    usage row; it is counted here instead."""
    if 400 <= status < 500 and scope.get("path", "").startswith("/v1/"):
        metrics = getattr(scope["app"].state, "metrics", None)
        if metrics is not None:
            metrics.tenants.rejected.labels(status=str(status)).inc()
