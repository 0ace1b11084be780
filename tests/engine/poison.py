"""Fault injection: sampling parameters that make the engine's step raise.

A real bug or bad input that only one request triggers is what containment is for; this
stands in for one. The class lives in a module of its own so that it pickles into the
engine process (spawned children import it by name from the same sys.path).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.frontend.client import EngineClient
from engine.messages import EngineRequest
from engine.request import SamplingParams


class Poison(RuntimeError):
    pass


@dataclass(slots=True)
class PoisonedParams(SamplingParams):
    """Raises inside the sampler from the `fail_from`-th step that samples it on (1: its
    first, the prefill's), every time after, diagnostic re-runs included."""

    fail_from: int = 1
    num_sampled: int = 0

    @property
    def greedy(self) -> bool:
        self.num_sampled += 1
        if self.num_sampled >= self.fail_from:
            raise Poison(f"poisoned at sampling step {self.num_sampled}")
        return self.temperature < 1e-5


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
SHARED = list(range(300, 348))  # three full blocks some victims start with


def victims() -> list[tuple[list[int], SamplingParams]]:
    """Fifteen requests to run beside a poisoned one: greedy and seeded, some sharing a
    prefix with it."""
    out = []
    for i in range(15):
        prompt = [7 + i, 90 + 3 * i, 1000 + i, 12, 13 + i]
        if i % 3 == 0:
            prompt = SHARED + prompt
        out.append((prompt, SEEDED if i % 4 == 1 else GREEDY))
    return out


def poisoned(fail_from: int = 1) -> tuple[list[int], PoisonedParams]:
    params = PoisonedParams(temperature=0, max_tokens=10, ignore_eos=True)
    params.fail_from = fail_from
    return SHARED + [5, 6, 7], params


async def tokens_or_error(
    engine: EngineClient, request_id: str, prompt: list[int], params: SamplingParams
) -> list[int] | str:
    """A request's tokens, or the error it ended with."""
    tokens: list[int] = []
    async for update in engine.generate(EngineRequest(request_id, prompt, params)):
        if update.error:
            return update.error
        tokens.extend(update.new_token_ids)
    return tokens
