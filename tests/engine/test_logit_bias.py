"""logit_bias in the sampler, against the logits themselves."""

from __future__ import annotations

import torch

from engine.request import Request, SamplingParams
from engine.sampler import Sampler


def _requests(*params: SamplingParams) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], p, None) for i, p in enumerate(params)]


def test_greedy_rows_take_the_argmax_of_the_biased_logits() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    biases = [{7: 100.0}, {int(logits[1].argmax()): -100.0, 3: 2.5}, {}]
    requests = _requests(
        *(SamplingParams(temperature=0, logit_bias=b or None, logprobs=0) for b in biases)
    )
    out = Sampler(torch.device("cpu"), seed=0)(logits.clone(), requests)
    expected = logits.clone()
    for row, bias in enumerate(biases):
        for token, value in bias.items():
            expected[row, token] += value
    assert out.token_ids == expected.argmax(-1).tolist()
    assert out.token_ids[0] == 7 and out.token_ids[1] != int(logits[1].argmax())
    # Log probabilities are the model's, before the bias.
    raw = torch.log_softmax(logits, -1)
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] is not None
        assert abs(out.logprobs[row][token] - float(raw[row, token])) < 1e-6


def test_sampled_rows_obey_a_ban_and_a_force() -> None:
    logits = torch.zeros(2, 20)
    params = [
        SamplingParams(temperature=1.0, seed=3, logit_bias={i: -100.0 for i in range(19)}),
        SamplingParams(temperature=1.0, seed=4, logit_bias={5: -100.0}),
    ]
    sampler = Sampler(torch.device("cpu"), seed=0)
    seen = set()
    for step in range(50):
        requests = _requests(*params)
        for r in requests:
            r.all_token_ids += [0] * step  # a new output position each time
        out = sampler(logits.clone(), requests)
        assert out.token_ids[0] == 19  # every other token banned
        seen.add(out.token_ids[1])
    assert 5 not in seen and len(seen) > 5
