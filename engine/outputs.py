"""What the engine hands back: per-sequence updates from a step, and finished results."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SequenceUpdate:
    """One sequence's progress in one step. `request_id` is the caller's id;
    `index` tells the n > 1 samples of one request apart."""

    request_id: str
    index: int
    new_token_ids: list[int]
    # The output text appended since this sequence's last update that is safe to show (a stop
    # string's lookahead held back until it cannot start one): a stream of n tokens carries
    # its text once, not the whole text so far at every step.
    text_delta: str
    new_logprobs: list[dict[int, float]] | None
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_time: float = 0.0  # seconds from arrival to first being scheduled
    # Seconds from the sequence's first token to this update: a FINAL_ONLY update's tokens
    # were made over that time (its reader's time to first token is that much earlier); 0
    # where each step's tokens are sent in that step.
    decode_time: float = 0.0
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def followed_by(self, later: SequenceUpdate) -> SequenceUpdate:
        """This update and the same sequence's next one as one update (for a reader that was
        a step behind): tokens, text and logprobs joined, the later one's ending."""
        logprobs = None
        if self.new_logprobs is not None or later.new_logprobs is not None:
            logprobs = (self.new_logprobs or []) + (later.new_logprobs or [])
        return SequenceUpdate(
            request_id=self.request_id,
            index=self.index,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            text_delta=self.text_delta + later.text_delta,
            new_logprobs=logprobs,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=max(self.num_cached_tokens, later.num_cached_tokens),
            queue_time=self.queue_time,
            decode_time=later.decode_time,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            error=later.error,
        )


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    def apply(self, update: SequenceUpdate) -> None:
        out = self.outputs[update.index]
        out.token_ids.extend(update.new_token_ids)
        out.text += update.text_delta
        if update.new_logprobs is not None:
            out.logprobs = (out.logprobs or []) + update.new_logprobs
        if update.finished:
            out.finish_reason = update.finish_reason
            out.stop_reason = update.stop_reason
        self.num_cached_tokens = max(self.num_cached_tokens, update.num_cached_tokens)
        if update.error:
            self.error = update.error
