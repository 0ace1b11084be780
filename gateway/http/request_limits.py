"""The bounds on a request that are this server's (its settings, its model), checked before
anything is tokenized or queued; the static ones live in gateway/openai/protocol.py.

Each refusal is a 400 with a `code`: these are the 400s no schema can foresee, and the code
tells them from a value the OpenAPI schema itself rules out (which has none).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.http.errors import APIError

MAX_CHOICES = 256  # prompts x n
# A prompt's characters per token of max_model_len, past which it is refused untokenized.
CHARS_PER_TOKEN = 32

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
    max_prompt_chars: int | None = None  # None: CHARS_PER_TOKEN x max_model_len

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError("max_n must be at least 1")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars must be positive")


class ServerBounds:
    """RequestLimits resolved against a model: its vocabulary and context length."""

    def __init__(self, limits: RequestLimits, vocab_size: int, max_model_len: int) -> None:
        self.max_n = limits.max_n
        self.max_prompt_chars = limits.max_prompt_chars or CHARS_PER_TOKEN * max_model_len
        self.vocab_size = vocab_size

    def check_choices(self, n: int, num_prompts: int) -> None:
        if n > self.max_n:
            raise APIError(
                400, f"n must be at most {self.max_n} on this server", param="n", code=ABOVE_LIMIT
            )
        if num_prompts * n > MAX_CHOICES:
            raise APIError(
                400,
                f"{num_prompts} prompts x n={n} asks for more than {MAX_CHOICES} choices",
                param="n",
                code=ABOVE_LIMIT,
            )

    def check_token_ids(self, ids: Iterable[int] | None, param: str) -> None:
        out_of_vocab = max(ids or (), default=-1)
        if out_of_vocab >= self.vocab_size:
            raise APIError(
                400,
                f"token id {out_of_vocab} is outside the vocabulary [0, {self.vocab_size})",
                param=param,
                code=BAD_TOKEN,
            )

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {num_chars} characters; this server takes at most "
                f"{self.max_prompt_chars} (--max-prompt-chars)",
                param=param,
                code=TOO_LONG,
            )
