"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with their status."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import EngineDead, EngineOverloaded

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


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.message, err.type, err.param, err.code), err.status, headers=err.headers
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers malformed bodies with 400, not FastAPI's 422.
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else "invalid request"
        return _response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(EngineOverloaded)
    async def overloaded(_: Request, exc: EngineOverloaded) -> JSONResponse:
        return _response(
            APIError(
                503,
                str(exc),
                type="server_overloaded",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        )

    @app.exception_handler(RuntimeError)
    async def engine_failure(_: Request, exc: RuntimeError) -> JSONResponse:
        return _response(APIError(500, str(exc), type="internal_error"))

    @app.exception_handler(EngineDead)
    async def dead(_: Request, exc: EngineDead) -> JSONResponse:
        return _response(
            APIError(
                503,
                str(exc),
                type="service_unavailable",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        )
