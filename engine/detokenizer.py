"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE: a multi-byte UTF-8
character may span tokens, and decoding a prefix of it yields U+FFFD. We keep
two offsets into the token ids (vLLM's scheme): text is emitted only when
decoding [prefix_offset:] grows past decoding [prefix_offset:read_offset]
and does not end in a replacement character.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Start a few tokens back into the prompt so the first output token decodes
# with the context that decides its leading space.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    __slots__ = (
        "_decode",
        "_token_ids",
        "_prefix_offset",
        "_read_offset",
        "text",
        "_stop",
        "_max_stop_len",
        "_skip_special",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool,
    ) -> None:
        # The Rust tokenizer directly: transformers' decode() wrapper costs more
        # than the decoding itself at one call per token.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode: Callable[..., str] = (
            backend.decode if backend is not None else tokenizer.decode
        )
        self._skip_special = skip_special_tokens
        self._token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self.text = ""
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)

    def _text_of(self, ids: list[int]) -> str:
        return self._decode(ids, skip_special_tokens=self._skip_special)

    def update(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed, if any.

        On a stop the text is cut just before the stop string.
        """
        old_len = len(self.text)
        if not self.append(token_id) or not self._stop:
            return None
        # A stop string may straddle the previous text and this delta.
        search_from = max(0, old_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def append(self, token_id: int) -> bool:
        """Append one token, looking for no stop string (below min_tokens none applies);
        whether the text grew (a character split across tokens waits for its last one)."""
        ids = self._token_ids
        ids.append(token_id)
        prefix_text = self._text_of(ids[self._prefix_offset : self._read_offset])
        new_text = self._text_of(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        self.text += new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return True

    @property
    def num_stream_safe_chars(self) -> int:
        """Characters that can be streamed now: the tail that could still
        become the start of a stop string is held back."""
        return max(0, len(self.text) - max(0, self._max_stop_len - 1))
