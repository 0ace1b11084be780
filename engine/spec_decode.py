"""n-gram speculative decoding (prompt lookup): propose, verify in one forward, keep what
the model would have produced.

A running request whose last `n` tokens (prompt_lookup_max down to prompt_lookup_min)
occurred earlier in its prompt or output proposes the tokens that followed that earlier
occurrence as drafts. The next step feeds its last token and the k drafts at once (each
position a decode row of its own over the request's block table, causal by length), and
every position's logits verify the draft after it:

- greedy: drafts are accepted while each equals the argmax before it; the first argmax
  that differs (or the one after the last draft) is the step's extra token. The output is
  the non-speculative output, token for token.
- sampling: draft d at a position whose target distribution is p is accepted with
  probability p(d) (the draft distribution is a point mass); a rejection samples from p
  with d removed, renormalised; all accepted, the next token is sampled from the last p.
  This is rejection sampling (Leviathan et al. 2023) and leaves the output distribution
  that of non-speculative sampling.

Drafts are never among a request's known tokens: their KV is written into slots past the
accepted length, which no block hash covers (only known tokens are hashed and published),
and the next step overwrites it; blocks beyond what the request then needs go back to the
pool (`KVCacheManager.trim`).

Requests whose next token depends on the output so far in ways a draft would break
(penalties, logit bias, min_tokens not reached, logprobs, guided decoding) do not
speculate; they share the batch as usual.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.sampler import argmax, step_seed

if TYPE_CHECKING:
    from engine.request import Request
    from engine.sampler import Sampler

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` for method "ngram", with vLLM's names."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2  # a one-token match is mostly chance

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From the flag's JSON (or a dict); unknown keys are refused, not ignored."""
        raw = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(raw, dict):
            raise ValueError("speculative config must be a JSON object")
        unknown = set(raw) - {"method", "num_speculative_tokens", "prompt_lookup_max",
                              "prompt_lookup_min"}  # fmt: skip
        if unknown:
            raise ValueError(f"unknown speculative config keys: {sorted(unknown)}")
        if "method" not in raw:
            raise ValueError('speculative config needs "method" (only "ngram" is supported)')
        return cls(**raw)


class NgramIndex:
    """Where each n-gram of a request's tokens last ended, kept up to date as tokens come:
    one dict per n, so a proposal costs a few lookups however long the context.

    `propose` finds the longest suffix (prompt_lookup_max down to prompt_lookup_min tokens)
    that occurred before and returns what followed its latest earlier occurrence."""

    __slots__ = ("config", "maps", "indexed")

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        n_range = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in n_range}
        self.indexed = 0  # n-grams ending before this position are in the maps

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        k = min(self.config.num_speculative_tokens, limit)
        total = len(tokens)
        # Index the n-grams ending before the last token: the suffix must occur earlier.
        for end in range(self.indexed, total - 1):
            for n, seen in self.maps.items():
                if end + 1 >= n:
                    seen[tuple(tokens[end + 1 - n : end + 1])] = end + 1
        self.indexed = max(self.indexed, total - 1)
        if k <= 0:
            return []
        for n in reversed(self.maps):
            if total >= n and (follow := self.maps[n].get(tuple(tokens[total - n :]))) is not None:
                return tokens[follow : follow + k]
        return []


def can_speculate(request: Request) -> bool:
    p = request.sampling_params
    return (
        p.guided is None
        and request.grammar is None
        and not p.needs_penalties
        and not p.logit_bias
        and p.logprobs is None
        and request.num_output_tokens >= p.min_tokens
    )


def verify(
    logits: torch.Tensor, request: Request, drafts: list[int], sampler: Sampler
) -> list[int]:
    """The tokens to append (accepted drafts, then one more) from logits [len(drafts) + 1,
    vocab] of the request's last token and its drafts."""
    params = request.sampling_params
    if params.greedy:
        targets = argmax(logits).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        return drafts[:accepted] + [targets[accepted]]
    probs = sampler.probabilities(logits, [request] * len(logits), [False] * len(logits))
    generator = _generator(request, sampler)
    out: list[int] = []
    for j, draft in enumerate(drafts):
        _seed(generator, request, len(out), 0)
        u = torch.rand((), generator=generator, device=probs.device)
        if float(u) < float(probs[j, draft]):
            out.append(draft)
            continue
        residual = probs[j].clone()
        residual[draft] = 0.0
        out.append(_sample(residual, generator, request, len(out)))
        return out
    out.append(_sample(probs[len(drafts)], generator, request, len(out)))
    return out


def _generator(request: Request, sampler: Sampler) -> torch.Generator:
    if request.sampling_params.seed is None:
        return sampler.generator
    if request.generator is None:
        request.generator = torch.Generator(device=sampler.device)
    return request.generator


def _seed(generator: torch.Generator, request: Request, index: int, draw: int) -> None:
    """A seeded request's draws are a function of (seed, output position, which draw)."""
    seed = request.sampling_params.seed
    if seed is not None:
        generator.manual_seed(step_seed(seed, 2 * (request.num_output_tokens + index) + draw))


def _sample(probs: torch.Tensor, generator: torch.Generator, request: Request, index: int) -> int:
    """A categorical draw by the exponential race, as the sampler draws."""
    _seed(generator, request, index, 1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int(argmax((probs / noise).unsqueeze(0))[0])
