"""Request bodies: their size counted on the bytes actually read, their JSON parsed strictly.

Python's json module accepts NaN and Infinity, strings holding lone surrogates, and
nesting as deep as the interpreter's stack; each then fails somewhere deep inside (the
sampler, the tokenizer, a recursion). pydantic's Rust parser refuses all of them (nesting
past 200 levels included), so a body that is not RFC 8259 JSON in UTF-8 is a 400 at the
edge. Every router takes `StrictJSONRoute` as its route class.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


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


class BodySizeLimit:
    """413 once a body passes `max_bytes`: at once for a declared Content-Length, else as
    soon as the bytes read pass it (chunked bodies), with nothing buffered beyond it."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, overrides: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.overrides = overrides or {}  # path -> its own limit (adapter uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.overrides.get(scope["path"], self.max_bytes)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            raise BodyTooLarge(limit)
        num_read = 0

        async def limited_receive() -> Message:
            nonlocal num_read
            message = await receive()
            if message["type"] == "http.request":
                num_read += len(message.get("body", b""))
                if num_read > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
