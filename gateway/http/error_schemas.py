"""What the routes answer besides success, for the OpenAPI schema: every error is the
OpenAI-shaped body with its status (gateway/http/errors.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from gateway.http.errors import APIError


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_response(description: str, **extra: Any) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description} | extra


_RETRY = {"headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}}

# Every route: a body that is not JSON (400), too large (413), a bug (500).
COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    400: error_response("Invalid request: a field out of bounds, or a body that is not JSON."),
    413: error_response("The request body is too large."),
    500: error_response("A request that alone made an engine step fail, or a server bug."),
}
OPENAI_ERRORS: dict[int | str, dict[str, Any]] = COMMON_ERRORS | {
    401: error_response("Missing, unknown or expired API key (`invalid_api_key`)."),
    403: error_response("Revoked key (`key_revoked`) or suspended tenant (`tenant_suspended`)."),
    404: error_response("No such model for this tenant (`model_not_found`)."),
    503: error_response("The queue is full or the engine is restarting.", **_RETRY),
}
ADMIN_ERRORS: dict[int | str, dict[str, Any]] = COMMON_ERRORS | {
    401: error_response("Missing, malformed, expired or wrongly signed admin token."),
    403: error_response("The token lacks the `admin` scope."),
    404: error_response("No such tenant, key or adapter."),
    409: error_response("The name is taken."),
}


def not_found(kind: str, param: str) -> APIError:
    return APIError(404, f"no such {kind}", type="not_found_error", param=param, code="not_found")
