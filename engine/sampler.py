"""Turn each sampling request's last-position logits into its next token.

Batched over the step's rows: guided rows are masked to the tokens their
grammar allows (engine.guided); greedy rows take the argmax; random rows go
through penalties, temperature, min-p, top-k and top-p, then sample with the
exponential race (argmax of p / Exp(1) noise), which draws a categorical
sample with one noise vector per row. A seeded request draws each token's noise
from a generator seeded by (seed, output position), so a seed reproduces the same
tokens whatever else shares the batch and however often a step is re-run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.guided import GrammarBitmask
from engine.request import Request


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} for the sampled token and the top-N, or None.
    logprobs: list[dict[int, float] | None]
    # Per row: the drafts speculative decoding accepted, which come before token_ids[i]
    # (engine/spec_decode.py); empty when no row speculated.
    accepted_drafts: list[list[int]] = field(default_factory=list)


def argmax(rows: torch.Tensor) -> torch.Tensor:
    """Per-row argmax, first index on ties (as torch's). On the CPU numpy's SIMD argmax is
    about ten times torch's: 10 vs 110 us for 16 rows of an 8k vocabulary."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.dim() == 2:
        return torch.from_numpy(rows.numpy().argmax(axis=-1))
    return rows.argmax(dim=-1)


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.grammar_bitmask = GrammarBitmask()

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        params = [r.sampling_params for r in requests]
        want_logprobs = [p.logprobs for p in params]
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(n is not None for n in want_logprobs) else None
        )
        logits = self._apply_min_tokens(logits, requests)
        if any(p.logit_bias for p in params):
            logits = self._apply_logit_bias(logits, requests)
        if any(p.needs_penalties for p in params):
            logits = self._apply_penalties(logits, requests)
        # Guided rows only, in place, after the biases: a token the grammar forbids stays
        # forbidden whatever its bias, and the grammar never lifts a bias. min_tokens never
        # leaves such a row without a token: the engine ends a sequence as soon as its grammar
        # allows nothing but a stop token.
        self.grammar_bitmask.apply(logits, requests)

        greedy = [p.greedy for p in params]
        sampled = argmax(logits) if all(greedy) else self._sample(logits, requests, greedy)
        token_ids = sampled.tolist()

        logprobs: list[dict[int, float] | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for i, n in enumerate(want_logprobs):
                if n is None:
                    continue
                row = raw_logprobs[i]
                entry = {token_ids[i]: float(row[token_ids[i]])}
                if n > 0:
                    values, ids = row.topk(n)
                    for tok, lp in zip(ids.tolist(), values.tolist(), strict=True):
                        entry.setdefault(tok, lp)
                logprobs[i] = entry
        return SamplerOutput(token_ids, logprobs)

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [
            i for i, r in enumerate(requests) if r.num_output_tokens < r.sampling_params.min_tokens
        ]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            r = requests[i]
            banned = list(r.sampling_params.stop_token_ids)
            if r.eos_token_id is not None and not r.sampling_params.ignore_eos:
                banned.append(r.eos_token_id)
            if banned:
                logits[i, banned] = float("-inf")
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """OpenAI's logit_bias: each listed token's logit plus its bias (token ids were
        checked against the vocabulary at admission)."""
        logits = logits.clone()
        for i, r in enumerate(requests):
            bias = r.sampling_params.logit_bias
            if not bias:
                continue
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, values)
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i, r in enumerate(requests):
            p = r.sampling_params
            if not p.needs_penalties:
                continue
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(
                    sorted(set(r.all_token_ids)), dtype=torch.long, device=row.device
                )
                vals = row[seen]
                row[seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
            if p.frequency_penalty or p.presence_penalty:
                out = torch.tensor(r.output_token_ids, dtype=torch.long, device=row.device)
                counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                    row.dtype
                )
        return logits

    def probabilities(
        self, logits: torch.Tensor, requests: list[Request], greedy: list[bool]
    ) -> torch.Tensor:
        """Each row's sampling distribution: temperature, min-p, top-k and top-p applied
        (a greedy row's temperature is taken as 1)."""
        params = [r.sampling_params for r in requests]
        device = logits.device
        temps = torch.tensor(
            [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)],
            device=device,
            dtype=logits.dtype,
        )
        scaled = logits / temps.unsqueeze(1)

        min_ps = [p.min_p for p in params]
        if any(min_ps):
            probs = scaled.softmax(dim=-1)
            threshold = torch.tensor(min_ps, device=device).unsqueeze(1) * probs.amax(
                -1, keepdim=True
            )
            scaled = scaled.masked_fill(probs < threshold, float("-inf"))

        top_ks = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_ps = [p.top_p for p in params]
        if any(top_ks) or any(tp < 1.0 for tp in top_ps):
            scaled = _top_k_top_p(scaled, top_ks, top_ps)

        return scaled.softmax(dim=-1)

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], greedy: list[bool]
    ) -> torch.Tensor:
        device = logits.device
        greedy_ids = argmax(logits)
        probs = self.probabilities(logits, requests, greedy)
        noise = torch.empty_like(probs)
        for i, r in enumerate(requests):
            if greedy[i]:
                noise[i].fill_(1.0)
            elif (seed := r.sampling_params.seed) is not None:
                if r.generator is None:
                    r.generator = torch.Generator(device=device)
                r.generator.manual_seed(step_seed(seed, r.num_output_tokens))
                noise[i].exponential_(generator=r.generator)
            else:
                noise[i].exponential_(generator=self.generator)
        sampled = argmax(probs / noise)
        is_greedy = torch.tensor(greedy, device=device)
        return torch.where(is_greedy, greedy_ids, sampled)


_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded row's `step`-th output token (splitmix64 of both).

    A seeded sample is then a function of (seed, step, logits) alone: re-running a step
    (a failed step's retry, recompute after preemption) or sharing the batch with other
    requests never changes it."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=logits.device)
    positions = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = positions >= k.unsqueeze(1)
    p = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
