"""The bounds on a request that are this server's settings, and the codes of its refusals;
each served model resolves them against its vocabulary and context length
(gateway.models.served.ServerBounds), checked before anything is tokenized or queued. The
static bounds live in gateway/openai/protocol.py.

Each refusal is a 400 with a `code`: these are the 400s no schema can foresee, and the code
tells them from a value the OpenAPI schema itself rules out (which has none).
"""

from __future__ import annotations

from dataclasses import dataclass

ABOVE_LIMIT = "above_server_limit"
BAD_TOKEN = "invalid_token_id"
EMPTY_PROMPT = "empty_prompt"
INVALID_VALUE = "invalid_value"
INVALID_GRAMMAR = "invalid_grammar"
TOO_LONG = "string_above_max_length"


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The bounds that are the server's settings (docs/failure-isolation.md, "Request bounds")."""

    max_n: int = 16
    max_prompt_chars: int | None = None  # None: CHARS_PER_TOKEN x max_model_len (served.py)

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError("max_n must be at least 1")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars must be positive")
