"""Why the engine did not serve a request, as types: the gateway answers each with its own
HTTP status and error code (gateway/http/errors.py holds the table), never by reading a message.

Each crosses the engine process's pipe as it is (pickled), so each takes one message."""

from __future__ import annotations


class RequestRefused(ValueError):
    """The engine will not take this request as asked (HTTP 400); `code` is OpenAI's."""

    code = "invalid_value"


class ContextLengthExceeded(RequestRefused):
    """The prompt plus max_tokens does not fit the model's context."""

    code = "context_length_exceeded"


class GuidedSpecError(RequestRefused):
    """A guided-decoding spec the engine refuses: invalid, unsupported, over a limit, or too
    slow to compile."""

    code = "invalid_grammar"


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the caller should retry later (HTTP 503)."""


class EngineDead(RuntimeError):
    """The step loop is not running (HTTP 503)."""


class StepFailed(RuntimeError):
    """The request failed inside an engine step; the engine contained it and serves on
    (HTTP 500)."""
