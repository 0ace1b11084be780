"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with their status.

Every answer the gateway gives is in this shape: APIError and the framework's own errors
through handlers, and anything else that escapes a request through the edge's middleware
(gateway.http.edge), which also gives every request an id (`x-request-id`) to find it in the
log by.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineDead, EngineOverloaded, RequestRefused, StepFailed

RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# The engine's refusals and failures as HTTP, in one place: (the exception's type, status,
# OpenAI's error type, whether a retry may succeed). The first type that matches wins, so a
# subclass comes before its base. A RequestRefused answers with its own code.
ENGINE_ERRORS: tuple[tuple[type[Exception], int, str, bool], ...] = (
    (RequestRefused, 400, "invalid_request_error", False),
    (EngineOverloaded, 503, "server_overloaded", True),
    (EngineDead, 503, "service_unavailable", True),
    (StepFailed, 500, "internal_error", False),
    (RuntimeError, 500, "internal_error", False),
)
# Codes of the failures whose type has none of its own.
ENGINE_CODES: dict[type[Exception], str] = {EngineOverloaded: "queue_full"}


def api_error(exc: Exception, param: str | None = None) -> APIError | None:
    """The APIError an engine-side exception answers with (`param`: the request field it is
    about, if any); None for an unexpected one."""
    if isinstance(exc, APIError):
        return exc
    for kind, status, error_type, retry in ENGINE_ERRORS:
        if isinstance(exc, kind):
            code = exc.code if isinstance(exc, RequestRefused) else ENGINE_CODES.get(kind)
            headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if retry else None
            return APIError(
                status, str(exc), type=error_type, param=param, code=code, headers=headers
            )
    return None


def http_error(exc: StarletteHTTPException) -> APIError:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    headers = dict(exc.headers) if exc.headers else None
    return APIError(exc.status_code, str(exc.detail), type=kind, headers=headers)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers malformed bodies with 400, not FastAPI's 422.
        first = exc.errors()[0] if exc.errors() else {}
        param = validation_param(first.get("loc", ()))
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else "invalid request"
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = http_error(exc)
        if exc.status_code == 405:
            # Starlette names only the first route's methods; RFC 9110 wants every one the
            # path allows.
            err.headers = (err.headers or {}) | {"Allow": ", ".join(_allowed(request))}
        return error_response(err)

    async def on_engine_error(_: Request, exc: Exception) -> JSONResponse:
        err = api_error(exc)
        assert err is not None
        return error_response(err)

    for kind in (EngineOverloaded, EngineDead, RuntimeError):
        app.add_exception_handler(kind, on_engine_error)


def _allowed(request: Request) -> list[str]:
    """Every method some route allows on this path (app.state.routes: what build_app
    included). A path that a route names without parameters is that route's resource alone,
    as OpenAPI matches concrete paths before templated ones: /v1/responses/compact is not a
    response id."""
    routes = getattr(request.app.state, "routes", ())
    matching = [route for route in routes if route.path_regex.match(request.url.path)]
    concrete = [route for route in matching if not route.param_convertors]
    methods: set[str] = set()
    for route in concrete or matching:
        methods |= route.methods or set()
    return sorted(methods)


def validation_param(loc: tuple[int | str, ...] | list[int | str]) -> str | None:
    """A validation error's location as OpenAI's `param` ("messages.0.content"): the body's
    field path, without pydantic's union-branch tags ("str", "list[int]")."""
    parts = [str(p) for p in loc if isinstance(p, int) or p.isdigit() or p.isidentifier()]
    parts = [p for p in parts if p not in _LOCATIONS]
    parts = [p for p in parts if p not in _TYPE_TAGS]
    return ".".join(parts) or None


_LOCATIONS = {"body", "query", "path", "header"}  # where FastAPI found the value, not its name
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
