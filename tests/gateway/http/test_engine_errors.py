"""gateway/http/errors.py's table: every engine refusal and failure answers with one status, type
and code, whatever its message says."""

from __future__ import annotations

import pytest

from engine.errors import (
    ContextLengthExceeded,
    EngineDead,
    EngineOverloaded,
    GuidedSpecError,
    RequestRefused,
    StepFailed,
)
from gateway.http.errors import api_error


@pytest.mark.parametrize(
    ("error", "status", "kind", "code", "retry"),
    [
        (ContextLengthExceeded("reworded at will"), 400, "invalid_request_error",
         "context_length_exceeded", False),
        (GuidedSpecError("x"), 400, "invalid_request_error", "invalid_grammar", False),
        (RequestRefused("x"), 400, "invalid_request_error", "invalid_value", False),
        (EngineOverloaded("x"), 503, "server_overloaded", "queue_full", True),
        (EngineDead("x"), 503, "service_unavailable", None, True),
        (StepFailed("x"), 500, "internal_error", None, False),
        (RuntimeError("x"), 500, "internal_error", None, False),
    ],
)  # fmt: skip
def test_each_engine_error_has_its_status_and_code(
    error: Exception, status: int, kind: str, code: str | None, retry: bool
) -> None:
    answer = api_error(error, param="prompt")
    assert answer is not None
    assert (answer.status, answer.type, answer.code) == (status, kind, code)
    assert answer.body()["error"] == {
        "message": str(error), "type": kind, "param": "prompt", "code": code
    }  # fmt: skip
    assert ("Retry-After" in (answer.headers or {})) == retry


def test_an_unexpected_error_is_left_to_the_error_boundary() -> None:
    assert api_error(KeyError("x")) is None
    assert api_error(ValueError("a bug, not a refusal")) is None
