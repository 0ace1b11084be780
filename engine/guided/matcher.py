"""One sequence's grammar: a compiled spec, the matcher that accepts each token the engine
appends, and the test that the output must end (the grammar took a stop token, or allows
nothing but one next). `grammar_ready` is the scheduler's admission gate."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.errors import GuidedSpecError
from engine.request import Request

if TYPE_CHECKING:
    import xgrammar as xgr


@dataclass(frozen=True, slots=True)
class CompiledSpec:
    """A compiled grammar, a token filter its rows also get (an int32 bitmask row to AND
    with the grammar's, or None), and the JSON schema's end checks: (JSON pointer, keyword)
    pairs the grammar does not enforce, so the finished document must be validated."""

    grammar: xgr.CompiledGrammar
    token_filter: torch.Tensor | None
    end_checks: tuple[tuple[str, str], ...] = ()


def timeout_message(timeout: float) -> str:
    return f"the grammar did not compile within {timeout:g} s; simplify it"


# -- per sequence --------------------------------------------------------------------------


class _EndCheck:
    """Does a matcher allow nothing but stop tokens next? Then its grammar can only end."""

    def __init__(self, stop_token_ids: Sequence[int], vocab_size: int) -> None:
        words = np.full((vocab_size + 31) // 32, 0xFFFFFFFF, dtype=np.uint32)
        for token in stop_token_ids:
            words[token // 32] &= ~np.uint32(1 << (token % 32))
        self.not_stop = torch.from_numpy(words.view(np.int32))
        self._scratch = self.new_scratch()  # the engine thread's

    def must_end(self, matcher: xgr.GrammarMatcher, token_filter: torch.Tensor | None) -> bool:
        if matcher.is_terminated():
            return True
        return matcher.is_completed() and self._only_stop(matcher, token_filter, self._scratch)

    def matches_only_empty(self, compiled: CompiledSpec) -> bool:
        """On a compile thread: does the grammar allow nothing but a stop token at the start?"""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled.grammar)
        return matcher.is_completed() and self._only_stop(
            matcher, compiled.token_filter, self.new_scratch()
        )

    def _only_stop(
        self, matcher: xgr.GrammarMatcher, token_filter: torch.Tensor | None, scratch: torch.Tensor
    ) -> bool:
        matcher.fill_next_token_bitmask(scratch)
        others = scratch[0] & self.not_stop
        if token_filter is not None:
            others &= token_filter
        return not bool(others.any())

    def new_scratch(self) -> torch.Tensor:
        return torch.zeros(1, self.not_stop.numel(), dtype=torch.int32)


class SequenceGrammar:
    """One sequence's grammar: waits for its compile, then matches the tokens it appends.

    The matcher accepts exactly the tokens appended to the sequence, once each: a
    recompute after preemption samples nothing new until it has caught up, so it never
    advances the matcher twice.
    """

    __slots__ = ("future", "matcher", "token_filter", "_deadline", "_timeout", "_end_check")

    def __init__(self, future: Future[Any], timeout: float, end_check: _EndCheck) -> None:
        self.future = future
        self.matcher: xgr.GrammarMatcher | None = None
        self.token_filter: torch.Tensor | None = None
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._end_check = end_check

    def try_start(self, now: float) -> bool:
        """True once the matcher exists. Raises GuidedSpecError when the compile failed or
        ran past its deadline."""
        if self.matcher is not None:
            return True
        if not self.future.done():
            if now > self._deadline:
                raise GuidedSpecError(timeout_message(self._timeout))
            return False
        result = self.future.result()
        if isinstance(result, GuidedSpecError):
            raise result
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(result.grammar)
        self.token_filter = result.token_filter
        return True

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar rejects it (a masking bug)."""
        assert self.matcher is not None
        return self.matcher.accept_token(token_id)

    def must_end(self) -> bool:
        """The grammar took a stop token, or it is complete and allows nothing else."""
        assert self.matcher is not None
        return self._end_check.must_end(self.matcher, self.token_filter)


def grammar_ready(request: Request) -> bool:
    """Scheduler admission gate: a guided request waits until its matcher exists."""
    return request.grammar is None or request.grammar.matcher is not None
