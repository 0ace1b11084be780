"""The Responses API's shapes checked on a live test server: `SpecWatch` runs
bench.open_responses_spec over everything a server answers under /v1/responses, so each test
that talks to the Responses API checks the shapes it produced without saying so (live_server
fails a module whose server answered anything off the spec)."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bench.open_responses_spec import (
    EVENTS,
    event_violations,
    response_violations,
    sse_violations,
    violations_at,
)

__all__ = ["EVENTS", "SpecWatch", "event_violations", "response_violations"]


class SpecWatch:
    """ASGI middleware: every 200 under /v1/responses (an object, or an event stream)
    checked as it passes; what departs is kept in `violations`, with the path."""

    def __init__(self, app: ASGIApp, violations: list[str]) -> None:
        self.app = app
        self.violations = violations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/responses"):
            await self.app(scope, receive, send)
            return
        status = 0
        kind = ""
        body = bytearray()

        async def watching(message: Message) -> None:
            nonlocal status, kind
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = dict(message.get("headers") or [])
                kind = headers.get(b"content-type", b"").decode()
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
                if not message.get("more_body") and status == 200:
                    self._check(scope["method"], path, kind, bytes(body))
            await send(message)

        await self.app(scope, receive, watching)

    def _check(self, method: str, path: str, kind: str, body: bytes) -> None:
        if kind.startswith("text/event-stream"):
            found: list[str] | None = sse_violations(body.decode())
        else:
            found = violations_at(method, path, json.loads(body))
        self.violations += [f"{method} {path}: {v}" for v in found or ()]
